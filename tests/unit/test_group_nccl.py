"""Group start-up and faults (issue 30, item 4), on the CPU: a join is bounded by its own
start-up timeout, apart from the collectives'; an NCCL group is formed on the member's
device at the join (``device_id``: the communicator at once, not in the first collective);
the abort the code relies on exists on the installed torch (a missing one fails here, it is
not skipped)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dynabatch.actors.group import ProcessGroup, abort_group
from dynabatch.actors.spec import JobSpec, parse_spec

COLLECTIVE_S = 120.0  # far beyond the start-up timeout: a join must never wait for it
JOIN_S = 1.0


def test_the_abort_the_group_relies_on_exists_on_this_torch():
    # ProcessGroup.abort: what abort_group calls (torch 2.11 and 2.13 both bind it).
    assert callable(getattr(dist.ProcessGroup, "abort", None)), torch.__version__


def test_abort_then_destroy_leaves_no_group():
    group = ProcessGroup(COLLECTIVE_S, JOIN_S)
    group.join(group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    try:
        abort_group()  # on gloo too: the same call, raising nothing
    finally:
        group.leave()
    assert not group.active


def test_a_missing_peer_fails_the_join_within_the_start_up_timeout():
    group = ProcessGroup(COLLECTIVE_S, JOIN_S)
    lonely = group.open_store(1, 2, "gloo", host="127.0.0.1")  # a peer that never comes
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout"):
        group.join(lonely, 0)
    # Bounded by the start-up timeout, far from the collectives' (120 s).
    assert time.monotonic() - t0 < COLLECTIVE_S / 2
    assert not group.active
    # And the member can join the next generation.
    group.join(group.open_store(2, 1, "gloo", host="127.0.0.1"), 0)
    group.leave()


def test_an_nccl_group_is_formed_on_the_members_gpu_at_the_join(monkeypatch):
    """The communicator is created by init_process_group(device_id=...), inside the join
    and its timeout, not lazily by the state broadcast."""
    seen = {}

    def init(backend, **kw):
        seen.update(kw, backend=backend)

    monkeypatch.setattr(dist, "init_process_group", init)
    group = ProcessGroup(COLLECTIVE_S, JOIN_S)
    rv = group.open_store(1, 1, "nccl", host="127.0.0.1")
    with pytest.raises(ValueError, match="NCCL group needs the member's GPU"):
        group.join(rv, 0)
    group.join(rv, 0, torch.device("cuda", 1))
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1)
    assert seen["timeout"].total_seconds() == COLLECTIVE_S  # the collectives' own timeout
    seen.clear()
    rv = group.open_store(2, 1, "gloo", host="127.0.0.1")
    group.join(rv, 0, torch.device("cpu"))
    assert seen["backend"] == "gloo" and seen["device_id"] is None


def test_the_spec_has_a_start_up_timeout_apart_from_the_collectives():
    spec = parse_spec({"collective_timeout_s": 5, "join_timeout_s": 60})
    assert (spec.join_timeout, spec.collective_timeout_s) == (60, 5)
    assert parse_spec({"collective_timeout_s": 7}).join_timeout == 7  # the default


def test_a_worker_joins_with_its_start_up_timeout_and_device(monkeypatch):
    from dynabatch.actors.worker import Worker

    spec = JobSpec.model_validate(
        dict(
            dataset={"name": "synthetic"},
            model={"name": "mlp", "hidden": 8},
            workers=1,
            global_batch=16,
            collective_timeout_s=COLLECTIVE_S,
            join_timeout_s=JOIN_S,
        )
    )
    rng = np.random.default_rng(0)
    w = Worker(
        "w0",
        0,
        spec,
        rng.normal(size=(20, 4)).astype(np.float32),
        rng.integers(0, 3, size=20),
        (4,),
        3,
    )
    assert w.group.join_timeout.total_seconds() == JOIN_S
    assert w.group.timeout.total_seconds() == COLLECTIVE_S
    joined = []
    real = w.group.join
    monkeypatch.setattr(
        w.group,
        "join",
        lambda rv, rank, device=None: (joined.append(device), real(rv, rank, device)),
    )
    w.join(w.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    try:
        assert joined == [torch.device("cpu")]
    finally:
        w.leave()

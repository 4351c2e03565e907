"""The worker outside Ray: one process, a one-rank gloo group. Its reports (positions and
the all-reduced coverage), its error classes, and the device and backend choices that let
one job mix GPU and CPU nodes (the CPU side; the GPU side needs a GPU)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from dynabatch.actors.contracts import SegmentPlan, StepPlan, epoch_order
from dynabatch.actors.group import (
    NCCL_FAULT_ENV,
    choose_backend,
    configure_nccl_fault_handling,
)
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.worker import Worker, pick_device, to_cpu

from bench.worker_probes import fail_from


def _spec(**kw) -> JobSpec:
    base = dict(dataset={"name": "synthetic"}, model={"name": "mlp", "hidden": 8}, workers=1,
                global_batch=16, collective_timeout_s=5)
    base.update(kw)
    return JobSpec.model_validate(base)


@pytest.fixture
def worker():
    spec = _spec()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    w = Worker("w0", 0, spec, x, y, (4,), 3)
    rv = w.group.open_store(1, 1, "gloo", host="127.0.0.1")
    w.join(rv, 0)
    yield w
    w.leave()


def _plan(steps):
    return SegmentPlan(0, 0, 40, tuple(StepPlan(s, s * 16, min(16, 40 - s * 16), s * 16,
                                                min(16, 40 - s * 16)) for s in steps))


def test_worker_reports_positions_and_coverage_and_trains_the_order(worker):
    before = [p.detach().clone() for p in worker.params]
    res = worker.run_segment(_plan([0, 1]))
    assert res.error is None and [s.step for s in res.steps] == [0, 1]
    assert [(s.start, s.samples, s.coverage) for s in res.steps] == [
        (0, 16, ((1, 16),)), (16, 16, ((1, 16),))]
    assert any(not torch.equal(a, b) for a, b in zip(before, worker.params, strict=True))
    # The samples trained are the epoch order's: the loss matches a recomputation.
    order = epoch_order(0, 0, 40)
    assert len(set(order[:32].tolist())) == 32


def test_own_error_is_a_compute_error_and_the_worker_leaves_the_group(worker):
    fail_from(worker, 0, 2)  # the worker's own code raises from step 2 on
    res = worker.run_segment(_plan([1, 2]))
    assert [s.step for s in res.steps] == [1]
    assert res.error_kind == "compute" and "InjectedFault" in res.error
    assert not worker.group.active  # peers blocked in the all-reduce fail fast


def test_state_is_on_the_cpu_and_round_trips(worker):
    worker.run_segment(_plan([0]))
    state = worker.state()
    flat = [v for v in state["optimizer"]["state"].values()] + list(state["model"].values())
    assert all(not isinstance(v, torch.Tensor) or v.device.type == "cpu" for v in flat)
    worker.load_state(state)
    nested = to_cpu({"a": [torch.ones(2)], "b": (torch.zeros(1), 3)})
    assert nested["b"][1] == 3 and nested["a"][0].device.type == "cpu"


def test_backend_is_nccl_only_when_every_member_has_a_gpu():
    assert choose_backend(["cuda:0", "cuda:0"]) == "nccl"
    assert choose_backend(["cuda:0", "cpu"]) == "gloo"
    assert choose_backend([]) == "gloo"


def test_nccl_fault_handling_makes_survivors_raise(monkeypatch):
    for k in NCCL_FAULT_ENV:
        monkeypatch.delenv(k, raising=False)
    configure_nccl_fault_handling()
    # 2: abort the communicator and raise, keeping the process (not 1, which kills it).
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1"


def test_device_choice():
    assert pick_device(_spec(), 0.0).type == "cpu"
    assert pick_device(_spec(worker_gpus="auto"), 0.0).type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no GPU is visible"):
            pick_device(_spec(worker_gpus="auto"), 1.0)


def test_worker_gpus_auto_places_gpu_and_cpu_workers(monkeypatch):
    # Here, not at the top: the GPU tests of this file run where Ray is not installed
    # (bench/gpu_check.py's gpu_tests).
    pytest.importorskip("ray")
    from dynabatch.scheduler.runtime import pool

    nodes = [
        {"Alive": True, "NodeID": "gpu", "Resources": {"CPU": 4.0, "GPU": 1.0}},
        {"Alive": True, "NodeID": "cpu", "Resources": {"CPU": 4.0}},
        {"Alive": False, "NodeID": "dead", "Resources": {"CPU": 4.0, "GPU": 1.0}},
    ]
    monkeypatch.setattr(pool.ray, "nodes", lambda: nodes)
    auto = _spec(worker_gpus="auto")
    eligible = pool.eligible_nodes(auto)
    assert [(n.node_id, auto.gpus_on(n.gpus)) for n in eligible] == [("cpu", 0.0),
                                                                    ("gpu", 1.0)]
    assert [n.node_id for n in pool.eligible_nodes(_spec(worker_gpus=1))] == ["gpu"]


def test_worker_gpus_auto_refuses_device_cpu():
    from dynabatch.actors.spec import SpecError, parse_spec

    with pytest.raises(SpecError, match="worker_gpus: worker_gpus 'auto' places workers on GPUs"):
        parse_spec({"worker_gpus": "auto", "device": "cpu"})


def test_a_failed_join_does_not_change_where_the_next_group_meets():
    """A rendezvous that times out (a peer died) must not shift this member's group name,
    from which torch derives the store prefix: otherwise it never meets its peers again."""
    import torch.distributed as dist
    from dynabatch.actors.group import ProcessGroup

    group = ProcessGroup(timeout_s=1)
    lonely = group.open_store(1, 2, "gloo", host="127.0.0.1")  # a peer that never comes
    with pytest.raises(Exception):  # noqa: B017 - torch raises its own store errors
        group.join(lonely, 0)
    assert not group.active
    group.join(group.open_store(2, 1, "gloo", host="127.0.0.1"), 0)
    try:
        assert dist.distributed_c10d._get_default_group().group_name == "0"
    finally:
        group.leave()


def test_a_visible_gpu_is_picked_when_asked_for(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device(_spec(device="cuda", worker_gpus=1), 1.0) == torch.device("cuda", 0)
    assert pick_device(_spec(worker_gpus="auto"), 1.0) == torch.device("cuda", 0)
    assert pick_device(_spec(device="cpu"), 1.0).type == "cpu"


# --- GPU hygiene (run where a GPU is visible) ----------------------------------------------


def _gpu_worker(monkeypatch, backend: str, allreduce: str, where: str) -> Worker:
    if where == "staged":  # the set does not fit: host memory, staged per micro-batch
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (0, 0))
    spec = _spec(device="cuda", worker_gpus=1, allreduce=allreduce, bucket_kb=1,
                 model={"name": "mlp", "hidden": 64}, optimizer={"name": "sgd", "lr": 0.1})
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    w = Worker("w0", 0, spec, x, y, (4,), 3, gpus=1.0)
    assert w.data.where == where
    w.join(w.group.open_store(1, 1, backend, host="127.0.0.1"), 0)
    return w


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("backend", "allreduce", "where"), [
    ("nccl", "bucketed", "device"), ("nccl", "bucketed", "staged"), ("nccl", "flat", "device"),
    ("gloo", "bucketed", "device"),  # a GPU in a gloo group stages the plan's buckets
])
def test_a_gpu_step_synchronises_once(monkeypatch, backend, allreduce, where):
    """No hidden synchronisation (sync debug mode raises on one: .item(), a pageable copy
    to the host) and one explicit synchronisation per step, at its end; compute and wait
    are device-timed from CUDA events read after it."""
    w = _gpu_worker(monkeypatch, backend, allreduce, where)
    try:
        w.run_segment(_plan([0]))  # warm-up
        calls = []
        real = torch.cuda.synchronize
        monkeypatch.setattr(torch.cuda, "synchronize",
                            lambda *a, **k: (calls.append(1), real(*a, **k))[1])
        torch.cuda.set_sync_debug_mode("error")
        try:
            res = w.run_segment(_plan([1, 2]))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        w.leave()
    assert res.error is None, res.error
    assert len(calls) == 2  # one per step
    for s in res.steps:
        assert s.coverage == ((1, s.samples),) and s.compute_s > 0 and s.wait_s >= 0
        assert s.forward_s > 0 and s.backward_s > 0 and s.loss_sum > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("room", "where"), [(1 << 40, "device"), (0, "staged")])
def test_the_data_gets_the_device_memory_the_model_leaves(monkeypatch, room, where):
    """The budget is decided after the model, its optimizer and the warm-up pass: from the
    model's bytes and the warm-up's activation bytes per sample (both known by then)."""
    import dynabatch.actors.worker as worker_mod

    seen = []

    def budget(free, model, act, micro):
        seen.append((free, model, act, micro))
        return room

    monkeypatch.setattr(worker_mod, "data_budget", budget)
    spec = _spec(device="cuda", worker_gpus=1, micro_batch=5,
                 model={"name": "mlp", "hidden": 64}, optimizer={"name": "adam", "lr": 0.1})
    rng = np.random.default_rng(0)
    w = Worker("w0", 0, spec, rng.normal(size=(40, 4)).astype(np.float32),
               rng.integers(0, 3, size=40), (4,), 3, gpus=1.0)
    (free, model, act, micro), = seen
    assert free > 0 and model == 4 * sum(p.numel() * 4 for p in w.params)
    assert act > 0 and micro == 5
    assert w.data.where == where and w.data.x.is_cuda == (where == "device")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("where", ["device", "staged"])
def test_a_gpu_worker_trains_what_a_cpu_worker_trains(monkeypatch, where):
    w = _gpu_worker(monkeypatch, "nccl", "bucketed", where)
    try:
        gpu = w.run_segment(_plan([0, 1]))
        state = w.state()
    finally:
        w.leave()
    spec = _spec(device="cpu", bucket_kb=1, model={"name": "mlp", "hidden": 64},
                 optimizer={"name": "sgd", "lr": 0.1})
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    c = Worker("w0", 0, spec, x, y, (4,), 3)
    c.join(c.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    try:
        cpu = c.run_segment(_plan([0, 1]))
    finally:
        c.leave()
    for a, b in zip(gpu.steps, cpu.steps, strict=True):
        assert a.loss_sum == pytest.approx(b.loss_sum, rel=1e-4)
    for k, v in c.state()["model"].items():
        assert torch.allclose(state["model"][k], v, atol=1e-5), k

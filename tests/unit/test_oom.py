"""Out of device memory: a classified failure that shrinks the worker's micro-batch.

A worker whose forward or backward runs out of memory reports it as an ``oom`` error with
the micro-batch that did not fit (not as its own compute error); the driver halves the
memory cap of that worker's node and device, every later plan of a worker there carries it,
and the step is retried with the share accumulated over smaller micro-batches. The job
fails only when one sample does not fit.

The out-of-memory error is injected by the tests: a forward pre-hook on the real worker's
model (in-process, a one-rank gloo group), and the simulator's ``oom`` fault (its fault
script) for the real coordinator.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dynabatch.actors.accumulate import largest_micro, tighter_cap
from dynabatch.actors.contracts import SegmentPlan, SegmentResult, StepPlan
from dynabatch.actors.errors import is_out_of_memory
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.worker import Worker
from dynabatch.scheduler.core.failures import (
    Attempts,
    FailureEvent,
    FailurePolicy,
    MemoryCaps,
    Retry,
    WorkerOutcome,
    classify,
)
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.sync.protocol import Position
from dynabatch.scheduler.sim.cluster_spec import Fault
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator

from tests.fakes import Lineages
from tests.unit.test_engine_faults import _assert_exactly_once, _job, _spec

# --- the worker ---------------------------------------------------------------------------


def _worker_spec() -> JobSpec:
    return JobSpec.model_validate(
        dict(
            dataset={"name": "synthetic"},
            model={"name": "mlp", "hidden": 8},
            workers=1,
            global_batch=16,
            collective_timeout_s=5,
        )
    )


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(40, 4)).astype(np.float32), rng.integers(0, 3, size=40)


def _new_worker() -> Worker:
    x, y = _data()
    return Worker("w0", 0, _worker_spec(), x, y, (4,), 3)


def _join(w: Worker, generation: int) -> None:
    w.join(w.group.open_store(generation, 1, "gloo", host="127.0.0.1"), 0)


def _oom_above(w: Worker, limit: int) -> None:
    """The test's injection: the model runs out of memory on more than ``limit`` samples."""

    def hook(_m, args):
        if args[0].shape[0] > limit:
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {args[0].shape[0]} samples"
            )

    w.model.register_forward_pre_hook(hook)


def _one_step(cap: int | None = None) -> SegmentPlan:
    steps = (StepPlan(0, 0, 16, 0, 16),)
    return SegmentPlan(0, 0, 40, steps, micro_cap=cap) if cap else SegmentPlan(0, 0, 40, steps)


def test_out_of_memory_is_recognised_by_type_and_by_message():
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_micro_batch_helpers():
    assert largest_micro(37, None) == 37 and largest_micro(37, 18) == 13
    assert largest_micro(0, 4) == 0
    assert tighter_cap(None, 8) == 8 and tighter_cap(4, 8) == 4 and tighter_cap(None, None) is None


def test_worker_reports_oom_with_the_micro_batch_and_trains_under_the_plan_cap():
    # The reference: the same weights and data, never out of memory (one process holds
    # one group at a time, so it runs first).
    ref, w = _new_worker(), _new_worker()
    _join(ref, 1)
    ok = ref.run_segment(_one_step())
    ref.leave()
    assert ok.error is None and ok.steps[0].micro_batches == 1
    _oom_above(w, 5)
    try:
        _join(w, 2)
        res = w.run_segment(_one_step())
        assert res.error_kind == "oom" and res.oom_batch == 16, res
        assert "OutOfMemoryError" in res.error and res.steps == []
        assert not w.group.active  # peers blocked in the collective fail fast
        # The driver's halved caps: 8 still does not fit, 4 does.
        _join(w, 3)
        res = w.run_segment(_one_step(cap=8))
        assert res.error_kind == "oom" and res.oom_batch == 8
        _join(w, 4)
        res = w.run_segment(_one_step(cap=4))
        assert res.error is None, res.error
        (st,) = res.steps
        assert (st.micro_cap, st.micro_batches, st.samples) == (4, 4, 16)
        # Accumulated over micro-batches, the step is the one the whole share gives.
        for a, b in zip(w.params, ref.params, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    finally:
        w.leave()


# --- classification -----------------------------------------------------------------------


def _failed(worker: str, kind: str, error: str, oom_batch: int | None = None) -> WorkerOutcome:
    return WorkerOutcome(
        worker,
        SegmentResult(
            worker=worker,
            steps=[],
            error=error,
            error_kind=kind,
            failed_compute_s=0.1,
            oom_batch=oom_batch,
        ),
    )


def test_oom_is_its_own_class_and_is_retried_uncounted_until_one_sample():
    peer = _failed("w1", "peer", "DistBackendError: connection closed by peer")
    f = classify(
        [_failed("w0", "oom", "OutOfMemoryError: CUDA out of memory", 32), peer],
        collective_timeout_s=10,
    )
    assert f.oom == {"w0": ("OutOfMemoryError: CUDA out of memory", 32)}
    assert not f.compute and not f.stragglers
    policy, attempts = FailurePolicy(max_retries=0), Attempts()
    at = Position(0, 3)
    for _ in range(5):  # each retry is at a smaller micro-batch: none is charged
        attempts, d = policy.decide(attempts, FailureEvent("segment", position=at, failure=f))
        assert isinstance(d, Retry)
    one = classify([_failed("w0", "oom", "OutOfMemoryError: CUDA out of memory", 1), peer], 10)
    _, d = policy.decide(attempts, FailureEvent("segment", position=at, failure=one))
    why = d.reason
    assert why is not None and "\n" not in why
    assert "w0" in why and "one sample does not fit" in why and "epoch 0 step 3" in why


def test_memory_cap_belongs_to_the_node_and_device():
    caps = MemoryCaps()
    assert caps.ran_out("n1", 1.0, 37) == 18
    assert caps.ran_out("n1", 1.0, 30) == 15  # the smaller of half and what was known
    assert caps.ran_out("n1", 1.0, 40) == 15  # a larger failure does not raise the cap
    assert caps.cap("n1", 1.0) == 15
    assert caps.cap("n1", 0.5) is None and caps.cap("n2", 1.0) is None
    assert caps.ran_out("n2", 1.0, 1) is None  # one sample: nothing smaller to try


# --- the coordinator ----------------------------------------------------------------------


def _coord(*faults: Fault, **kw) -> tuple[Coordinator, SimRuntime, Lineages]:
    """The fault tests' job and cluster; max_retries 0: an out-of-memory retry is not a
    compute failure's retry."""
    return _job(_spec(max_retries=0, **kw), *faults)


def test_the_fastest_worker_out_of_memory_gets_a_smaller_micro_batch_and_the_job_finishes():
    coord, rt, lineages = _coord(Fault(kind="oom", worker=0, epoch=0, step=2, batch=10))
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert any("w0 ran out of memory on a micro-batch of" in x.message for x in coord.logs())
    node = coord.membership.get("w0").node
    assert coord.workforce.memory.cap(node, 0.0) <= 10
    # Every plan of w0 from the failure on carried the cap, and it trained under it.
    capped = [p["w0"] for p in rt.record.plans if p["w0"].micro_cap is not None]
    assert capped and all(p.micro_cap <= 10 for p in capped)
    assert coord.tracker.workers["w0"].micro_cap <= 10
    assert all(p["w1"].micro_cap is None and p["w2"].micro_cap is None for p in rt.record.plans)


def test_a_replacement_on_the_same_node_inherits_the_cap():
    coord, rt, lineages = _coord(
        Fault(kind="oom", worker=0, epoch=0, step=2, batch=10),
        Fault(kind="die", worker=0, epoch=1, step=3),
    )
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert "w0" in rt.record.killed
    (new,) = [w for w in coord.membership.worker_ids if w not in ("w0", "w1", "w2")]
    assert coord.membership.get(new).node == "node00"  # w0's node
    plans = [p[new] for p in rt.record.plans if new in p]
    assert plans and all(p.micro_cap is not None and p.micro_cap <= 10 for p in plans)


def test_one_sample_that_does_not_fit_fails_the_job_with_one_line():
    coord, _, _ = _coord(Fault(kind="oom", worker=1, epoch=0, step=1, batch=0))
    coord.run()
    snap = coord.snapshot()
    assert snap.state == JobState.FAILED
    assert "\n" not in snap.reason
    assert "w1" in snap.reason and "one sample does not fit" in snap.reason, snap.reason


@pytest.mark.parametrize("batch", [1, 7])
def test_the_cap_never_goes_below_what_fits(batch):
    coord, _, _ = _coord(Fault(kind="oom", worker=2, epoch=0, step=0, batch=batch), epochs=1)
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED, coord.snapshot().reason
    node = coord.membership.get("w2").node
    cap = coord.workforce.memory.cap(node, 0.0)
    assert cap <= batch and cap > batch // 2  # halved until it fit, not further


# --- evaluation -----------------------------------------------------------------------------


def _eval_batches(w: Worker) -> list[int]:
    """The batch sizes the model is evaluated on (recorded by a forward pre-hook)."""
    seen: list[int] = []
    w.model.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    return seen


def test_evaluation_batches_follow_the_worker_memory_cap():
    x, y = _data()
    spec = _worker_spec().model_copy(update={"micro_batch": 6})
    w = Worker("w0", 0, spec, x, y, (4,), 3)
    ref = _new_worker().evaluate_shard(x, y, 0, 40)["sums"]
    seen = _eval_batches(w)
    assert w.evaluate_shard(x, y, 0, 40)["sums"] == pytest.approx(ref)
    assert seen and max(seen) <= 6  # not the fixed 1024
    # The node's memory cap learned by the driver (SegmentPlan.micro_cap) tightens it too.
    _join(w, 1)
    try:
        w.run_segment(_one_step(cap=4))
    finally:
        w.leave()
    seen.clear()
    w.evaluate_shard(x, y, 0, 40)
    assert max(seen) <= 4


def test_out_of_memory_in_evaluation_halves_its_batch_and_retries():
    x, y = _data()
    ref = _new_worker().evaluate_shard(x, y, 0, 40)["sums"]
    w = _new_worker()
    _oom_above(w, 7)
    seen = _eval_batches(w)
    out = w.evaluate_shard(x, y, 0, 40)
    assert out["sums"] == pytest.approx(ref)
    assert max(seen) <= 7
    seen.clear()
    w.evaluate_shard(x, y, 0, 40)  # the halved batch is kept: no out-of-memory again
    assert max(seen) <= 7 and len(seen) == -(-40 // max(seen))


def test_evaluation_fails_when_one_sample_does_not_fit():
    x, y = _data()
    w = _new_worker()
    _oom_above(w, 0)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        w.evaluate_shard(x, y, 0, 40)

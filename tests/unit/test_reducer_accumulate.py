"""The bucketed all-reduce and micro-batch accumulation, on a one-rank gloo group (the
multi-worker sums are checked against one process in tests/integration/test_training.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from actors.accumulate import micro_cap, micro_ranges
from actors.contracts import SegmentPlan, StepPlan
from actors.reducer import plan_buckets
from actors.spec import JobSpec
from actors.worker import Worker


@given(st.integers(0, 500), st.one_of(st.none(), st.integers(1, 64)))
def test_micro_ranges_cover_the_share_within_the_cap(size, cap):
    r = micro_ranges(size, cap)
    assert [x for lo, hi in r for x in range(lo, hi)] == list(range(size))
    if cap is not None and size:
        assert len(r) == -(-size // cap)
        assert all(hi - lo <= cap for lo, hi in r)
        assert max(hi - lo for lo, hi in r) - min(hi - lo for lo, hi in r) <= 1


def test_micro_cap_per_ordinal():
    assert micro_cap(None, 3) is None and micro_cap(8, 3) == 8
    assert micro_cap([4, 8], 1) == 8 and micro_cap([4, 8], 2) is None


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=30), st.integers(1, 3000))
def test_buckets_are_contiguous_from_the_end_and_cover_every_parameter(sizes, cap):
    b = plan_buckets(sizes, cap)
    assert b[0][1] == sum(sizes) and b[-1][0] == 0
    assert all(b[k][0] == b[k + 1][1] for k in range(len(b) - 1))
    assert sorted(i for _, _, m in b for i in m) == list(range(len(sizes)))
    # Each bucket but the last reached the cap with its last parameter and not before.
    offs = np.concatenate(([0], np.cumsum(sizes)))
    for lo, hi, m in b:
        assert lo == offs[min(m)] and hi == offs[max(m) + 1]
        assert hi - lo < cap or hi - lo - sizes[min(m)] < cap


def _worker(**kw) -> Worker:
    spec = JobSpec.model_validate(dict(
        dataset={"name": "synthetic"}, model={"name": "lenet"}, workers=1, global_batch=24,
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}, collective_timeout_s=5, **kw))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 64)).astype(np.float32)
    y = rng.integers(0, 3, size=48)
    return Worker("w0", 0, spec, x, y, (64,), 3)


def _train(w: Worker) -> list:
    rv = w.group.open_store(1, 1, "gloo", host="127.0.0.1")
    w.join(rv, 0)
    try:
        plan = SegmentPlan(0, 0, 48, tuple(StepPlan(s, s * 24, 24, s * 24, 24)
                                           for s in range(2)))
        res = w.run_segment(plan)
    finally:
        w.leave()
    assert res.error is None, res.error
    return res.steps


@pytest.mark.parametrize("kw", [
    {"micro_batch": 5}, {"micro_batch": [7]}, {"allreduce": "flat"},
    {"allreduce": "bucketed", "bucket_kb": 1, "micro_batch": 10},
])
def test_accumulated_and_bucketed_steps_equal_one_flat_batch(kw):
    ref = _worker(allreduce="flat")
    ref_steps = _train(ref)
    w = _worker(**kw)
    steps = _train(w)
    cap = micro_cap(kw.get("micro_batch"), 0)
    assert [s.micro_batches for s in steps] == [len(micro_ranges(24, cap))] * 2
    assert [s.coverage for s in steps] == [s.coverage for s in ref_steps] == [((1, 24),)] * 2
    for s, r in zip(steps, ref_steps, strict=True):
        assert s.loss_sum == pytest.approx(r.loss_sum, rel=1e-5)
    for a, b in zip(w.model.state_dict().values(), ref.model.state_dict().values(),
                    strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_bucketed_all_reduce_is_launched_from_backward_hooks():
    w = _worker(allreduce="bucketed", bucket_kb=1)
    assert len(w.reducer._buckets) > 1
    steps = _train(w)
    # The first bucket went out before compute ended (during backward), not after it.
    assert all(s.overlap_s > 0 for s in steps)
    assert all(s.backward_s > 0 and s.forward_s > 0 and s.step_s >= s.compute_s
               for s in steps)
    flat = _worker(allreduce="flat")
    assert all(s.overlap_s <= 0 for s in _train(flat))

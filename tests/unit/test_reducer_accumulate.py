"""The bucketed all-reduce and micro-batch accumulation, on a one-rank gloo group (the
multi-worker sums are checked against one process in tests/integration/test_training.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from dynabatch.actors.accumulate import micro_cap, micro_ranges
from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.actors.reducer import (
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    MIN_BUCKET_BYTES,
    GradientReducer,
    StepMarks,
    auto_bucket_bytes,
    hidden_seconds,
    plan_buckets,
)
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.worker import Worker
from hypothesis import given
from hypothesis import strategies as st

from tests.fakes import reduced_steps


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
    reduced = reduced_steps(w.reducer)
    steps = _train(w)
    # Buckets went out during backward, and their communication overlapped it.
    assert reduced[-1].early == w.reducer.n_buckets
    assert all(s.overlap_s > 0 for s in steps)
    assert all(s.backward_s > 0 and s.forward_s > 0 and s.step_s >= s.compute_s
               for s in steps)
    flat = _worker(allreduce="flat")
    assert all(s.overlap_s <= 0 for s in _train(flat))


# --- bucket sizes ---------------------------------------------------------------------


def _model_sizes(name: str, shape=(1, 28, 28), **kw) -> list[int]:
    from dynabatch.actors.spec import ModelSpec
    from dynabatch.actors.workloads.models import build_model

    m = build_model(ModelSpec.model_validate({"name": name, **kw}), shape, 10)
    return [p.numel() for p in m.parameters()]


def _auto_buckets(sizes: list[int]) -> list:
    first, rest = auto_bucket_bytes(4 * sum(sizes))
    return plan_buckets(sizes, rest // 4, first // 4)


def test_default_buckets_give_the_benchmark_models_several_buckets_on_a_gpu():
    """DDP's 25 MiB (1 MiB first) would give LeNet and the small ResNet one bucket each:
    launched with the last gradient, nothing to overlap."""
    assert len(plan_buckets(_model_sizes("lenet"), (25 << 20) // 4, (1 << 20) // 4)) == 1
    assert len(_auto_buckets(_model_sizes("lenet"))) >= 2
    assert len(_auto_buckets(_model_sizes("resnet"))) >= 3
    # A tiny model: one bucket (a collective's fixed cost would outweigh what it hides).
    assert len(_auto_buckets(_model_sizes("mlp", (64,), hidden=32))) == 1


@given(st.integers(1, 10**9))
def test_cpu_buckets_are_ddps(model_bytes):
    # gloo reduces on the cores backward uses: measured slower than one bucket (reducer).
    assert auto_bucket_bytes(model_bytes, gpu=False) == (DDP_FIRST_BUCKET_BYTES,
                                                          DDP_BUCKET_BYTES)


def test_a_cpu_reducer_gives_lenet_ddps_single_bucket():
    sizes = _model_sizes("lenet")
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    reducer = GradientReducer(params, torch.device("cpu"), max_step=8)
    assert reducer.n_buckets == 1 and reducer.plan.bucket_bytes == (1 << 20, 25 << 20)


@given(st.integers(1, 10**9))
def test_auto_bucket_sizes_are_a_quarter_of_the_model_within_ddps_bounds(model_bytes):
    first, rest = auto_bucket_bytes(model_bytes)
    assert MIN_BUCKET_BYTES <= rest <= DDP_BUCKET_BYTES
    assert first <= DDP_FIRST_BUCKET_BYTES and first <= rest
    if MIN_BUCKET_BYTES * 4 <= model_bytes <= DDP_BUCKET_BYTES * 4:
        assert rest == model_bytes // 4


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=30), st.integers(1, 3000),
       st.integers(1, 3000))
def test_the_first_bucket_closes_at_its_own_cap(sizes, cap, first):
    b = plan_buckets(sizes, cap, first)
    assert b[0][1] == sum(sizes) and b[-1][0] == 0
    lo, hi, m = b[0]
    assert hi - lo < first or hi - lo - sizes[min(m)] < first
    assert hi - lo >= first or len(b) == 1
    rest = plan_buckets(sizes[:min(m)], cap) if min(m) else []
    assert b[1:] == rest


def test_a_large_model_gets_ddps_sizes():
    sizes = [4 << 20] * 40  # 40 parameters of 16 MiB: 640 MiB of gradients
    b = _auto_buckets(sizes)
    assert b[0][1] - b[0][0] == 4 << 20  # a single parameter larger than the 1 MiB cap
    assert all(hi - lo <= (25 << 20) // 4 + (4 << 20) for lo, hi, _ in b)


# --- hidden communication ---------------------------------------------------------------

_span = st.tuples(st.floats(0, 10), st.floats(0, 5)).map(lambda t: (t[0], t[0] + t[1]))


@given(st.lists(_span, max_size=8), st.floats(0, 20))
def test_hidden_time_is_the_union_of_flights_before_compute_ends(spans, until):
    h = hidden_seconds(spans, until)
    assert 0.0 <= h <= sum(e - s for s, e in spans) + 1e-9
    if spans:
        assert h <= max(0.0, until - min(s for s, _ in spans)) + 1e-9
    # Monotone in the end of compute, and exact on a fine grid.
    assert hidden_seconds(spans, until + 1.0) >= h - 1e-9
    grid = np.linspace(0.0, until, 2001)[:-1] + until / 4000
    covered = sum(any(s <= t <= e for s, e in spans) for t in grid) * until / 2000
    assert h == pytest.approx(covered, abs=until / 2000 * (2 * len(spans) + 1) + 1e-9)


def test_hidden_time_examples():
    assert hidden_seconds([(0, 1), (2, 3)], 10) == 2
    assert hidden_seconds([(0, 2), (1, 3)], 10) == 3  # overlapping flights count once
    assert hidden_seconds([(0, 2), (1, 3)], 1.5) == 1.5
    assert hidden_seconds([(5, 6)], 4) == 0  # launched after compute: nothing hidden
    assert hidden_seconds([], 4) == 0


def test_step_marks_on_the_cpu_are_host_seconds():
    marks = StepMarks(torch.device("cpu"))
    marks.begin()
    m = marks.mark()
    assert isinstance(m, float) and 0 <= marks.seconds(m) < 1


# --- the reducer in a worker's step --------------------------------------------------------


def test_overlap_is_measured_as_communication_hidden_behind_compute():
    w = _worker(allreduce="bucketed", bucket_kb=1)
    reduced = reduced_steps(w.reducer)
    steps = _train(w)
    red = reduced[-1]
    assert red.buckets == w.reducer.n_buckets > 1
    assert red.early == red.buckets  # every bucket went out from backward's hooks
    # Some communication ran while backward went on, never more than the compute itself.
    assert all(0 < s.overlap_s <= s.compute_s + 1e-3 for s in steps)


def test_goodput_norms_are_read_per_bucket_and_keep_the_overlap():
    """|g_i|² is summed over the buckets just before each goes out, so the buckets still
    leave from the hooks; the value is the flat buffer's norm."""
    plan = SegmentPlan(0, 0, 48, (StepPlan(0, 0, 24, 0, 24, noise=True),
                                  StepPlan(1, 24, 24, 24, 24, noise=True)))
    out = {}
    for kw in ({"allreduce": "bucketed", "bucket_kb": 1}, {"allreduce": "flat"}):
        w = _worker(**kw)
        reduced = reduced_steps(w.reducer)
        w.join(w.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
        try:
            res = w.run_segment(plan)
        finally:
            w.leave()
        assert res.error is None, res.error
        out[kw["allreduce"]] = (res.steps, reduced[-1])
    steps, red = out["bucketed"]
    assert red.early == red.buckets > 1 and all(s.overlap_s > 0 for s in steps)
    for s, f in zip(steps, out["flat"][0], strict=True):
        # One worker: its local gradient is the global one; and the same as flat mode's.
        assert s.local_sqnorm == pytest.approx(s.global_sqnorm, rel=1e-5)
        assert s.local_sqnorm == pytest.approx(f.local_sqnorm, rel=1e-5)
        assert s.global_sqnorm == pytest.approx(f.global_sqnorm, rel=1e-5) and s.global_sqnorm > 0


def test_a_bucket_leaves_a_hook_only_after_the_pace():
    """The emulated slowdown is applied before each bucket goes out (the reducer calls the
    pace first), so a slowed worker's buckets leave when a slow one's would."""
    w = _worker(allreduce="bucketed", bucket_kb=1)
    w.join(w.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    r = w.reducer
    try:
        calls = []
        r.begin(24, pace=lambda: (calls.append(r.marks.mark()), time.sleep(0.05)))
        r.arm()
        xb, yb = torch.from_numpy(w.data.x[:24].numpy()), w.data.y[:24]
        (w.objective.loss_sum(w.model(xb), yb) / 24).backward()
        red = r.finish()
    finally:
        w.leave()
    assert calls and red.early == red.buckets
    assert red.first_launch_s >= r.marks.seconds(calls[0]) + 0.05


def test_emulated_slowness_is_applied_before_the_buckets_leave():
    """A worker slowed 6x sends its first bucket after 6x the compute that precedes it, not
    at full speed: later than a sixth of its (emulated) compute."""
    w = _worker(allreduce="bucketed", bucket_kb=1, emulation={"slowdowns": [6]})
    reduced = reduced_steps(w.reducer)
    steps = _train(w)
    red = reduced[-1]
    assert red.early == red.buckets
    assert red.first_launch_s > 1.5 * steps[-1].compute_s / 6


def test_backward_time_leaves_out_the_emulated_sleep(monkeypatch):
    """The pace sleeps inside backward (in a hook); backward_s reports backward's own time,
    as before the slowdown moved there (compute_s carries the slowdown)."""
    w = _worker(allreduce="bucketed", bucket_kb=1, emulation={"slowdowns": [2]})
    clock = w._clock

    def pace(_factor: float) -> float:
        time.sleep(0.1)
        clock.slept += 0.1
        return 0.0

    monkeypatch.setattr(clock, "pace", pace)
    reduced = reduced_steps(w.reducer)
    steps = _train(w)
    assert reduced[-1].early == w.reducer.n_buckets > 1
    # Each step slept at least 0.1 s per launch in backward, none of it in backward_s.
    assert all(s.backward_s < 0.08 and s.step_s > 0.2 for s in steps)


@pytest.mark.parametrize("kw", [
    {"allreduce": "flat"}, {"allreduce": "bucketed"}, {"micro_batch": 5},
    {"allreduce": "bucketed", "bucket_kb": 1, "micro_batch": 10},
])
def test_isgd_batch_loss_rides_in_the_gradient_all_reduce(kw, monkeypatch):
    # Issue 21: ISGD's ψ comes home in the loss slot of the gradient's collective, beside the
    # coverage; no other collective runs in a step that flags nothing.
    from dynabatch.actors.contracts import ControlChart, IsgdPlan

    w = _worker(**kw)
    rv = w.group.open_store(1, 1, "gloo", host="127.0.0.1")
    w.join(rv, 0)
    calls: list[int] = []
    real = torch.distributed.all_reduce

    def counted(t, *a, **k):
        calls.append(t.numel())
        return real(t, *a, **k)
    monkeypatch.setattr(torch.distributed, "all_reduce", counted)
    try:
        plan = SegmentPlan(0, 0, 48, tuple(StepPlan(s, s * 24, 24, s * 24, 24)
                                           for s in range(2)),
                           isgd=IsgdPlan(ControlChart(4, 3.0), 0.1, 5, monitor=False))
        res = w.run_segment(plan)
    finally:
        w.leave()
    assert res.error is None, res.error
    for s in res.steps:
        assert s.isgd_loss == pytest.approx(s.loss_sum / 24, rel=1e-6)
        assert not s.flagged and s.extra_iters == 0
        assert s.coverage == ((1, 24),)
    # Only the gradient buckets (the first one with the loss and coverage slots).
    assert len(calls) == 2 * w.reducer.n_buckets if kw.get("allreduce") != "flat" else 2
    assert sum(calls) == 2 * (w.reducer.n_params + 1 + 24)

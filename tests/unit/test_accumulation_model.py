"""The step-time model and the policy account for micro-batch accumulation."""

from __future__ import annotations

import math

import numpy as np
from dynabatch.actors.contracts import StepTelemetry
from dynabatch.scheduler.core.sync.allocation import WorkerTelemetry
from dynabatch.scheduler.core.sync.policy import AffinePolicy
from dynabatch.scheduler.core.sync.steptime import (
    StepTimeStats,
    accumulation_slope,
    fit,
)
from dynabatch.scheduler.core.sync.tracker import Tracker
from hypothesis import given
from hypothesis import strategies as st


def accumulated_step_time(a: float, c: float, batch: float, micro: float | None) -> float:
    """A worker's step time for a share of ``batch`` computed in micro-batches of at most
    ``micro``: every micro-batch pays the overhead, t(b) = ceil(b / m)·a + c·b."""
    k = 1 if micro is None or batch <= micro else math.ceil(batch / micro)
    return k * a + c * batch


@given(st.floats(0, 1), st.floats(1e-4, 1), st.integers(1, 4096), st.integers(1, 512))
def test_envelope_bounds_the_accumulated_step_within_one_overhead(a, c, b, m):
    t = accumulated_step_time(a, c, b, m)
    assert t == math.ceil(b / m) * a + c * b if b > m else t == a + c * b
    env = a + float(accumulation_slope(np.array([a]), np.array([c]), np.array([m]))[0]) * b
    assert t <= env + 1e-9 and env - a <= t + 1e-9


def _stats(a: float, c: float) -> StepTimeStats:
    s = StepTimeStats()
    for b in (8, 16, 32, 48, 64):
        s = s.add(b, a + c * b)
    return s


def test_affine_gives_a_memory_capped_worker_a_share_above_its_cap_by_speed():
    a, c = 0.01, 0.001
    tele = [WorkerTelemetry("fast", stats=_stats(a, c), samples=1, compute_s=1.0),
            WorkerTelemetry("capped", stats=_stats(a, c), samples=1, compute_s=1.0, micro=16)]
    d = AffinePolicy(shared_overhead=False).decide(tele, 256, 256 * 10)
    fast, capped = d.allocation.batches
    # Not limited to its micro-batch: it accumulates, and pays one overhead per micro-batch.
    assert capped > 16 and fast > capped
    t_fast = accumulated_step_time(a, c, fast, None)
    t_capped = accumulated_step_time(a, c, capped, 16)
    assert abs(t_fast - t_capped) <= a + c  # equal finish within one overhead
    uncapped = AffinePolicy(shared_overhead=False).decide(
        [WorkerTelemetry("fast", stats=_stats(a, c), samples=1, compute_s=1.0),
         WorkerTelemetry("capped", stats=_stats(a, c), samples=1, compute_s=1.0)], 256, 2560)
    assert uncapped.allocation.batches == (128, 128)


def test_tracker_fits_an_accumulating_worker_per_micro_batch():
    a, c, m = 0.02, 0.001, 10
    tr = Tracker()
    tr.add("w", 1.0)
    steps = []
    for i, b in enumerate([7, 12, 15, 19, 27, 35, 44]):  # micro-batches of 6 to 10
        k = -(-b // m)
        steps.append(StepTelemetry(worker="w", epoch=0, step=i, batch=b, samples=b,
                                   compute_s=accumulated_step_time(a, c, b, m), wait_s=0.0,
                                   loss_sum=0.0, micro_batches=k, micro_cap=m))
    tr.observe("w", steps)  # each size's first step pays one-off costs: not fitted
    assert tr.workers["w"].stats.empty
    tr.observe("w", steps)
    f = fit(tr.workers["w"].stats)
    assert f is not None and abs(f.a - a) < 1e-6 and abs(f.c - c) < 1e-7
    (t,) = tr.telemetry(["w"], None)
    assert t.micro == m

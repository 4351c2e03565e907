"""The step-time model t(b) = a + c·b: fitting, equal finish, rounding; DBS vs affine."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from dynabatch.scheduler.core.sync.allocation import WorkerTelemetry, make_allocation
from dynabatch.scheduler.core.sync.policy import AffinePolicy, DBSPolicy
from dynabatch.scheduler.core.sync.steptime import (
    AffineFit,
    StepTimeStats,
    equal_finish,
    fit,
    fit_arrays,
    round_to_total,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")
SETTINGS = settings(max_examples=200, deadline=None)


def stats_of(observations, decay: float = 1.0) -> StepTimeStats:
    s = StepTimeStats()
    for b, t in observations:
        s = s.add(float(b), float(t), decay)
    return s


# --------------------------------------------------------------------------------------
# fit


@SETTINGS
@given(
    a=st.floats(0.0, 1.0),
    c=st.floats(1e-6, 1.0),
    b1=st.integers(1, 2048),
    ratio=st.floats(1.2, 8.0),
    k1=st.integers(1, 5),
    k2=st.integers(1, 5),
    decay=st.sampled_from([1.0, 0.9, 0.5]),
    extra=st.lists(st.integers(1, 4096), max_size=4),
)
def test_fit_recovers_a_and_c_from_noiseless_observations(a, c, b1, ratio, k1, k2, decay, extra):
    b2 = math.ceil(b1 * ratio)
    batches = [b1] * k1 + [b2] * k2 + extra
    s = stats_of([(b, a + c * b) for b in batches], decay)
    mean = s.sb / s.n
    assume(s.sbb / s.n - mean * mean > (0.05 * mean) ** 2 * 1.01)  # enough spread
    f = fit(s)
    assert f is not None
    scale = a + c * max(batches)  # a step's time: the natural tolerance unit for a
    assert f.c == pytest.approx(c, rel=1e-6)
    assert f.a == pytest.approx(a, abs=1e-7 * scale)


def test_fit_exact_two_batch_sizes():
    f = fit(stats_of([(32, 0.01 + 0.001 * 32), (48, 0.01 + 0.001 * 48)]))
    assert f == AffineFit(pytest.approx(0.01), pytest.approx(0.001))


@SETTINGS
@given(a=st.floats(0.0, 1.0), c=st.floats(1e-6, 1.0), b=st.integers(1, 4096), k=st.integers(1, 6))
def test_fit_single_batch_size_falls_back_to_proportional(a, c, b, k):
    f = fit(stats_of([(b, a + c * b)] * k))
    assert f is not None
    assert f.a == 0.0
    assert f.c == pytest.approx((a + c * b) / b, rel=1e-9)  # DBS's t = c·b through the point


def test_fit_without_usable_data():
    assert fit(StepTimeStats()) is None
    assert fit(stats_of([(16, 0.0), (32, 0.0)])) is None  # zero seconds: no speed
    a, c = fit_arrays(*(np.array([v]) for v in (0.0, 0.0, 0.0, 0.0, 0.0)))
    assert np.isnan(a[0]) and np.isnan(c[0])


def test_fit_negative_intercept_refits_through_origin():
    # t = -0.01 + 0.002 b: an overhead below zero is noise; refit t = c·b
    s = stats_of([(10, 0.01), (20, 0.03)])
    f = fit(s)
    assert f.a == 0.0
    assert f.c == pytest.approx(s.sbt / s.sbb)


def test_fit_nonpositive_slope_falls_back_to_proportional():
    s = stats_of([(10, 0.05), (20, 0.04)])
    f = fit(s)
    assert f == AffineFit(0.0, pytest.approx(s.st / s.sb))


def test_decay_makes_new_observations_dominate():
    old = [(b, 0.01 + 0.001 * b) for b in (16, 32)] * 10
    new = [(b, 0.02 + 0.004 * b) for b in (16, 32)] * 10  # the worker became 4x slower
    decayed = fit(stats_of(old + new, decay=0.5))
    assert decayed.a == pytest.approx(0.02, rel=1e-4)
    assert decayed.c == pytest.approx(0.004, rel=1e-4)
    # without decay, old and new weigh the same: the fit sits in between
    plain = fit(stats_of(old + new, decay=1.0))
    assert 0.001 * 1.5 < plain.c < 0.004 * 0.9
    # the most recent observation always carries weight 1, older ones decay**age
    s = StepTimeStats().add(10, 1.0).add(10, 1.0, decay=0.5)
    assert s.n == 1.5 and s.st == 1.5


def random_stats(draw) -> StepTimeStats:
    if draw(st.booleans()):
        vals = draw(st.lists(st.just(0.0) | st.floats(1e-3, 1e4), min_size=5, max_size=5))
        return StepTimeStats(*vals)
    obs = draw(
        st.lists(st.tuples(st.integers(1, 2048), st.just(0.0) | st.floats(1e-6, 10.0)), max_size=6)
    )
    return stats_of(obs, draw(st.sampled_from([1.0, 0.7])))


@SETTINGS
@given(data=st.data())
def test_fit_arrays_agrees_with_fit(data):
    rows = [random_stats(data.draw) for _ in range(data.draw(st.integers(1, 8)))]
    cols = [np.array([getattr(s, k) for s in rows]) for k in ("n", "sb", "st", "sbb", "sbt")]
    a, c = fit_arrays(*cols)
    for i, s in enumerate(rows):
        f = fit(s)
        if f is None:
            assert np.isnan(a[i]) and np.isnan(c[i])
        else:
            assert a[i] == pytest.approx(f.a, rel=1e-12, abs=1e-300)
            assert c[i] == pytest.approx(f.c, rel=1e-12)
            assert f.c > 0.0 and f.a >= 0.0


# --------------------------------------------------------------------------------------
# equal_finish


@st.composite
def finish_problems(draw):
    n = draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    a = rng.uniform(0.0, 0.05, n) * (rng.random(n) < draw(st.sampled_from([0.0, 0.7, 1.0])))
    c = 10 ** rng.uniform(-5, -1, n)
    lo = rng.integers(0, 5, n).astype(float)
    hi = lo + rng.integers(0, 200, n) * (rng.random(n) < 0.9)
    total = float(draw(st.floats(0.0, 1.0)) * (hi.sum() - lo.sum()) + lo.sum())
    return a, c, total, lo, hi


@SETTINGS
@given(problem=finish_problems())
def test_equal_finish_equalises_unclipped_workers(problem):
    a, c, total, lo, hi = problem
    b, t = equal_finish(a, c, total, lo, hi)
    tol = 1e-9 * max(1.0, total)  # samples
    assert abs(b.sum() - total) <= tol
    assert (b >= lo).all() and (b <= hi).all()
    # The definition: b_i = clip((T − a_i)/c_i, lo_i, hi_i). So every unclipped worker
    # finishes at T, one held at its upper bound is done by T (it could take more), and
    # one held at its lower bound finishes no earlier than T (it would give some away).
    want = np.clip((t - a) / c, lo, hi)
    assert np.all(np.abs(b - want) <= tol)
    free = (want > lo) & (want < hi)
    assert np.all(np.abs(a[free] + c[free] * b[free] - t) <= c[free] * tol)
    at_hi = ~free & (b == hi) & (hi > lo)
    at_lo = ~free & (b == lo) & (hi > lo)
    assert np.all(a[at_hi] + c[at_hi] * hi[at_hi] <= t + c[at_hi] * tol)
    assert np.all(a[at_lo] + c[at_lo] * lo[at_lo] >= t - c[at_lo] * tol)


@SETTINGS
@given(problem=finish_problems())
def test_equal_finish_is_minimax(problem):
    """No feasible split finishes earlier: moving samples from a free worker can only
    make the step longer (checked against random feasible perturbations)."""
    a, c, total, lo, hi = problem
    b, _ = equal_finish(a, c, total, lo, hi)
    best = float(np.max(a + c * b)) if len(b) else 0.0
    rng = np.random.default_rng(0)
    for _ in range(5):
        d = rng.standard_normal(len(b))
        d -= d.mean()
        other = np.clip(b + d, lo, hi)
        if abs(other.sum() - total) < 1e-9:
            assert float(np.max(a + c * other)) >= best * (1 - 1e-9)


def test_equal_finish_examples_and_errors():
    b, t = equal_finish(
        np.array([0.01, 0.03]), np.array([0.001, 0.003]), 64.0, np.ones(2), np.full(2, 64.0)
    )
    assert b == pytest.approx([53.0, 11.0])
    assert t == pytest.approx(0.063)
    # a bound binds: the other worker takes the rest
    b, _ = equal_finish(np.zeros(2), np.array([1.0, 1.0]), 10.0, np.ones(2), np.array([3.0, 10.0]))
    assert b == pytest.approx([3.0, 7.0])
    with pytest.raises(ValueError, match="fits the bounds"):
        equal_finish(np.zeros(2), np.ones(2), 10.0, np.ones(2), np.array([3.0, 3.0]))
    with pytest.raises(ValueError, match="fits the bounds"):
        equal_finish(np.zeros(2), np.ones(2), 1.0, np.ones(2), np.array([3.0, 3.0]))
    with pytest.raises(ValueError, match="positive"):
        equal_finish(np.zeros(2), np.array([1.0, 0.0]), 4.0, np.ones(2), np.full(2, 4.0))


# --------------------------------------------------------------------------------------
# round_to_total


@st.composite
def rounding_problems(draw):
    n = draw(st.integers(1, 50))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lo = rng.integers(0, 10, n)
    hi = lo + rng.integers(0, 30, n)
    x = lo + rng.random(n) * (hi - lo)
    if draw(st.booleans()):
        x = x + rng.choice([-5.0, 0.0, 5.0], n)  # outside the bounds: clipped first
    return x, lo, hi


@SETTINGS
@given(problem=rounding_problems())
def test_round_to_total_nearest_when_total_matches(problem):
    x, lo, hi = problem
    xc = np.clip(x, lo, hi)
    total = round(float(xc.sum()))
    out = round_to_total(x, total, lo, hi)
    assert out.dtype == np.int64
    assert int(out.sum()) == total
    assert (out >= lo).all() and (out <= hi).all()
    assert np.all(np.abs(xc - out) < 1.0)


@SETTINGS
@given(problem=rounding_problems(), where=st.floats(0.0, 1.0))
def test_round_to_total_any_feasible_total(problem, where):
    x, lo, hi = problem
    total = int(lo.sum() + round(where * (hi.sum() - lo.sum())))
    out = round_to_total(x, total, lo, hi)
    assert int(out.sum()) == total
    assert (out >= lo).all() and (out <= hi).all()


def test_round_to_total_examples_and_errors():
    assert round_to_total(np.array([1.5, 1.5, 1.0]), 4, np.zeros(3), np.full(3, 4)).tolist() in (
        [2, 1, 1],
        [1, 2, 1],
    )
    assert round_to_total(np.array([2.6, 1.4]), 4, np.zeros(2), np.full(2, 4)).tolist() == [3, 1]
    with pytest.raises(ValueError, match="upper"):
        round_to_total(np.array([1.0, 1.0]), 5, np.zeros(2), np.full(2, 2))
    with pytest.raises(ValueError, match="lower"):
        round_to_total(np.array([1.0, 1.0]), 1, np.ones(2), np.full(2, 2))


# --------------------------------------------------------------------------------------
# Scenario: affine settles in one decision, DBS (proportional) only over several

A = np.array([0.01, 0.03])
C = np.array([0.001, 0.003])
GB = 64
EQUAL_FINISH = (53, 11)  # 0.01 + 0.001·53 = 0.03 + 0.003·11 = 0.063 s


def step_times(batches) -> np.ndarray:
    return A + C * np.asarray(batches, dtype=float)


def imbalance(batches) -> float:
    t = step_times(batches)
    return float(t.max() / t.min() - 1.0)


def dbs_telemetry(batches, steps: int = 10) -> list[WorkerTelemetry]:
    t = step_times(batches)
    return [
        WorkerTelemetry(f"w{i}", batch=int(b), samples=steps * int(b), compute_s=steps * t[i])
        for i, b in enumerate(batches)
    ]


def test_affine_converges_in_one_decision():
    stats = [stats_of([(b, A[i] + C[i] * b) for b in (32, 48, 32)]) for i in range(2)]
    tel = [WorkerTelemetry(f"w{i}", batch=32, stats=stats[i]) for i in range(2)]
    current = make_allocation(["w0", "w1"], np.array([32, 32]), GB, 10 * GB)
    d = AffinePolicy().decide(tel, GB, 10 * GB, current)
    assert d.rebalanced
    assert d.allocation.batches == EQUAL_FINISH
    assert imbalance(d.allocation.batches) == pytest.approx(0.0, abs=1e-12)
    assert d.predicted_step_s == pytest.approx(0.063)
    assert d.current_step_s == pytest.approx(0.126)
    # with observations at the new sizes too, the next decision keeps the plan
    stats = [
        s.add(b, A[i] + C[i] * b, 0.9)
        for i, (s, b) in enumerate(zip(stats, EQUAL_FINISH, strict=True))
    ]
    tel = [WorkerTelemetry(f"w{i}", batch=EQUAL_FINISH[i], stats=stats[i]) for i in range(2)]
    again = AffinePolicy().decide(tel, GB, 10 * GB, d.allocation)
    assert not again.rebalanced
    assert again.allocation.batches == EQUAL_FINISH


def test_dbs_needs_several_decisions():
    batches = (32, 32)
    current = make_allocation(["w0", "w1"], np.array(batches), GB, 10 * GB)
    history = [imbalance(batches)]
    for _ in range(10):
        d = DBSPolicy().decide(dbs_telemetry(batches), GB, 10 * GB, current)
        current, batches = d.allocation, d.allocation.batches
        history.append(imbalance(batches))
        if len(history) == 2:
            # one step: proportional to throughput measured at b = 32 overshoots nothing
            # but undershoots: the slow worker still has too much (t = c·b ignores a)
            assert batches == (48, 16)
            assert history[-1] > 0.3
    assert all(later <= earlier + 1e-12 for earlier, later in itertools.pairwise(history))
    assert batches == EQUAL_FINISH  # ... but gets there
    assert history[-1] == pytest.approx(0.0, abs=1e-12)
    # and needed more than one decision to do it
    assert sum(h > 1e-9 for h in history) > 2

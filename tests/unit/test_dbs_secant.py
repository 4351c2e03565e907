"""DBS's secant step (pure; no Ray): where a worker was measured at two batch sizes far
apart since its last change of speed, DBS solves its own fixed point (equal finish) at once
through the line between them, instead of creeping towards it one proportional correction
at a time; elsewhere it is the paper's proportional rule, unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from dynabatch.actors.contracts import StepTelemetry
from dynabatch.scheduler.core.sync.allocation import WorkerTelemetry, make_allocation
from dynabatch.scheduler.core.sync.policy import SECANT_RATIO, DBSPolicy
from dynabatch.scheduler.core.sync.shares import speed_floor
from dynabatch.scheduler.core.sync.steptime import equal_finish, two_point_fit
from dynabatch.scheduler.core.sync.tracker import Tracker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GB = 256


def _tel(a, c, cur, prev=None) -> list[WorkerTelemetry]:
    """Telemetry of workers with step time a + c·b: 3 steps at ``cur`` in the window, and a
    previous window at ``prev`` (None: none)."""
    out = []
    for i, (ai, ci, b) in enumerate(zip(a, c, cur, strict=True)):
        p = None if prev is None or prev[i] is None else (int(prev[i]), ai + ci * prev[i])
        out.append(WorkerTelemetry(f"w{i}", samples=3 * int(b), compute_s=3 * (ai + ci * b),
                                   previous=p))
    return out


def _alloc(batches) -> object:
    return make_allocation([f"w{i}" for i in range(len(batches))], np.array(batches), GB,
                           100 * GB)


def test_two_point_fit_recovers_a_line_and_distrusts_noise():
    a, c = two_point_fit([64, 64], [0.0084, 0.0084], [16, 60], [0.0036, 0.008], 1.5)
    assert a[0] == pytest.approx(0.002) and c[0] == pytest.approx(0.0001)
    assert np.isnan(a[1]) and np.isnan(c[1])  # 60 and 64: too near
    # Time falling as the batch grows, a negative overhead, a missing point: no line.
    a, c = two_point_fit([64, 64, np.nan], [0.005, 0.01, np.nan], [16, 16, 16],
                         [0.006, 0.001, 0.003], 1.5)
    assert np.isnan(c).all() and np.isnan(a).all()
    # Two times apart by less than z standard errors of their difference: a slope of noise.
    a, c = two_point_fit([64, 64], [0.0084, 0.0084], [16, 16], [0.0036, 0.0036], 1.5,
                         [0.3, 0.05], [0.3, 0.05], 3.0)
    assert np.isnan(c[0]) and c[1] == pytest.approx(0.0001)


def test_a_slowed_worker_reaches_equal_finish_in_one_secant_step():
    """The disturbance of bench/disturbance.py, in the model: worker 3 slowed 4x (fixed
    cost too), measured at 64 then at 30. The proportional rule moves it to about 16 and
    would creep on; the secant step puts it where every worker finishes together."""
    a = np.array([0.002, 0.002, 0.002, 0.008])
    c = np.array([0.0001, 0.0001, 0.0001, 0.0004])
    cur = [75, 75, 76, 30]
    tel = _tel(a, c, cur, prev=[64, 64, 64, 64])
    d = DBSPolicy(min_gain=0.05).decide(tel, GB, 100 * GB, _alloc(cur))
    plain = DBSPolicy(min_gain=0.05, secant=False).decide(tel, GB, 100 * GB, _alloc(cur))
    want, _ = equal_finish(a, c, GB, np.ones(4), np.full(4, GB))
    assert d.rebalanced and "secant" in d.reason
    assert abs(d.allocation.batches[3] - want[3]) <= 1
    assert plain.allocation.batches[3] > want[3] + 3  # one proportional step falls short
    t = a + c * np.array(d.allocation.batches)
    assert t.max() / t.min() < 1.05


@SETTINGS
@given(st.lists(st.tuples(st.floats(0.0, 0.02), st.floats(1e-5, 1e-3)), min_size=2,
                max_size=8),
       st.integers(0, 10_000))
def test_without_a_second_point_dbs_is_the_proportional_rule(workers, seed):
    rng = np.random.default_rng(seed)
    a, c = (np.array(x) for x in zip(*workers, strict=True))
    cur = rng.multinomial(GB - len(a), np.ones(len(a)) / len(a)) + 1
    near = np.maximum(1, np.round(cur * 1.2)).astype(int)  # a previous size too near
    for prev in (None, list(near)):
        tel = _tel(a, c, cur, prev)
        assert (DBSPolicy().decide(tel, GB, 100 * GB, _alloc(cur))
                == DBSPolicy(secant=False).decide(tel, GB, 100 * GB, _alloc(cur)))


@SETTINGS
@given(st.lists(st.tuples(st.floats(0.0, 0.02), st.floats(1e-5, 1e-3)), min_size=2,
                max_size=8),
       st.integers(0, 10_000))
def test_secant_step_is_equal_finish_and_never_starves(workers, seed):
    """Every worker measured at two sizes far apart on its exact line: one step lands on
    equal finish within rounding (or on the share floor), and no worker falls below the
    floor in proportion to its speed."""
    rng = np.random.default_rng(seed)
    a, c = (np.array(x) for x in zip(*workers, strict=True))
    n = len(a)
    cur = rng.multinomial(GB - n, np.ones(n) / n) + 1
    prev = np.where(cur >= 2 * SECANT_RATIO, cur // 2, cur * 2)  # far enough either way
    d = DBSPolicy().decide(_tel(a, c, cur, list(prev)), GB, 100 * GB, _alloc(cur))
    b = np.array(d.allocation.batches)
    assert b.sum() == GB
    floor = speed_floor(a, c, GB, DBSPolicy().min_share)
    assert (b >= np.minimum(floor, GB)).all() or not d.rebalanced
    if d.rebalanced:
        lo = np.maximum(np.ones(n), floor)
        want, _ = equal_finish(a, c, GB, lo, np.full(n, GB))
        assert np.abs(b - want).max() <= 1 + 1e-9


def _step(i: int, b: int, s: float) -> StepTelemetry:
    return StepTelemetry(worker="w", epoch=0, step=i, batch=b, samples=b, compute_s=s,
                         wait_s=0.0, loss_sum=0.0)


def _one_worker() -> Tracker:
    tr = Tracker()
    tr.add("w", 1.0)
    return tr


def test_the_tracker_keeps_the_window_a_new_plan_closes_and_forgets_it_on_a_slowdown():
    tr = _one_worker()
    tr.decided({"w": 64})
    tr.observe("w", [_step(i, 64, 0.0084) for i in range(4)])  # the first is a new size
    tr.decided({"w": 30})
    assert tr.workers["w"].previous == (64, pytest.approx(0.0084))
    (t,) = tr.telemetry(["w"], None)
    assert t.previous == (64, pytest.approx(0.0084)) and t.samples == 0
    tr.decided({"w": 30})  # a plan kept: the point stays
    assert tr.workers["w"].previous == (64, pytest.approx(0.0084))
    tr.observe("w", [_step(i, 30, 0.005) for i in range(4, 8)])
    tr.observe("w", [_step(i, 30, 0.02) for i in range(8, 10)])  # 4x: a change of speed
    assert tr.workers["w"].previous is None and tr.workers["w"].slowed


def test_a_nudged_worker_keeps_its_window_and_a_far_move_restarts_it():
    """Moved within NEAR of its batch a worker's throughput still holds, so its window goes
    on (a fresh one would be a step or two of noise, and DBS re-split equal workers on it);
    moved further, the window restarts and the old one is the previous point."""
    from dynabatch.scheduler.core.sync.tracker import NEAR

    tr = _one_worker()
    tr.decided({"w": 80})
    tr.observe("w", [_step(i, 80, 0.010) for i in range(5)])  # 4 settled steps
    nudge = int(80 * (1 + NEAR))  # 100: as far as a nudge goes
    tr.decided({"w": nudge})
    t = tr.workers["w"]
    assert t.window_samples == 4 * 80 and t.previous is None
    tr.observe("w", [_step(5, 80, 0.010)])  # the segment in flight, at the old plan: not counted
    tr.observe("w", [_step(i, nudge, 0.0125) for i in range(6, 9)])  # first one new
    assert t.window_samples == 4 * 80 + 2 * nudge
    tr.decided({"w": 40})  # far: restarted, and the window it closes is the previous point
    assert t.window_samples == 0
    assert t.previous[0] == nudge
    assert t.previous[1] == pytest.approx((4 * 0.010 + 2 * 0.0125) / (4 * 80 + 2 * nudge) * nudge)


def test_a_far_move_to_a_near_size_keeps_the_farther_previous_point():
    """64 → 20 → 14: the move to 14 is far (a fresh window) but 20 and 14 are too near for a
    line, so the point at 64 stays the previous one and the next re-plan draws its secant
    (replaced by 20, the line was lost and the share crept by proportional steps)."""
    tr = _one_worker()
    tr.decided({"w": 64})
    tr.observe("w", [_step(i, 64, 0.0084) for i in range(3)])
    tr.decided({"w": 20})
    tr.observe("w", [_step(i, 20, 0.004) for i in range(3, 6)])
    tr.decided({"w": 14})
    assert tr.workers["w"].previous == (64, pytest.approx(0.0084))
    tr.observe("w", [_step(i, 14, 0.0034) for i in range(6, 9)])
    tr.decided({"w": 40})  # back up: 14 is now the farther point
    assert tr.workers["w"].previous == (14, pytest.approx(0.0034))

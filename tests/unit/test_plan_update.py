"""Plan updates: a re-plan takes effect inside a segment already sent, on every worker from
the same step or on none (scheduler/core/sync/update.py), and the ledger still sees every
position trained exactly once."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from dynabatch.actors.contracts import SegmentPlan, StepPlan, plan_key
from dynabatch.scheduler.core.sync.allocation import WorkerTelemetry
from dynabatch.scheduler.core.sync.policy import policy_for
from dynabatch.scheduler.core.sync.protocol import RebalanceRule, SyncProtocol
from dynabatch.scheduler.core.sync.update import (
    PlanUpdate,
    check_update,
    update_at,
    updated_plans,
)
from dynabatch.scheduler.sync import pipeline
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_engine_faults import _assert_exactly_once, _job, _run_to, _spec


def _tel(speeds) -> list[WorkerTelemetry]:
    return [WorkerTelemetry(worker=f"w{i}", samples=int(100 * s), compute_s=1.0)
            for i, s in enumerate(speeds)]


def _steps(plans) -> int:
    return len(next(iter(plans.values())).steps)


# ------------------------------------------------------------------ pure decisions
def test_an_update_aims_past_the_step_the_workers_may_have_started():
    assert update_at(committed=4, ahead_start=4, ahead_end=6) == 5
    assert update_at(committed=4, ahead_start=4, ahead_end=5) is None  # one step: after it
    assert update_at(committed=4, ahead_start=None, ahead_end=None) is None
    assert update_at(committed=4, ahead_start=6, ahead_end=8) is None  # not the next segment
    assert update_at(committed=4, ahead_start=4, ahead_end=8, started=0) == 4


def test_an_update_that_moves_a_global_batch_or_leaves_a_hole_is_rejected():
    p = SyncProtocol(global_batch=10, dataset_size=100, seed=0,
                     rule=RebalanceRule("adaptive", 10, 4))
    p.replan(policy_for("static"), _tel([1, 1]))
    seg = p.plan_segment()
    good = PlanUpdate(0, 1, {w: s.steps[1:] for w, s in seg.items()})
    assert check_update(seg, good) is None
    sp = seg["w0"].steps[2]
    hole = dataclasses.replace(sp, own_size=sp.own_size - 1)
    bad = PlanUpdate(0, 1, {"w0": (seg["w0"].steps[1], hole, seg["w0"].steps[3]),
                            "w1": seg["w1"].steps[1:]})
    assert "tile" in check_update(seg, bad) or "cover" in check_update(seg, bad)
    moved = dataclasses.replace(sp, start=sp.start + 1)
    assert "global batch" in check_update(
        seg, PlanUpdate(0, 2, {"w0": (moved, seg["w0"].steps[3]), "w1": seg["w1"].steps[2:]}))
    assert "workers" in check_update(seg, PlanUpdate(0, 1, {"w0": seg["w0"].steps[1:]}))


@settings(deadline=None, max_examples=150)
@given(n=st.integers(20, 400), b=st.integers(2, 40), check=st.integers(2, 5), data=st.data())
def test_updates_accepted_or_refused_change_only_steps_not_started_and_cover_once(
        n, b, check, data):
    """The coordinator's loop with plan updates: a segment is sent ahead, the one before it
    completes, a re-plan is adopted from the step after the first of the segment ahead and
    posted; accepted, the segment ahead trains the new plan from there, refused, the
    allocation is deferred to the step after it. Steps before ``at`` never change, every
    step trains what the protocol plans for it, and every position once."""
    p = SyncProtocol(global_batch=b, dataset_size=n, seed=1,
                     rule=RebalanceRule("adaptive", 10, check))
    k = data.draw(st.integers(1, min(b, 4)))
    p.replan(policy_for("static"), _tel([1.0] * k))
    counts = np.zeros(n, dtype=np.int64)
    ahead = None
    while not p.epoch_complete:
        if ahead is None:
            start, cur = p.step, p.plan_segment()
        else:
            start, cur = ahead
        end = start + _steps(cur)
        for sps in zip(*(pl.steps for pl in cur.values()), strict=True):
            assert sum(sp.own_size for sp in sps) == sps[0].size
            for sp in sps:
                counts[sp.own_start:sp.own_start + sp.own_size] += 1
        ahead = (end, p.plan_segment(at=end)) if end < p.steps_per_epoch else None
        p.advance(end - start)
        if ahead is None:
            continue
        a_end = ahead[0] + _steps(ahead[1])
        early = update_at(committed=p.step, ahead_start=ahead[0], ahead_end=a_end)
        speeds = data.draw(st.lists(st.floats(0.2, 8.0), min_size=k, max_size=k))
        policy = policy_for(data.draw(st.sampled_from(["dbs", "affine"])))
        if early is None:
            p.replan(policy, _tel(speeds), at=a_end)
            continue
        decision = p.replan(policy, _tel(speeds), at=early)
        seg = p.plan_segment(at=early, whole=True)
        update = PlanUpdate(p.epoch, early,
                            {w: tuple(sp for sp in s.steps if sp.step < a_end)
                             for w, s in seg.items()})
        assert check_update(ahead[1], update) is None
        if decision.rebalanced and data.draw(st.booleans()):
            new = updated_plans(ahead[1], update)
            for w in new:  # the steps before ``at`` are as they were sent
                assert [sp for sp in new[w].steps if sp.step < early] == [
                    sp for sp in ahead[1][w].steps if sp.step < early]
            ahead = (ahead[0], new)
        else:
            p.defer(early, a_end)
            assert p.plan_segment(at=ahead[0]) == ahead[1]  # the segment sent, unchanged
    assert (counts == 1).all()


# ------------------------------------------------------------------ the driver, on the simulator
def _disturbed(**kw):
    spec = _spec(rebalance={"mode": "adaptive", "check_steps": 4}, **kw)
    coord, rt, lineages = _job(spec)
    _run_to(coord, 1, 2)
    rt.happen({"slowdown": {"class": "node02", "index": 0, "factor": 5}})  # w2, mid-epoch
    return coord, rt, lineages


@pytest.mark.parametrize("policy", ["affine", "dbs"])
def test_a_disturbance_is_answered_inside_the_segment_in_flight(policy):
    coord, rt, lineages = _disturbed(policy=policy)
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert rt.record.updates_applied
    first = rt.record.updates_applied[0]
    # Applied from the second step of the segment ahead, not after it.
    seg = next(p for p in rt.record.plans if any(sp.step == first.at_step
                                                 for sp in next(iter(p.values())).steps))
    steps = [sp.step for sp in next(iter(seg.values())).steps]
    assert first.at_step == steps[1]
    assert seg["w2"].steps[1] == first.plans["w2"][0]


def test_a_refused_update_defers_the_plan_to_the_next_segment(monkeypatch):
    coord, rt, lineages = _disturbed(policy="affine")
    # The driver aims every update at the first step of the segment in flight, which the
    # workers started when the one before it ended: the runtime refuses each, as Ray does
    # for a step a worker has claimed.
    monkeypatch.setattr(pipeline, "update_at", functools.partial(update_at, started=0))
    asked, applied = len(rt.record.updates), len(rt.record.updates_applied)
    rebalances = coord.snapshot().rebalances_total
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert len(rt.record.updates) > asked and len(rt.record.updates_applied) == applied
    assert coord.snapshot().rebalances_total > rebalances


def test_segments_of_rebalance_epoch_are_never_updated():
    """In ``rebalance: epoch`` the workers claim no step, so no update is posted to them
    (the next epoch's first re-plan takes effect after the segment sent across the end)."""
    coord, rt, lineages = _job(_spec(rebalance={"mode": "epoch"}, policy="dbs"))
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert not rt.record.updates
    assert not any(next(iter(p.values())).updates for p in rt.record.plans)


def test_the_store_decides_once_per_step_between_the_driver_and_the_workers():
    """A worker claims each step's key before starting it: an update posted first is found
    (and applied), one posted after is refused; the real RayRuntime posts it."""
    np_ = pytest.importorskip("numpy")
    from dynabatch.actors.spec import JobSpec
    from dynabatch.actors.worker import Worker
    from dynabatch.scheduler.runtime.ray_runtime import RayRuntime

    spec = JobSpec.model_validate(dict(dataset={"name": "synthetic"},
                                       model={"name": "mlp", "hidden": 8}, workers=1,
                                       global_batch=16, collective_timeout_s=5))
    rng = np_.random.default_rng(0)
    w = Worker("w0", 0, spec, rng.normal(size=(48, 4)).astype(np_.float32),
               rng.integers(0, 3, size=48), (4,), 3)
    rv = w.group.open_store(1, 1, "gloo", host="127.0.0.1")
    w.join(rv, 0)
    rt = RayRuntime(spec)
    rt._rv = rv
    try:
        steps = tuple(StepPlan(s, s * 16, 16, s * 16, 16) for s in range(3))
        plan = SegmentPlan(0, 0, 48, steps[:2], updates=True)
        # Posted before the worker reaches step 1: it trains the update's share there.
        half = dataclasses.replace(steps[1], own_size=8)
        assert rt.update_segment(PlanUpdate(0, 1, {"w0": (half,)}), timeout_s=2.0)
        res = w.run_segment(plan)
        assert [s.samples for s in res.steps] == [16, 8]
        # Step 1 was claimed: a second post for it is refused.
        assert not rt.update_segment(PlanUpdate(0, 1, {"w0": (steps[1],)}), timeout_s=2.0)
        assert w.group.claim(plan_key(0, 1)) is not None  # the first update stays posted
        # Without the flag the worker claims nothing (no store round trip a step).
        res = w.run_segment(SegmentPlan(0, 0, 48, steps[2:]))
        assert rt.update_segment(PlanUpdate(0, 2, {"w0": (steps[2],)}), timeout_s=2.0)
    finally:
        w.leave()

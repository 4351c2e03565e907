"""Segments sent ahead (no bubbles): the next segment goes out before the current one's
results are read, and every fault still ends with each step applied exactly once."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.policy import StaticPolicy, WorkerTelemetry
from scheduler.protocols.sync import RebalanceRule, SyncProtocol
from scheduler.state import JobState
from tests.unit.test_engine_faults import SPE, _assert_exactly_once, _coord, _run_to, _spec


def _pspec(**kw):
    return _spec(rebalance={"mode": "epoch"}, **kw)


@given(st.integers(2, 500), st.integers(2, 64), st.integers(0, 40),
       st.sampled_from(["epoch", "steps", "adaptive"]))
def test_a_segment_planned_ahead_is_the_one_planned_after_advancing(n, b, k, mode):
    p = SyncProtocol(global_batch=b, dataset_size=n, seed=1, rule=RebalanceRule(mode, 3, 2))
    p.replan(StaticPolicy(), [WorkerTelemetry("a"), WorkerTelemetry("b")])
    k = min(k, p.steps_per_epoch)
    p.advance(k)
    length = p.segment_length()
    if not p.next_boundary_keeps_plan(length):
        return
    ahead = p.plan_segment(at=p.step + length)
    p.advance(length)
    assert not p.due_check()
    assert ahead == p.plan_segment()


def test_without_faults_segments_go_out_ahead_and_every_step_is_applied_once():
    coord, rt = _coord(_pspec())
    coord.run()
    _assert_exactly_once(coord, rt)
    assert coord.segments_sent_ahead == coord.spec.epochs  # 2 segments per epoch
    assert rt.submitted == rt.calls["segments"]


@pytest.mark.parametrize("kind", ["die", "hang", "straggle"])
@pytest.mark.parametrize("step", [3, 9, SPE - 1], ids=["ahead-queued", "in-ahead", "last"])
def test_a_fault_with_a_segment_ahead_discards_it_and_trains_on(kind, step):
    coord, rt = _coord(_pspec())
    rt.inject(kind, "w1", epoch=1, step=step, seconds=30.0)
    coord.run()
    _assert_exactly_once(coord, rt)
    assert [e.worker for e in coord.membership_events() if e.kind in ("failure", "evict")
            ] == ["w1"]


def test_a_result_lost_after_its_segment_completed_keeps_what_the_segment_ahead_trained():
    """The segment's collectives all completed, but one worker's result was lost with its
    node, which died one step into the segment sent ahead. Its peers trained that step with
    it: it is committed (the coverage proves it), not held against them."""
    coord, rt = _coord(_pspec())
    rt.inject("lose_result", "w1", epoch=1, step=0)
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    _assert_exactly_once(coord, rt)
    assert [(e.worker, e.kind) for e in coord.membership_events()
            if e.kind in ("failure", "evict")] == [("w1", "failure")]
    assert not [line for line in coord.logs() if "trained past" in line.message]
    assert any("committing what the segment ahead trained" in line.message
               for line in coord.logs())
    # The first failure took no step down (its survivors completed it); the one ahead did.
    assert coord.history()[1].retried_samples == coord.spec.global_batch


def test_a_deterministic_error_with_a_segment_ahead_still_fails_the_job():
    coord, rt = _coord(_pspec())
    rt.inject("error", "w1", epoch=0, step=3)
    snap = coord.run()
    assert snap.state == JobState.FAILED and "InjectedFault" in snap.reason
    assert all(r.verified for r in coord.history())


def test_cancel_with_a_segment_in_flight_checkpoints_what_it_trained(tmp_path):
    spec = _pspec(checkpoint={"dir": str(tmp_path)})
    coord, _ = _coord(spec)
    _run_to(coord, 1, 1)  # the first segment of epoch 1 is done; the second is in flight
    assert coord._ahead is not None
    coord.cancel()
    coord.run()
    # The segment in flight was committed, and the epoch it completed was ended.
    assert coord.snapshot().state == JobState.CANCELLED
    assert (coord.epoch, coord.step_in_epoch, len(coord.history())) == (2, 0, 2)
    again, rt2 = _coord(spec)
    again.run()
    _assert_exactly_once(again, rt2)


def test_a_scale_request_waits_for_the_boundary_with_nothing_in_flight():
    coord, rt = _coord(_pspec(max_workers=4), nodes=4)
    _run_to(coord, 1, 1)
    coord.scale(4)
    coord.run()
    _assert_exactly_once(coord, rt)
    assert len(coord.membership.worker_ids) == 4


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    faults=st.lists(
        st.tuples(st.sampled_from(["die", "hang", "die_in_regroup", "die_in_checkpoint"]),
                  st.integers(0, 5), st.integers(0, 2), st.integers(0, SPE - 1)),
        max_size=4,
    ),
    uneven=st.booleans(),
)
def test_any_fault_schedule_with_segments_ahead_trains_every_sample_once(
        tmp_path_factory, faults, uneven):
    spec = _pspec(checkpoint={"dir": str(tmp_path_factory.mktemp("ck"))}, max_workers=3)
    coord, rt = _coord(spec, nodes=8, uneven_failure=uneven)
    for kind, w, epoch, step in faults:
        rt.inject(kind, f"w{w}", epoch=epoch, step=step)
    snap = coord.run()
    if snap.state == JobState.FAILED and "no checkpoint to restore" in snap.reason:
        assert all(r.verified for r in coord.history())
        return
    _assert_exactly_once(coord, rt)

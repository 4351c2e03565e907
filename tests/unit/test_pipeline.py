"""No bubbles: one segment is always in flight. The next segment goes out before the current
one's results are read, re-plans take effect at the step after the segment ahead, the next
epoch's first segment goes out behind the epoch's evaluation, and every fault still ends
with each step applied exactly once and each epoch scored on its final weights."""

from __future__ import annotations

import numpy as np
import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.sync.allocation import WorkerTelemetry
from dynabatch.scheduler.core.sync.policy import StaticPolicy, policy_for
from dynabatch.scheduler.core.sync.protocol import Position, RebalanceRule, SyncProtocol
from dynabatch.scheduler.runtime.seam import ShardResult
from dynabatch.scheduler.sim.cluster_spec import Fault
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.runtime_watch import count_segments
from tests.fakes import Lineages
from tests.unit.test_engine_faults import (
    SPE,
    _assert_exactly_once,
    _full_lineage,
    _job,
    _run_to,
    _spec,
)

RULES = [RebalanceRule("epoch"), RebalanceRule("steps", 3), RebalanceRule("adaptive", 10, 2)]


def _pspec(**kw):
    return _spec(rebalance={"mode": "epoch"}, **kw)


def _tel(speeds) -> list[WorkerTelemetry]:
    return [
        WorkerTelemetry(worker=f"w{i}", samples=int(100 * s), compute_s=1.0)
        for i, s in enumerate(speeds)
    ]


def _segment(plans) -> list[tuple]:
    return list(zip(*(pl.steps for pl in plans.values()), strict=True))


# ------------------------------------------------------------------ the protocol (pure)
@settings(deadline=None)
@given(n=st.integers(1, 400), b=st.integers(1, 50), rule=st.sampled_from(RULES), data=st.data())
def test_replans_adopted_ahead_never_change_a_segment_sent_and_cover_the_epoch_once(
    n, b, rule, data
):
    """The coordinator's loop, without faults: a segment is sent ahead (or not), the one
    before it completes, and a re-plan decided then is adopted from the step after the one
    ahead. The segment ahead is exactly what the protocol plans once it gets there, and
    every position of the epoch is trained once."""
    p = SyncProtocol(global_batch=b, dataset_size=n, seed=1, rule=rule)
    k = data.draw(st.integers(1, min(b, 4)))
    p.replan(policy_for("static"), _tel([1.0] * k))
    counts = np.zeros(n, dtype=np.int64)
    ahead: tuple[int, dict] | None = None
    while not p.epoch_complete:
        if ahead is None:
            start, cur = p.step, p.plan_segment()
        else:
            start, cur = ahead
            assert cur == p.plan_segment()  # what was sent is what is planned here
        end = start + len(next(iter(cur.values())).steps)
        ahead = None
        if end < p.steps_per_epoch and data.draw(st.booleans()):
            ahead = (end, p.plan_segment(at=end))
        for sps in _segment(cur):
            assert sum(sp.own_size for sp in sps) == sps[0].size
            for sp in sps:
                counts[sp.own_start : sp.own_start + sp.own_size] += 1
        p.advance(end - start)
        if p.rule.due(p.step, p.steps_per_epoch) or data.draw(st.booleans()):
            speeds = data.draw(st.lists(st.floats(0.5, 8.0), min_size=k, max_size=k))
            policy = policy_for(data.draw(st.sampled_from(["static", "dbs", "affine"])))
            at = ahead[0] + len(next(iter(ahead[1].values())).steps) if ahead else None
            p.replan(policy, _tel(speeds), at=at)
            assert p.planned_remaining("w0") >= 0
    assert (counts == 1).all()
    assert p.step * p.global_batch >= p.dataset_size  # no sample left


@settings(deadline=None)
@given(
    n=st.integers(2, 400),
    b=st.integers(1, 50),
    rule=st.sampled_from(RULES),
    speeds=st.lists(st.floats(0.5, 8.0), min_size=2, max_size=4),
    data=st.data(),
)
def test_the_next_epochs_first_segment_planned_ahead_is_the_one_planned_after_the_end(
    n, b, rule, speeds, data
):
    b = max(b, len(speeds))
    p = SyncProtocol(global_batch=b, dataset_size=n, seed=3, rule=rule)
    p.replan(policy_for("dbs"), _tel(speeds))
    mid = data.draw(st.integers(0, p.steps_per_epoch - 1))
    p.advance(mid)
    p.replan(policy_for("dbs"), _tel(speeds[::-1]))  # a mid-epoch plan: cut over the rest
    p.advance(p.steps_per_epoch - mid)
    ahead = p.plan_segment(at=Position(p.epoch + 1, 0))
    allocation = p.allocation
    p.next_epoch()
    assert ahead == p.plan_segment()
    assert ahead[next(iter(ahead))].epoch == p.epoch
    # The next epoch starts with the same batches, re-cut over the whole dataset: a policy
    # keeping it returns it unchanged (no spurious rebalance at the epoch's start).
    assert p.allocation.batches == allocation.batches
    assert p.allocation.dataset_size == n
    kept = p.replan(StaticPolicy(), _tel([1.0] * len(speeds)))
    assert kept is not None


def test_an_allocation_adopted_ahead_applies_only_from_its_step():
    p = SyncProtocol(global_batch=10, dataset_size=200, seed=0, rule=RebalanceRule("adaptive"))
    p.replan(StaticPolicy(), _tel([1, 1]))
    before = p.plan_segment(at=2)  # the segment ahead, under equal shares
    d = p.replan(policy_for("dbs"), _tel([4.0, 1.0]), at=4)
    assert d.rebalanced and d.allocation.batches == (8, 2)
    assert p.allocation.batches == (5, 5)  # still in force now
    assert p.plan_segment(at=2) == before
    assert [sp.own_size for sp in p.plan_segment(at=4)["w0"].steps] == [8, 8]
    # What w0 still trains: 4 steps at 5 before step 4, then 16 steps at the new split.
    assert p.planned_remaining("w0") == 4 * 5 + 16 * 8
    p.advance(4)
    assert p.allocation.batches == (8, 2)
    with pytest.raises(ValueError, match="cannot re-plan from step 2"):
        p.replan(StaticPolicy(), _tel([1, 1]), at=2)


def test_a_replan_while_the_epochs_last_segment_is_in_flight_is_the_next_epochs_plan():
    p = SyncProtocol(global_batch=10, dataset_size=95, seed=0)
    p.replan(StaticPolicy(), _tel([1, 1]))
    first = p.plan_segment()
    d = p.replan(policy_for("dbs"), _tel([4.0, 1.0]), at=p.steps_per_epoch)
    assert d.allocation.dataset_size == 95 and d.allocation.batches == (8, 2)
    assert p.allocation.batches == (5, 5) and p.plan_segment() == first
    assert p.planned_remaining("w0") == p.allocation.partitions[0]  # nothing of the next
    ahead = p.plan_segment(at=Position(1, 0))
    p.advance(p.steps_per_epoch)
    assert p.allocation.batches == (5, 5)  # what the epoch ended with
    p.next_epoch()
    assert p.allocation.batches == (8, 2) and p.plan_segment() == ahead
    assert p.replan(StaticPolicy(), _tel([1, 1]), at=p.steps_per_epoch) is not None
    with pytest.raises(ValueError):
        p.replan(StaticPolicy(), _tel([1, 1]), at=p.steps_per_epoch + 1)


# ------------------------------------------------------------------ the coordinator
class _Scoring(SimRuntime):
    """The simulator's runtime keeping, per evaluation run, each scored shard's worker and
    the lineage ("weights") it scored: which evaluation scored which weights."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.evaluated: list[dict[str, tuple[tuple[int, int], ...]]] = []

    def _evaluate(self, shards: dict[str, tuple[int, int]], split: str = "test"
                  ) -> list[ShardResult]:
        before = len(self.gradients.scored)
        out = super()._evaluate(shards, split)
        self.evaluated.append(dict(self.gradients.scored[before:]))
        return out


def _coord(spec: JobSpec, *faults: Fault, **kw) -> tuple[Coordinator, _Scoring, Lineages]:
    """The fault tests' job (:func:`~tests.unit.test_engine_faults._job`) on a runtime that
    keeps which evaluation scored which weights."""
    return _job(spec, *faults, **{"runtime": _Scoring, **kw})


def _at_step(kind: str, worker: int, epoch: int, step: int) -> Fault:
    """A fault of ``kind`` at (epoch, step). A straggler is 4 s late: past the collective
    timeout (2 s) its peers time out, and it answers within the grace, so it is evicted
    (one far later would be lost as hung, as on Ray)."""
    extra = {"seconds": 4.0} if kind == "straggle" else {}
    return Fault(kind=kind, worker=worker, epoch=epoch, step=step, **extra)


def _removed(coord: Coordinator) -> list[str]:
    return [e.worker for e in coord.membership_events() if e.kind in ("failure", "evict")]


def _scored_final_weights(coord: Coordinator, rt: _Scoring) -> None:
    """Every epoch's record carries the scores of its own final weights: a worker's
    accuracy is the share of 100 steps its lineage holds, and one evaluation scored every
    shard on the epoch's full lineage."""
    for r in coord.history():
        steps = (r.epoch + 1) * SPE
        assert r.test_accuracy == pytest.approx(min(1.0, steps / 100)), r.epoch
        assert r.test_loss == pytest.approx(1.0)
        assert any(
            scored and all(lin == tuple(_full_lineage(r.epoch + 1)) for lin in scored.values())
            for scored in rt.evaluated
        )


def test_without_faults_every_segment_but_the_first_goes_out_ahead():
    coord, rt, lineages = _coord(_pspec(policy="static"))
    counts = count_segments(rt)
    coord.run()
    _assert_exactly_once(coord, lineages)
    # 2 segments per epoch; across the epochs' ends too, behind each epoch's evaluation.
    assert rt.record.segments == 2 * coord.spec.epochs
    assert counts.sent_ahead == rt.record.segments - 1
    assert rt.record.submitted == rt.record.segments
    _scored_final_weights(coord, rt)


def test_an_epoch_whose_end_replans_is_not_crossed_ahead():
    """``rebalance: epoch`` under dbs decides at the epoch's end: the next epoch's first
    segment waits for that decision instead of training at the carried shares."""
    coord, rt, lineages = _coord(_pspec(policy="dbs"))
    counts = count_segments(rt)
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert rt.record.segments == 2 * coord.spec.epochs
    assert counts.sent_ahead == rt.record.segments - coord.spec.epochs
    assert rt.record.submitted == rt.record.segments
    _scored_final_weights(coord, rt)


@pytest.mark.parametrize(
    "rebalance", [{"mode": "adaptive", "check_steps": 2}, {"mode": "steps", "every_steps": 4}]
)
@pytest.mark.parametrize("policy", ["affine", "dbs"])
def test_segments_go_out_ahead_when_replans_are_due(rebalance, policy):
    """In adaptive and steps modes a re-plan is due at (almost) every boundary: the plan
    changes asynchronously, from the step after the segment ahead."""
    coord, rt, lineages = _coord(_spec(rebalance=rebalance, policy=policy))
    counts = count_segments(rt)
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert counts.sent_ahead == rt.record.segments - 1 > 0
    assert coord.snapshot().rebalances_total >= 1
    assert any("from step" in x.message for x in coord.logs() if "rebalance" in x.message)
    # The plan follows the speeds (1000, 500, 250 samples/s).
    last = {w.worker: w.batch for w in coord.history()[-1].workers}
    assert last["w0"] > last["w1"] > last["w2"], last
    _scored_final_weights(coord, rt)


def test_a_checkpoint_boundary_has_nothing_in_flight_and_holds_the_epochs_weights(tmp_path):
    from dynabatch.scheduler.checkpoint import load_checkpoint

    spec = _spec(checkpoint={"dir": str(tmp_path), "every_epochs": 2}, epochs=3)
    coord, rt, lineages = _coord(spec)
    _run_to(coord, 2, 0)
    ckpt = load_checkpoint(str(tmp_path), "job")
    assert (ckpt["epoch"], ckpt["step"]) == (2, 0)
    assert [tuple(x) for x in ckpt["weights"]["lineage"]] == _full_lineage(2)
    # Written as the epoch ended, with the epoch's record, scores included.
    assert [r["epoch"] for r in ckpt["history"]] == [0, 1]
    assert ckpt["history"][1]["test_accuracy"] == pytest.approx(2 * SPE / 100)
    coord.run()
    _assert_exactly_once(coord, lineages)
    # Epoch 0 -> 1 has no checkpoint: its first segment went out ahead; 1 -> 2 has one.
    firsts = [p for p in rt.record.plans if next(iter(p.values())).steps[0].step == 0]
    assert len(firsts) == 3


@pytest.mark.parametrize("kind", ["die", "hang", "straggle"])
@pytest.mark.parametrize("step", [3, 9, SPE - 1], ids=["ahead-queued", "in-ahead", "last"])
def test_a_fault_with_a_segment_ahead_discards_it_and_trains_on(kind, step):
    coord, rt, lineages = _coord(_pspec(), _at_step(kind, 1, epoch=1, step=step))
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert _removed(coord) == ["w1"]
    _scored_final_weights(coord, rt)


@pytest.mark.parametrize("mode", ["adaptive", "steps"])
@pytest.mark.parametrize("kind", ["die", "hang", "straggle", "lose_result"])
def test_a_failure_while_a_replanned_segment_is_ahead(mode, kind):
    """A re-plan was adopted from the step after the segment ahead; the segment before it
    (or the one ahead) fails. The pending plan must not outlive the failure: the regroup
    re-plans over the survivors, and every step is trained once."""
    rebalance = {"mode": mode, "check_steps": 2, "every_steps": 4}
    coord, rt, lineages = _coord(_spec(rebalance=rebalance, policy="dbs"))
    _run_to(coord, 1, 4)
    p = coord.protocol
    assert coord.pipeline.ahead is not None and len(p._plans) == 2  # a plan adopted ahead
    rt.inject(_at_step(kind, 2, epoch=1, step=p.step + 1))
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    _assert_exactly_once(coord, lineages)
    assert _removed(coord) == ["w2"]


def test_the_last_segment_of_an_epoch_fails_with_the_next_epoch_and_its_evaluation_ahead():
    """The next epoch's first segment and the epoch's evaluation were sent behind the
    epoch's last segment, which fails: the evaluation scored weights that are not the
    epoch's (discarded), and the next segment could not train (discarded). The epoch's last
    step is retried, then evaluated."""
    # dbs would not cross: its end re-plans.
    coord, rt, lineages = _coord(_pspec(policy="static"), _at_step("die", 1, 0, SPE - 1))
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    _assert_exactly_once(coord, lineages)
    _scored_final_weights(coord, rt)
    assert rt.record.evaluations == coord.spec.epochs + 1  # one was thrown away


def test_a_result_lost_after_its_segment_completed_keeps_what_the_segment_ahead_trained():
    """The segment's collectives all completed, but one worker's result was lost with its
    process, which died one step into the segment sent ahead. Its peers trained that step
    with it: it is committed (the coverage proves it), not held against them."""
    coord, _, lineages = _coord(_pspec(), _at_step("lose_result", 1, 1, 0))
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    _assert_exactly_once(coord, lineages)
    assert [
        (e.worker, e.kind) for e in coord.membership_events() if e.kind in ("failure", "evict")
    ] == [("w1", "failure")]
    assert not [line for line in coord.logs() if "trained past" in line.message]
    assert any("committing what the segment ahead trained" in line.message for line in coord.logs())
    # The first failure took no step down (its survivors completed it); the one ahead did.
    assert coord.history()[1].retried_samples == coord.spec.global_batch


def test_a_result_lost_on_an_epochs_last_segment_ends_the_epoch_then_commits_the_next():
    """As above, across an epoch's end: the survivors (and the worker whose result was
    lost, before its process died) scored their shards of the epoch's final weights and
    went on into the next epoch's first segment. The epoch ends with those scores; the
    segment ahead opens the next epoch (nothing of it trained here: the process died in its
    first step)."""
    # The epoch's last segment: steps 8-15.
    coord, rt, lineages = _coord(_pspec(), _at_step("lose_result", 1, 0, 8))
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    _assert_exactly_once(coord, lineages)
    assert not [line for line in coord.logs() if "trained past" in line.message]
    # It failed with the epoch complete; w1's process then died in the next epoch's first
    # step.
    assert any("step 16 of epoch 0 failed" in x.message for x in coord.logs())
    _scored_final_weights(coord, rt)
    assert [
        (e.worker, e.kind) for e in coord.membership_events() if e.kind in ("failure", "evict")
    ] == [("w1", "failure")]


def test_a_worker_lost_in_an_evaluation_queued_ahead():
    """Epoch 0's evaluation went out behind its last segment, and epoch 1's first segment
    behind the evaluation (static shares cross the epoch's end). A holder is lost in it:
    the weights it scored are gone past, so the epoch has no scores, and the job goes on."""
    # Under affine the epoch's end re-plans: nothing would be queued behind the evaluation,
    # which the survivors would score again.
    spec = _pspec(policy="static")
    coord, _, lineages = _coord(spec, Fault(kind="die_in_evaluation", worker=2, nth=1))
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    _assert_exactly_once(coord, lineages)
    assert [e.worker for e in coord.membership_events() if e.kind == "failure"] == ["w2"]
    hist = coord.history()
    assert hist[0].test_accuracy is None  # a shard is missing: no partial scores
    assert hist[1].test_accuracy == pytest.approx(2 * SPE / 100)


def test_the_final_evaluation_survives_the_loss_of_a_holder():
    """Nothing is queued behind the last epoch's evaluation: when a holder is lost in it,
    the others still hold the final weights and score the whole set again."""
    # Rounds: after epoch 0, 1 and 2.
    coord, rt, lineages = _coord(_pspec(), Fault(kind="die_in_evaluation", worker=0, nth=3))
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    _assert_exactly_once(coord, lineages)
    assert [e.worker for e in coord.membership_events() if e.kind == "failure"] == ["w0"]
    assert any("epoch 2: evaluating again on" in x.message for x in coord.logs())
    _scored_final_weights(coord, rt)


def test_a_deterministic_error_with_a_segment_ahead_still_fails_the_job():
    coord, _, _ = _coord(_pspec(), _at_step("error", 1, 0, 3))
    snap = coord.run()
    assert snap.state == JobState.FAILED and "InjectedFault" in snap.reason
    assert all(r.verified for r in coord.history())


def test_a_job_that_fails_keeps_the_records_whose_evaluation_was_out():
    """Epoch 0's evaluation went out behind its last segment; epoch 1 fails for good
    before the coordinator read it. The record of epoch 0 is kept, with its scores."""
    # The first failure ends the job.
    coord, _, _ = _coord(_pspec(max_retries=0), _at_step("error", 1, 1, 0))
    snap = coord.run()
    assert snap.state == JobState.FAILED and "InjectedFault" in snap.reason
    (r,) = coord.history()
    assert r.epoch == 0 and r.verified
    assert r.test_accuracy == pytest.approx(SPE / 100)


def test_cancel_with_a_segment_in_flight_checkpoints_what_it_trained(tmp_path):
    spec = _pspec(policy="static", checkpoint={"dir": str(tmp_path), "every_epochs": 5})
    coord, _, _ = _coord(spec)
    _run_to(coord, 1, 1)  # the first segment of epoch 1 is done; the second is in flight
    assert coord.pipeline.ahead is not None
    coord.cancel()
    coord.run()
    # The segment in flight was committed, and the epoch it completed was ended.
    assert coord.snapshot().state == JobState.CANCELLED
    assert (coord.epoch, coord.step_in_epoch, len(coord.history())) == (2, 0, 2)
    again, _, lineages2 = _coord(spec)
    again.run()
    _assert_exactly_once(again, lineages2)


def test_cancel_with_the_next_epoch_in_flight(tmp_path):
    spec = _pspec(policy="static", checkpoint={"dir": str(tmp_path), "every_epochs": 5})
    coord, _, _ = _coord(spec)
    _run_to(coord, 0, 8)  # epoch 0's last segment in flight, with epoch 1's ahead
    while coord.epoch == 0:
        assert coord.step()
    assert coord.pipeline.ahead is not None and coord.pipeline.ahead.position == Position(1, 0)
    coord.cancel()
    coord.run()
    assert coord.snapshot().state == JobState.CANCELLED
    assert [r.epoch for r in coord.history()] == [0]
    again, _, lineages2 = _coord(spec)
    again.run()
    _assert_exactly_once(again, lineages2)


def test_a_scale_request_waits_for_the_boundary_with_nothing_in_flight():
    coord, _, lineages = _coord(_pspec(max_workers=4), nodes=4)
    _run_to(coord, 1, 1)
    coord.scale(4)
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert len(coord.membership.worker_ids) == 4


def test_a_worker_still_starting_does_not_stop_the_pipeline():
    """Only a started worker that joins needs a boundary: while the new one starts, the
    segments keep going out ahead."""
    spec = _spec(max_workers=4, rebalance={"mode": "adaptive"}, start_timeout_s=30)
    # A node joins as step 4 trains; a worker takes 0.5 s (about 13 steps) to come up.
    join = {"epoch": 0, "step": 4, "join": {"class": "node00", "count": 1}}
    coord, rt, lineages = _coord(spec, start_s=0.5, events=[join])
    counts = count_segments(rt)
    _run_to(coord, 0, 4)
    while not coord.membership.pending:  # the node joined; its worker is placed
        assert coord.step(), coord.snapshot().reason
    sent, pending_steps = counts.sent_ahead, 0
    while len(coord.membership.worker_ids) < 4:
        assert coord.step(), coord.snapshot().reason
        pending_steps += bool(coord.membership.pending)
    assert pending_steps >= 3
    assert counts.sent_ahead >= sent + pending_steps - 1
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert coord.membership.get("w3").node == "node00-00001"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    faults=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "die",
                    "hang",
                    "die_in_regroup",
                    "die_in_checkpoint",
                    "die_in_evaluation",
                    "lose_result",
                ]
            ),
            st.integers(0, 5),
            st.integers(0, 2),
            st.integers(0, SPE - 1),
        ),
        max_size=4,
    ),
    uneven=st.booleans(),
    rebalance=st.sampled_from(
        [{"mode": "epoch"}, {"mode": "adaptive"}, {"mode": "steps", "every_steps": 4}]
    ),
    every=st.sampled_from([1, 2, 5]),
)
def test_any_fault_schedule_with_segments_ahead_trains_every_sample_once(
    tmp_path_factory, faults, uneven, rebalance, every
):
    spec = _spec(
        checkpoint={"dir": str(tmp_path_factory.mktemp("ck")), "every_epochs": every},
        max_workers=3,
        rebalance=rebalance,
        policy="dbs",
    )
    script = []
    for kind, w, epoch, step in faults:
        if kind.startswith("die_in_"):  # at the worker's first such call
            script.append(Fault(kind=kind, worker=w))
        elif kind == "lose_result":
            script.append(Fault(kind=kind, worker=w, epoch=epoch, step=step))
        else:  # the survivors differ by a step, or not
            script.append(Fault(kind=kind, worker=w, epoch=epoch, step=step, uneven=uneven))
    coord, rt, lineages = _coord(spec, *script, nodes=8)
    counts = count_segments(rt)
    snap = coord.run()
    if snap.state == JobState.FAILED and "no checkpoint to restore" in snap.reason:
        assert all(r.verified for r in coord.history())
        return
    _assert_exactly_once(coord, lineages)
    assert counts.sent_ahead > 0
    for r in coord.history():  # scores, when there are any, are the epoch's own
        if r.test_accuracy is not None:
            assert r.test_accuracy == pytest.approx(min(1.0, (r.epoch + 1) * SPE / 100))

"""Properties of the synchronous driver over the states it can reach (issue 51, must have 4).

Hypothesis drives the real :class:`~dynabatch.scheduler.sync.coordinator.Coordinator` on
the simulator's runtime (no Ray) through drawn sequences of real events: the fault
script's worker losses and errors (:class:`~dynabatch.scheduler.sim.cluster_spec.Fault`),
nodes that fail or join between two steps of the driver (the runtime's ``happen``), scale
and drain requests and a cancel through the coordinator's public methods, epochs with or
without checkpoints, early stopping and ``keep_best``. Four properties are checked from
what happened, with the coordinator's public surface only (``step``, ``snapshot``,
``history``, ``cancel``, ``scale``, ``drain``): its internals are not this test's to read.

1. Every epoch is covered exactly once: each record is ``verified`` by the ledger, and
   every worker's weights (:class:`~tests.fakes.Lineages`: the (epoch, step) updates it
   applied) are a prefix of all the steps of all the epochs, in order; a job that
   succeeded holds them all.
2. A cancel ends the job at the next step boundary (the bound: :func:`check_cancel_bound`).
3. No effect is issued to a worker that left: :class:`_Recording` notes every call that
   targets a worker and every worker that was killed or reported lost.
4. Every failure gets exactly one decision from
   :meth:`~dynabatch.scheduler.core.failures.FailurePolicy.decide` (wrapped at the class
   level): each failed segment, failed regroup and evaluation that failed on a live
   worker, as the runtime reported it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.failures import Fail, FailureEvent, FailurePolicy
from dynabatch.scheduler.core.lifecycle import InvalidTransition, JobState
from dynabatch.scheduler.core.sync.loop import Concluded, public_state
from dynabatch.scheduler.runtime.seam import RegroupResult, ShardResult, WorkerCallError
from dynabatch.scheduler.sim.calls import Call
from dynabatch.scheduler.sim.cluster_spec import Fault
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

from tests.fakes import Lineages, sim_job

N, B = 300, 64  # 5 steps per epoch, the last one partial (44 samples)
SPE = -(-N // B)
NODES = 5  # 3 workers to start with, 2 spare nodes to replace or grow onto
SPEEDS = {0: 1000, 1: 500, 2: 250}
# Far more boundaries than any drawn job needs (about 3 per epoch, a few per failure):
# a job still running after them is a driver that does not end.
MAX_STEPS = 400
# Likewise evaluations (a few per epoch, a retry or two per failure): a driver that
# evaluates without end inside one step fails the job (an internal error) past these.
MAX_EVALUATIONS = 100

# Cheap, and the same examples every run: no flaky failures, no example database.
SETTINGS = settings(
    max_examples=75,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ======================================================================================
# The runtime that records what the driver asked of each worker.


class _Recording(SimRuntime):
    """The simulator's runtime, recording each call that targets a worker (an effect) and
    each worker that left (killed by the driver, or reported lost to it), and, in
    ``timeline``, the failures it reports, in order: a segment that failed (``primary``:
    the first since the group last formed; the segment sent ahead of it fails with it,
    ``secondary``), a regroup that failed, an evaluation round with shards that failed on
    a live worker (which: (worker, shard) pairs). The test's wrapper of the failure
    policy adds each decision to the same timeline."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.gone: dict[str, str] = {}  # worker -> "killed" or "lost (...)"
        self.violations: list[str] = []  # effects on a worker after it left
        self.kills: list[str] = []  # every kill, in order (a worker killed twice: twice)
        self.timeline: list[tuple[str, Any]] = []
        self.eval_rounds = 0  # evaluation rounds submitted
        self._group_formed = True  # no segment failed since the group last formed
        # Segments sent and not yet collected: the steps each holds (epoch, step).
        self.outstanding: dict[int, set[tuple[int, int]]] = {}

    # --- what the driver asks of its workers -----------------------------------------
    def _target(self, call: str, workers: Sequence[str]) -> None:
        for w in workers:
            if w in self.gone:
                self.violations.append(f"{call} to {w} after it was {self.gone[w]}")

    def _left(self, worker: str, why: str) -> None:
        self.gone.setdefault(worker, why)

    def spawn(self, spawn: Any) -> None:
        self._target("spawn", [spawn.worker_id])  # a worker id is never used again
        super().spawn(spawn)

    def kill(self, worker: str) -> None:
        self.kills.append(worker)
        self.gone[worker] = "killed"
        super().kill(worker)

    def submit_segment(self, plans: dict[str, Any]) -> Call:
        self._target("submit_segment", list(plans))
        ticket = super().submit_segment(plans)
        self.outstanding[id(ticket)] = {(p.epoch, sp.step) for p in plans.values()
                                        for sp in p.steps}
        return ticket

    def update_segment(self, update: Any, timeout_s: float) -> bool:
        self._target("update_segment", list(update.plans))
        return super().update_segment(update, timeout_s)

    def regroup(self, generation: int, members: Sequence[str], state: dict[str, Any] | None,
                timeout_s: float) -> RegroupResult:
        self._target("regroup", members)
        result = super().regroup(generation, members, state, timeout_s)
        for w, why in result.lost.items():
            self._left(w, f"lost ({why})")
        if result.ok:
            self._group_formed = True
        else:
            self.timeline.append(("regroup failed", None))
        return result

    def submit_evaluation(self, shards: dict[str, tuple[int, int]], split: str = "test"
                          ) -> Call:
        self._target("submit_evaluation", list(shards))
        self.eval_rounds += 1
        return super().submit_evaluation(shards, split)

    def fetch_state(self, worker: str, timeout_s: float) -> dict[str, Any]:
        self._target("fetch_state", [worker])
        try:
            return super().fetch_state(worker, timeout_s)
        except WorkerCallError as err:
            if err.lost:
                self._left(worker, f"lost ({err})")
            raise

    # --- what the workers report ------------------------------------------------------
    def poll_started(self, timeout_s: float):
        started = super().poll_started(timeout_s)
        for s in started:
            if s.error is not None:
                self._left(s.worker, f"lost (did not start: {s.error})")
        return started

    def collect_segment(self, ticket: Call, grace_s: float):
        outcomes = super().collect_segment(ticket, grace_s)
        self.outstanding.pop(id(ticket), None)
        for o in outcomes:
            if o.result is None:  # died or hung: the driver removes it
                self._left(o.worker, f"lost ({o.lost})")
        if any(o.failed for o in outcomes):
            kind = "primary" if self._group_formed else "secondary"
            self.timeline.append((f"segment failed ({kind})", None))
            self._group_formed = False
        return outcomes

    def _evaluate(self, shards: dict[str, tuple[int, int]], split: str = "test"
                  ) -> list[ShardResult]:
        if self.record.evaluations >= MAX_EVALUATIONS:
            raise RuntimeError(f"evaluated {MAX_EVALUATIONS} times: a loop without end")
        return super()._evaluate(shards, split)

    def poll_evaluation(self, ticket: Call, timeout_s: float) -> list[ShardResult]:
        results = super().poll_evaluation(ticket, timeout_s)
        for r in results:
            if r.lost:
                self._left(r.worker, f"lost ({r.error})")
        failed = {(r.worker, ticket.shards[r.worker]) for r in results
                  if r.error is not None and not r.lost}
        if failed:
            self.timeline.append(("evaluation failed", failed))
        return results


# ======================================================================================
# Scenarios: what is drawn, and one run of the driver through it.


@dataclass(frozen=True)
class Scenario:
    epochs: int
    checkpoint: bool
    keep_best: bool
    early_stopping: bool
    faults: tuple[Fault, ...]
    # Before the driver's step ``at``: (at, "fail", node ordinal) | (at, "join", nodes) |
    # (at, "scale", workers) | (at, "drain", rank), in the order of ``at``.
    actions: tuple[tuple[int, str, int], ...]
    cancel_at: int | None


@dataclass
class CancelSeen:
    """What was in flight when the cancel was requested, and what followed it."""

    steps_to_end: int = 0  # coord.step() calls until one returned False
    submitted_before: int = 0
    submitted_after: int = 0
    evaluations_before: int = 0  # evaluation rounds submitted
    evaluations_after: int = 0
    in_flight: set[tuple[int, int]] = field(default_factory=set)
    trained_after: set[tuple[int, int]] = field(default_factory=set)
    decisions_before: int = 0
    history_before: int = 0


@dataclass
class Run:
    scenario: Scenario
    coord: Coordinator
    rt: _Recording
    lineages: Lineages
    decisions: list[tuple[FailureEvent, Any]]
    cancel: CancelSeen | None


_FAULT_KINDS = ["die", "die", "hang", "error", "die_in_regroup", "die_in_checkpoint",
                "die_in_evaluation", "eval_error"]


@st.composite
def _faults(draw: st.DrawFn) -> tuple[Fault, ...]:
    out = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(_FAULT_KINDS))
        # w0..w2 start; w3, w4 replace the lost or grow the group.
        worker = draw(st.sampled_from([0, 0, 1, 1, 2, 2, 3, 4]))
        if kind in ("die", "hang", "error"):
            epoch, step = draw(st.integers(0, 1)), draw(st.integers(0, SPE - 1))
            # uneven: the first survivor completed the failing step (die and hang only).
            uneven = {} if kind == "error" else {"uneven": draw(st.booleans())}
            f = Fault(kind=kind, worker=worker, epoch=epoch, step=step, **uneven)
        elif kind == "eval_error":
            f = Fault(kind=kind, worker=worker)
        else:
            f = Fault(kind=kind, worker=worker, nth=draw(st.integers(1, 2)))
        out.append(f)
    return tuple(out)


_ACTION = st.one_of(
    st.tuples(st.just("fail"), st.integers(0, NODES - 1)),
    st.tuples(st.just("join"), st.just(1)),
    st.tuples(st.just("scale"), st.integers(1, 4)),
    st.tuples(st.just("drain"), st.integers(0, 3)),
)


@st.composite
def scenarios(draw: st.DrawFn, cancel: bool | None = None) -> Scenario:
    """A job of 2 or 3 epochs and what happens to it. ``cancel``: always (True), never
    (False) or maybe (None) cancelled, at a drawn step of the driver."""
    checkpoint = draw(st.booleans())
    actions = draw(st.lists(st.tuples(st.integers(0, 10), _ACTION), max_size=4))
    with_cancel = draw(st.integers(0, 3)) == 0 if cancel is None else cancel
    return Scenario(
        epochs=draw(st.integers(2, 3)),
        checkpoint=checkpoint,
        keep_best=checkpoint and draw(st.booleans()),
        early_stopping=draw(st.booleans()),
        faults=draw(_faults()),
        actions=tuple((at, kind, arg) for at, (kind, arg) in sorted(actions)),
        # About 3 boundaries an epoch: from the first start to the last epoch's end.
        cancel_at=draw(st.integers(0, 8)) if with_cancel else None,
    )


def _spec(sc: Scenario, ck_dir: Path) -> JobSpec:
    checkpoint: dict[str, Any] = {}
    if sc.checkpoint:
        checkpoint["dir"] = str(ck_dir)
        if sc.keep_best:
            checkpoint["keep_best"] = {"metric": "accuracy", "mode": "max"}
    extra: dict[str, Any] = {"checkpoint": checkpoint} if checkpoint else {}
    if sc.early_stopping:
        # Lineages' held-out loss is 1.0 every epoch: the job stops after epoch 1.
        extra["early_stopping"] = {"metric": "loss", "mode": "min", "patience": 1}
    return JobSpec.model_validate(dict(
        workers=3, min_workers=1, max_workers=4, global_batch=B, epochs=sc.epochs,
        policy="affine", rebalance={"mode": "adaptive"}, max_retries=1,
        collective_timeout_s=2, worker_wait_timeout_s=5, start_timeout_s=5, **extra,
    ))


def _act(coord: Coordinator, rt: _Recording, kind: str, arg: int) -> None:
    """One drawn event between two steps of the driver. A request the job refuses (the
    last worker drained, a job that has ended) is the caller's mistake, not the driver's:
    it is skipped."""
    if kind == "fail":
        rt.happen({"fail": {"class": f"node{arg:02d}", "index": 0}})
    elif kind == "join":
        rt.happen({"join": {"class": "node00", "count": arg}})
    else:
        try:
            if kind == "scale":
                coord.scale(arg)
            else:
                members = [w.worker for w in coord.snapshot().workers]
                if arg < len(members):
                    coord.drain(members[arg])
        except (KeyError, ValueError, InvalidTransition):
            pass


def _trained(rt: _Recording, lineages: Lineages) -> dict[str, list[tuple[int, int]]]:
    """Every worker ever started: the steps its weights applied."""
    return {w: lineages.lineage(w) for w in rt.ordinals}


def drive(sc: Scenario, ck_dir: Path) -> Run:
    """Run the job through ``sc``: its events before the driver's steps they are drawn at,
    until the job ends (which it must, within ``MAX_STEPS``)."""
    decisions: list[tuple[FailureEvent, Any]] = []
    timeline: list[tuple[str, Any]] = []  # the runtime's failures and the decisions, in order
    decide = FailurePolicy.decide

    def recorded(self: FailurePolicy, *args: Any, **kw: Any) -> Any:
        out = decide(self, *args, **kw)
        event = next(a for a in (*args, *kw.values()) if isinstance(a, FailureEvent))
        decisions.append((event, out[1] if isinstance(out, tuple) else out))
        timeline.append(("decision", event))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FailurePolicy, "decide", recorded)
        coord, rt, lineages = sim_job(_spec(sc, ck_dir), *sc.faults, n_train=N, speeds=SPEEDS,
                                      nodes=NODES, runtime=_Recording)
        rt.timeline = timeline
        seen: CancelSeen | None = None
        for i in range(MAX_STEPS):
            for at, kind, arg in sc.actions:
                if at == i:
                    _act(coord, rt, kind, arg)
            if i == sc.cancel_at and not coord.state.is_terminal:
                seen = CancelSeen(
                    submitted_before=rt.record.submitted,
                    evaluations_before=rt.eval_rounds,
                    in_flight=set().union(*rt.outstanding.values()),
                    decisions_before=len(decisions), history_before=len(coord.history()))
                before = _trained(rt, lineages)
                coord.cancel()
            going = coord.step()
            # The job's public state is derived from the loop's, whatever happened.
            assert coord.state is public_state(coord.loop), (coord.state, coord.loop)
            # What the reducer remembers (the segment in flight, the open epoch, the retry,
            # restored weights waiting, the data loaded) is what the pipeline, the epochs,
            # the failure policy and the job say.
            if not isinstance(coord.loop, Concluded):
                assert coord.loop.memo.in_flight == (coord.pipeline.ahead is not None)
                assert coord.loop.memo.epoch_open == (coord.epochs.totals is not None)
                assert coord.loop.memo.retrying == (coord.workforce.attempts.position
                                                    is not None)
                assert coord.loop.memo.restored == (coord.checkpoints.weights is not None)
                assert coord.loop.memo.data_loaded == coord.protocol.loaded
            if seen is not None and not seen.steps_to_end and not going:
                seen.steps_to_end = i + 1 - sc.cancel_at
                seen.submitted_after = rt.record.submitted
                seen.evaluations_after = rt.eval_rounds
                after = _trained(rt, lineages)
                seen.trained_after = {s for w, steps in after.items()
                                      for s in steps[len(before.get(w, [])):]}
            if not going:
                break
        else:
            pytest.fail(f"the job did not end in {MAX_STEPS} steps: {coord.snapshot()}")
    if seen is not None and not seen.steps_to_end:
        pytest.fail("cancelled, yet the loop ended without returning False")
    # Whatever happened, the job ends by a decision, never by a bug in the driver.
    reason = coord.snapshot().reason or ""
    assert not reason.startswith("internal error"), reason
    return Run(sc, coord, rt, lineages, decisions, seen)


def drive_example(sc: Scenario, tmp_path_factory: Any) -> Run:
    """:func:`drive` inside a Hypothesis example: the scenario goes into a failing
    example's report, and what the examples reached into the statistics (pytest
    ``--hypothesis-show-statistics``)."""
    note(repr(sc))
    run = drive(sc, tmp_path_factory.mktemp("ck"))
    decided = len(run.decisions)
    event(f"ended {run.coord.state.value}")
    event(f"failures decided: {min(decided, 3)}{'+' if decided > 3 else ''}")
    event(f"cancelled: {run.cancel is not None}")
    for what in sorted({what for what, _ in run.rt.timeline}):
        event(f"reported: {what}")
    return run


# ======================================================================================
# The properties.


def _full(epochs: int) -> list[tuple[int, int]]:
    return [(e, s) for e in range(epochs) for s in range(SPE)]


def check_every_epoch_once(run: Run) -> None:
    coord, sc = run.coord, run.scenario
    snap, hist = coord.snapshot(), coord.history()
    why = f"{snap.state.value}: {snap.reason}"
    assert [r.epoch for r in hist] == list(range(len(hist))), why
    for r in hist:
        assert r.verified and r.samples_trained == r.dataset_size == N, r
    full = _full(sc.epochs)
    # Whatever a worker's fate, its weights applied the steps in order, each once: nothing
    # skipped, nothing twice, never restarted from fresh weights after training.
    for w, steps in _trained(run.rt, run.lineages).items():
        assert steps == full[:len(steps)], (w, steps, why)
    members = [w.worker for w in snap.workers]
    if snap.state == JobState.SUCCEEDED:
        stopped_early = snap.reason is not None and snap.reason.startswith("early stopping")
        assert len(hist) == sc.epochs or (sc.early_stopping and stopped_early), why
        assert run.lineages.lineage(members[0]) == _full(len(hist)), why
        # The job's counts are its history's, whatever rolled back (one count each).
        assert snap.rebalances_total == sum(r.rebalances for r in hist), why
        assert snap.retried_samples_total == sum(r.retried_samples for r in hist), why
    elif snap.state == JobState.CANCELLED and members and hist:
        # What the records say was trained, the state kept holds (and possibly more).
        held = max(len(run.lineages.lineage(m)) for m in members)
        assert held >= len(hist) * SPE, why


def check_cancel_bound(run: Run) -> None:
    """The bound: one step boundary. The engine answers a boundary with a pending cancel
    before anything else (``SyncEngine._boundary``): it commits the one segment already
    in flight ("one step": nothing new is sent), ends the epoch that segment completes
    and has it evaluated ("one evaluation"), waits for the evaluations already out,
    writes the checkpoint and ends the job, all in that one ``step()``. So the first
    ``coord.step()`` after ``cancel()`` returns False with the job ended; no segment is
    submitted after the cancel, at most one evaluation round is, and the steps trained
    after it are the in-flight segment's only (no further epoch is trained). The job
    ends CANCELLED, or SUCCEEDED when that segment completed the last (or an early-
    stopped) epoch, or FAILED when the failure policy failed it on the way."""
    seen, coord = run.cancel, run.coord
    assert seen is not None
    snap = coord.snapshot()
    assert snap.state.is_terminal, snap
    assert seen.steps_to_end == 1, (seen, snap.state, snap.reason)
    assert seen.submitted_after == seen.submitted_before, seen
    assert seen.evaluations_after - seen.evaluations_before <= 1, seen
    assert seen.trained_after <= seen.in_flight, seen
    if snap.state == JobState.SUCCEEDED:
        assert seen.trained_after, (seen, snap.reason)
    elif snap.state == JobState.FAILED:
        assert any(isinstance(d, Fail) for _, d in run.decisions[seen.decisions_before:]), (
            snap.reason)
    else:
        assert snap.state == JobState.CANCELLED, snap
    # No further epoch: the records after the cancel are the epochs the in-flight segment
    # completed, or that had ended before it (their evaluations were awaited).
    ended = max((e + 1 for e, s in seen.trained_after if s == SPE - 1), default=0)
    assert len(coord.history()) <= max(seen.history_before + 1, ended), seen


def check_no_effect_after_leaving(run: Run) -> None:
    assert run.rt.violations == [], run.rt.violations


def check_one_decision_per_failure(run: Run) -> None:
    """Read in order, each failure the runtime reported is decided once, after it: a
    segment that failed (the first since the group formed, by a counted decision; the one
    sent ahead of it, failing with it, by at most one uncounted decision), a regroup that
    failed, an evaluation round that failed on a live worker (by a decision naming one of
    its failed shards). None is left undecided, except evaluation rounds a job that failed
    otherwise closed out (their failures no longer matter: it has ended)."""
    primary = secondary = regroups = 0
    rounds: list[set[tuple[str, tuple[int, int]]]] = []
    for what, info in run.rt.timeline:
        where = (what, info, run.decisions)
        if what == "segment failed (primary)":
            primary += 1
        elif what == "segment failed (secondary)":
            secondary += 1
        elif what == "regroup failed":
            regroups += 1
        elif what == "evaluation failed":
            rounds.append(info)
        elif info.kind == "segment" and getattr(info, "counted", True):
            assert primary > 0, ("a counted decision of no failed segment", *where)
            primary -= 1
        elif info.kind == "segment":
            assert secondary > 0, ("an uncounted decision of no failed segment", *where)
            secondary -= 1
        elif info.kind == "regroup":
            assert regroups > 0, ("a decision of no failed regroup", *where)
            regroups -= 1
        elif info.kind == "evaluation":
            shard = (info.worker, info.shard)
            match = next((r for r in rounds if shard in r), None)
            assert match is not None, ("a decision of no failed evaluation round", *where)
            rounds.remove(match)
    assert primary == 0 and regroups == 0, ("undecided", primary, regroups, run.decisions)
    if run.coord.state != JobState.FAILED:
        assert rounds == [], ("undecided evaluation rounds", rounds, run.decisions)


@SETTINGS
@given(sc=scenarios())
def test_every_epoch_is_covered_exactly_once(tmp_path_factory, sc):
    check_every_epoch_once(drive_example(sc, tmp_path_factory))


@SETTINGS
@given(sc=scenarios(cancel=True))
# Cancelled while the segment that completes epoch 0 is in flight, and that epoch's
# evaluation fails on a live worker: it is not evaluated again ("one evaluation").
@example(sc=Scenario(epochs=2, checkpoint=False, keep_best=False, early_stopping=False,
                     faults=(Fault(kind="eval_error", worker=0),), actions=(), cancel_at=2))
def test_a_cancel_ends_the_job_at_the_next_step_boundary(tmp_path_factory, sc):
    run = drive_example(sc, tmp_path_factory)
    if run.cancel is not None:  # (None: the job had ended before the drawn point)
        check_cancel_bound(run)


@SETTINGS
@given(sc=scenarios())
def test_no_effect_is_issued_to_a_worker_that_left(tmp_path_factory, sc):
    check_no_effect_after_leaving(drive_example(sc, tmp_path_factory))


@SETTINGS
@given(sc=scenarios())
def test_every_failure_gets_exactly_one_decision(tmp_path_factory, sc):
    check_one_decision_per_failure(drive_example(sc, tmp_path_factory))


def test_a_worker_that_left_is_killed_once(tmp_path):
    """Found by the properties above: w0 dies in the first evaluation (epoch 0's, sent
    ahead of the next epoch's first segment, which w0 is in), and the segment behind it
    reports it lost again; it was queued to be stopped twice."""
    sc = Scenario(epochs=2, checkpoint=False, keep_best=False, early_stopping=False,
                  faults=(Fault(kind="die_in_evaluation", worker=0),), actions=(),
                  cancel_at=None)
    run = drive(sc, tmp_path)
    assert run.coord.state == JobState.SUCCEEDED, run.coord.snapshot().reason
    assert sorted(run.rt.kills) == sorted(set(run.rt.kills)), run.rt.kills

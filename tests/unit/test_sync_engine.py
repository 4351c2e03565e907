"""The step loop's pure engine (``scheduler/core/sync/engine.py``): what a boundary does,
from events and the facts they carry, with no driver behind it.

The property drives it with random facts after every command (a cancel can arrive, an
epoch can end, the job can finish inside any command) and checks the loop's rules; the
real driver running these commands is tested through the coordinator's own tests.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from dynabatch.scheduler.core.sync.engine import InvalidEvent, SyncEngine
from dynabatch.scheduler.core.sync.messages import (
    AbsorbAhead,
    AdoptStarted,
    ApplyDrains,
    ApplyRequests,
    AwaitStarts,
    BeginEpoch,
    Boundary,
    Checkpoint,
    Command,
    CommitInFlight,
    Crossing,
    Done,
    EndEpoch,
    EndStep,
    Evaluate,
    EvaluationsIn,
    Event,
    Facts,
    FinishCancelled,
    FinishSucceeded,
    GiveUpStarts,
    JudgeEpoch,
    KillLeaving,
    LoadCheckpoint,
    LoadData,
    MarkRunning,
    NextEpoch,
    PollNodes,
    PostPlanUpdate,
    PublishReady,
    Regroup,
    Regrouped,
    Replan,
    RequestsTaken,
    SaveModel,
    SegmentDone,
    Settle,
    SpawnWorkers,
    TendSpares,
    TrainSegment,
    Verdict,
    WaitForMinimum,
    WorkersPlaced,
    WorkersStarted,
    outcome,
)
from dynabatch.scheduler.core.sync.states import (
    AtRest,
    CancelCommitting,
    CancelSettling,
    Finishing,
    Opening,
    Regrouping,
    RollingBack,
    Training,
    Waiting,
)
from hypothesis import given, settings
from hypothesis import strategies as st


class Engine(SyncEngine):
    """The engine answered as the driver answers it: each batch that does not end the step
    with the event its last command yields (``outcome``)."""

    def __init__(self) -> None:
        super().__init__()
        self.last: list[Command] = []

    def on(self, event: Event) -> list[Command]:
        self.last = super().on(event)
        return self.last

    def ran(self, facts: Facts, ok: bool | Verdict = True) -> list[Command]:
        """Answer the last batch: its last command ran (``ok``: it formed, it all ran), and
        ``facts`` are what the machines say after it."""
        return self.on(outcome(self.last[-1], facts, ok))


rarely = st.sampled_from([False, False, False, True])  # so that most boundaries train
# keep_best's description of the best epoch so far (a judged epoch's Verdict).
BEST = {"metric": "loss", "mode": "min", "value": 0.5, "epoch": 0}
verdicts = st.builds(Verdict, st.sampled_from([None, BEST]),
                     st.sampled_from([None, "early stopping: loss has not improved"]))
facts = st.builds(
    Facts,
    terminal=rarely,
    cancel_requested=rarely,
    data_loaded=st.booleans(),
    in_flight=st.booleans(),
    trained=st.booleans(),
    epoch_open=st.booleans(),
    epoch_complete=st.booleans(),
    check_due=st.booleans(),
    trained_any=st.booleans(),
    retrying=rarely,
    requests_pending=rarely,
    regroup_due=rarely,
    drains_due=rarely,
    stamps_fixed=st.booleans(),
    crossing=st.none()
    | st.builds(
        Crossing,
        next_epoch=st.integers(1, 4),
        epochs=st.integers(1, 4),
        goodput=st.booleans(),
        next_batch=st.sampled_from([32, 64]),
        batch=st.sampled_from([32, 64]),
        checkpoint_due=st.booleans(),
        replans_at_end=st.booleans(),
    ),
    pending=st.booleans(),
    starting=rarely,
    starts_pending=rarely,
    start_overdue=st.booleans(),
    node_poll_due=st.booleans(),
    shortfall=st.none() | st.just("1 of 2 workers"),
    holders=st.sampled_from([True, True, True, False]),
    needs_state=st.booleans(),
    holding_restored=st.booleans(),
    update_offered=st.booleans(),
    checkpoint_due=st.booleans(),
    judges_epochs=st.booleans(),
    keeps_checkpoints=st.booleans(),
    stopping=rarely,
)
# Nodes listed after the first start: the missing workers started on them, spares tended.
PLACE = [PollNodes(), SpawnWorkers(), TendSpares()]
# An epoch's end with nothing due and nothing judged.
END = [EndEpoch(), Evaluate(), NextEpoch()]


def _boundary(engine: SyncEngine, first: Facts, data: st.DataObject):
    """One boundary: every batch of commands with the facts that preceded it, and the
    outcome that answered it; and the engine's state after each batch."""
    batches, states = [], []
    before, commands = first, engine.on(Boundary(first))
    waits = 0
    for _ in range(24):
        # Workers taken out of the job are stopped first thing in the next batch, and only
        # then; the rest of the batch is what the facts decide (checked below).
        assert (commands[:1] == [KillLeaving()]) == before.stopping, (before.stopping, commands)
        commands = commands[1:] if before.stopping else commands
        assert KillLeaving() not in commands
        assert commands, "a batch is never empty"
        last = commands[-1]
        if isinstance(last, EndStep):
            assert not any(isinstance(c, EndStep) for c in commands[:-1])
            batches.append((before, commands, None))
            states.append(engine.state)
            return batches, states
        after, ok = data.draw(facts), data.draw(st.booleans())
        if isinstance(last, JudgeEpoch):  # the epoch's judgement comes with its outcome
            ok = data.draw(verdicts)
        if isinstance(last, AwaitStarts):  # the start timeout ends the first start's wait
            waits += 1
            after = replace(after, start_overdue=after.start_overdue or waits >= 3)
        batches.append((before, commands, (after, ok)))
        states.append(engine.state)
        before, commands = after, engine.ran(after, ok)
    pytest.fail("a boundary did not end within 24 batches")


def _index(batches, facts: Facts) -> int:
    """Where the batch decided on ``facts`` is in the boundary."""
    return next(i for i, (b, _, _) in enumerate(batches) if b is facts)


def _previous(batches, facts: Facts) -> list | None:
    """The batch whose outcome was ``facts`` (None: they began the boundary)."""
    return next((cs for _, cs, o in batches if o is not None and o[0] is facts), None)


def _requests_applied(engine: Engine, facts: Facts) -> None:
    """A boundary at rest, up to its requests taken in (none drain anyone)."""
    assert engine.on(Boundary(facts)) in ([ApplyRequests()], [LoadData(), ApplyRequests()])
    assert engine.ran(facts) == [AdoptStarted()]


def _after(batches, facts: Facts) -> list:
    """The batch the engine answered ``facts`` with."""
    return next(cs for b, cs, _ in batches if b is facts)


def _epoch_end(batches, before: Facts) -> Facts:
    """Check the epoch's end that ``before`` decided (its batch starts with EndEpoch) and
    return the facts that the step after it was decided on: a checkpoint due or a judged
    epoch awaits the evaluation first; a judged epoch's checkpoints follow its judgement
    (the best so far; early stopping's when the job keeps checkpoints, a due one anyway);
    then the next epoch begins."""
    cs = _after(batches, before)
    answered = next(o for b, _, o in batches if b is before)
    assert cs[:2] == [EndEpoch(), Evaluate()]
    if not before.judges_epochs:
        due = [Settle(), Checkpoint("epoch")] if before.checkpoint_due else []
        assert cs[2:] == [*due, NextEpoch()]
        return answered[0]
    assert cs[2:] == [Settle(), JudgeEpoch()]
    judged, verdict = answered
    if judged.terminal:  # the job ended while the evaluation was awaited
        return judged
    saves = [Checkpoint("best", BEST)] if verdict.best else []
    if before.checkpoint_due:
        saves.append(Checkpoint("epoch"))
    elif verdict.stop and before.keeps_checkpoints:
        saves.append(Checkpoint("early stopping"))
    assert _after(batches, judged) == [*saves, NextEpoch(verdict.stop)]
    return next(o for b, _, o in batches if b is judged)[0]


@settings(max_examples=500)  # cheap examples; the rules have many branches
@given(first=facts, data=st.data())
def test_every_boundary_follows_the_loops_rules(first: Facts, data: st.DataObject) -> None:
    engine = Engine()
    for _ in range(3):  # consecutive boundaries: each starts where the last left the engine
        rest = engine.state  # between boundaries: at rest, or waiting for workers
        assert isinstance(rest, (AtRest, Waiting))
        batches, states = _boundary(engine, first, data)
        flat = [c for _, cs, _ in batches for c in cs]
        def became(*kinds: type, states=states) -> int | None:
            """The first batch after which the engine was one of ``kinds``."""
            return next((i for i, x in enumerate(states) if isinstance(x, kinds)), None)

        if first.terminal:
            assert flat == [EndStep(stop=True)]
        cancel_at = became(CancelCommitting, CancelSettling)
        cancelling = cancel_at is not None
        if cancelling:  # a cancel trains nothing new and stops the loop
            assert flat[-1] == EndStep(stop=True)
            after_cancel = [c for _, cs, _ in batches[cancel_at:] for c in cs]
            assert not any(
                isinstance(c, (TrainSegment, ApplyRequests, ApplyDrains, Regroup, AbsorbAhead))
                for c in after_cancel
            )
            for i, c in enumerate(after_cancel):  # only the segment in flight's epoch
                if isinstance(c, BeginEpoch):
                    assert after_cancel[i + 1] == CommitInFlight()
            if FinishCancelled() in flat:  # the checkpoint holds what was trained, then
                i = flat.index(FinishCancelled())
                assert flat[i - 1] in (Checkpoint("cancel"), SaveModel("cancel"))
                assert Settle() in flat[:i]
        for before, commands, answered in batches:
            for c in commands:
                if isinstance(c, LoadData):
                    assert not before.data_loaded
                if isinstance(c, BeginEpoch):  # (right after an epoch ended, it is not)
                    ended = any(o is not None and o[0] is before and isinstance(cs[-1], NextEpoch)
                                for _, cs, o in batches)
                    assert not before.epoch_open or ended
                if isinstance(c, FinishSucceeded):
                    # After FINISHING awaited the last evaluations, with a holder left, and
                    # not beside a pending cancel unless the cancel's own segment ended it.
                    assert before.holders
                    i = became(Finishing)
                    assert i is not None and i < _index(batches, before)
                    assert batches[i][1][-1] == Settle()
                    assert commands[commands.index(c) - 1] == SaveModel("end")
                    assert not before.cancel_requested or cancelling
                if isinstance(c, TrainSegment):
                    # Decided to train by the facts of the batch that began training.
                    decided = batches[became(Opening, Training)][0]
                    assert not decided.cancel_requested and not decided.trained
                    # Sent ahead only when the next boundary need not have the group at
                    # rest; across the epoch only when it may be sent ahead at all.
                    if c.ahead:
                        assert not (
                            before.cancel_requested
                            or before.retrying
                            or before.requests_pending
                            or before.regroup_due
                        )
                        assert before.stamps_fixed
                    if c.across:
                        assert c.ahead and before.crossing is not None
                        cr = before.crossing
                        assert cr.next_epoch < cr.epochs and cr.next_batch == cr.batch
                        assert not (cr.goodput or cr.checkpoint_due or cr.replans_at_end)
            # What came before this batch in the boundary: the first start's waits, and
            # whether the batch right before it was one.
            previous = _previous(batches, before)
            waited = previous is not None and isinstance(previous[-1], AwaitStarts)
            earlier_waits = [x for _, cs, _ in batches[: _index(batches, before)]
                             for x in cs if isinstance(x, AwaitStarts)]
            for c in commands:
                if isinstance(c, (ApplyRequests, ApplyDrains, Regroup, AwaitStarts,
                                  GiveUpStarts)):
                    assert not first.in_flight  # membership changes wait for a rest
                if isinstance(c, ApplyRequests):  # alone; what it drains leaves next
                    assert commands[-1] == c
                    after, _ = answered
                    nxt = _after(batches, after)
                    if after.terminal:
                        assert nxt == [EndStep()]
                    elif after.drains_due:  # the evaluations settled first
                        assert nxt == [Settle(), ApplyDrains(), AdoptStarted()]
                    else:
                        assert nxt == [AdoptStarted()]
                if isinstance(c, ApplyDrains):  # only right after the requests, when due
                    assert before.drains_due
                    assert commands[: commands.index(c) + 1] == [Settle(), c]
                    assert any(o is not None and o[0] is before and cs[-1] == ApplyRequests()
                               for _, cs, o in batches)
                if isinstance(c, PollNodes) and first.in_flight:  # when due
                    assert before.node_poll_due and not c.starting
                elif isinstance(c, PollNodes) and waited:
                    # The first start's wait took in the workers that came up, and none is
                    # left starting: those that failed to start are started again.
                    assert c.starting and not before.starts_pending
                    assert commands == [c, SpawnWorkers(starting=True)]
                elif isinstance(c, PollNodes):  # when due, or at once after a change
                    assert before.node_poll_due or before.starting or before.regroup_due
                    assert c.starting == before.starting
                if isinstance(c, PollNodes):  # the listed nodes get the missing workers,
                    # then the spares (not at the first start)
                    i = commands.index(c)
                    spares = [] if c.starting else [TendSpares()]
                    assert commands[i + 1 : i + 2 + len(spares)] == [
                        SpawnWorkers(starting=c.starting), *spares]
                    assert not before.terminal
                if isinstance(c, (SpawnWorkers, TendSpares)):
                    assert any(isinstance(x, PollNodes) for x in commands[: commands.index(c)])
                if isinstance(c, AwaitStarts):
                    # Only while workers are starting, the job not cancelled, the start
                    # timeout not over (it counts from the first wait, right after the
                    # first start placed its workers).
                    assert commands == [c] and before.starts_pending
                    assert not before.cancel_requested
                    assert previous[-1] in (SpawnWorkers(starting=True), *earlier_waits)
                    assert c.first == (not earlier_waits)
                    assert c.first or not before.start_overdue
                    after, _ = answered
                    if not (after.terminal or after.starts_pending):  # none left starting:
                        # the ones that failed are started again
                        assert _after(batches, after) == [PollNodes(True), SpawnWorkers(True)]
                if isinstance(c, GiveUpStarts):  # still starting: over the timeout, or cancelled
                    assert commands == [c] and before.starts_pending
                    assert before.cancel_requested or before.start_overdue
                    assert before.cancel_requested or earlier_waits  # the timeout counts
                    # from the first wait, which always happens
                    assert previous[-1] in (SpawnWorkers(starting=True), *earlier_waits)
                if isinstance(c, WaitForMinimum):  # too few: wait, and the step ends
                    assert c.shortfall == before.shortfall
                    assert not before.cancel_requested  # a pending cancel cancels instead
                    assert commands[-2:] == [c, EndStep()]
                    # A wait goes on from the one the boundary began in, or starts now.
                    assert c.since == (rest.since if isinstance(rest, Waiting) else None)
                    since = before.now if c.since is None else c.since
                    assert engine.state == Waiting(since, before.shortfall)
                if isinstance(c, LoadCheckpoint):  # no holder: the checkpoint first
                    assert before.regroup_due and before.shortfall is None
                    assert before.needs_state and not before.holding_restored
                    # the evaluations in flight settled first
                    assert commands == [Settle(), LoadCheckpoint()]
                    after, _ = answered
                    nxt = next(cs for b, cs, _ in batches if b is after)
                    assert nxt == [Regroup()]
                if isinstance(c, Regroup):
                    assert commands == [c]
                    if not any(LoadCheckpoint() in cs for _, cs, _ in batches):
                        assert before.regroup_due and before.shortfall is None
                        assert not before.needs_state or before.holding_restored
                if isinstance(c, MarkRunning):
                    assert before.pending
            if Regroup() in commands and not answered[1]:  # it failed: the step ends
                assert next(cs for b, cs, _ in batches if b is answered[0]) == [EndStep()]
            if Regroup() in commands and answered[1]:
                # Formed mid-epoch: the rest of the epoch is split over the new group first.
                after, _ = answered
                nxt = next(cs for b, cs, _ in batches if b is after)
                resplit = after.epoch_open and not after.epoch_complete
                assert (nxt[:1] == [Replan("membership")]) == resplit
                if resplit:
                    assert nxt == [Replan("membership")]
            if Replan("membership") in commands:
                assert any(
                    o is not None and o[0] is before and o[1] and Regroup() in cs
                    for _, cs, o in batches
                )
            if any(isinstance(c, TrainSegment) for c in commands) and not first.in_flight:
                # Trained only with the group formed: no shortfall, no change pending.
                # (With a regroup, the facts that decided it had none: the rule above.)
                formed = batches[became(Opening, Training)][0]
                if Regroup() not in flat:
                    assert formed.shortfall is None and not formed.regroup_due
            if commands and isinstance(commands[-1], TrainSegment):
                after, ok = answered
                nxt = next(cs for b, cs, _ in batches if b is after)
                if not ok and after.in_flight:
                    # Failed with the next segment sent: that one is absorbed, in the next
                    # epoch when the failed one completed this.
                    if not after.epoch_complete:
                        assert nxt == [AbsorbAhead()]
                        continue
                    ended = _epoch_end(batches, after)
                    nxt = _after(batches, ended)
                    if not ended.terminal:
                        assert nxt == [BeginEpoch(), AbsorbAhead()]
                    continue
                if after.epoch_complete:
                    assert nxt[:1] == [EndEpoch()]
                    continue
                if ok and after.check_due:  # a check re-plans only after a segment that ran
                    assert nxt == [Replan("check")]
                else:
                    assert nxt == [PublishReady(), EndStep()]
            if commands and isinstance(commands[-1], Replan) and commands[-1].cause != "membership":
                # A re-plan offered inside the segment in flight is posted at once, alone;
                # then the epoch's segment (at its opening) or the boundary's end. (A
                # re-split after a regroup has nothing in flight: the group trains on.)
                after, _ = answered
                nxt = next(cs for b, cs, _ in batches if b is after)
                if after.update_offered:
                    assert nxt == [PostPlanUpdate()]
                    posted, _ = next(o for b, _, o in batches if b is after)
                    nxt = next(cs for b, cs, _ in batches if b is posted)
                if commands[-1].cause == "check":
                    assert nxt == [PublishReady(), EndStep()]
                else:
                    assert len(nxt) == 1 and isinstance(nxt[0], TrainSegment)
            if AbsorbAhead() in commands:  # what was sent ahead of a failed segment
                failed = [o for _, cs, o in batches if isinstance(cs[-1], TrainSegment)]
                assert failed and not failed[0][1] and failed[0][0].in_flight
                after, _ = answered
                nxt = next(cs for b, cs, _ in batches if b is after)
                if after.epoch_complete:
                    assert nxt[:1] == [EndEpoch()]
                else:
                    assert nxt == [PublishReady(), EndStep()]
            for c in commands:
                if isinstance(c, PostPlanUpdate):  # only right after a re-plan offered one
                    assert commands == [c] and before.update_offered
                    assert any(
                        o is not None and o[0] is before and isinstance(cs[-1], Replan)
                        and cs[-1].cause != "membership"
                        for _, cs, o in batches
                    )
            absorbing = any(o is not None and o[0] is before and isinstance(cs[-1], TrainSegment)
                            and not o[1] and before.in_flight for _, cs, o in batches)
            for c in commands:
                if isinstance(c, EndEpoch):  # always the start of an epoch's end
                    assert commands[0] == c
                if isinstance(c, Evaluate):  # the ended epoch, right after its end
                    assert commands[:2] == [EndEpoch(), c]
                if isinstance(c, (JudgeEpoch, NextEpoch)) or c in (
                    Checkpoint("epoch"), Checkpoint("best", BEST), Checkpoint("early stopping")
                ):  # only in an epoch's end
                    assert any(
                        cs[:1] == [EndEpoch()]
                        and (cs is commands or (o is not None and o[0] is before))
                        for _, cs, o in batches
                    )
            if commands[:1] == [EndEpoch()]:
                ended = _epoch_end(batches, before)
            if commands[:1] == [EndEpoch()] and not (cancelling or absorbing):
                after = ended  # then Finishing, or back
                nxt = _after(batches, after)
                i = _index(batches, after)
                if after.terminal:
                    assert nxt == [EndStep()]
                elif after.trained and after.holders:
                    assert nxt == [Settle()] and states[i] == Finishing(cancelling=False)
                else:
                    assert nxt == [PublishReady(), EndStep()] and states[i] == AtRest()
        # Finishing only with every epoch trained and a holder of the final state.
        for (before, _, _), state in zip(batches, states, strict=True):
            if isinstance(state, Finishing):
                assert before.trained and before.holders
        if flat[-1] == EndStep(stop=True):
            break
        first = data.draw(facts)


def test_a_training_boundary() -> None:
    engine = Engine()
    first = Facts(data_loaded=False, pending=True, starting=True)
    assert engine.on(Boundary(first)) == [LoadData(), ApplyRequests()]
    assert engine.ran(first) == [AdoptStarted()]
    assert engine.ran(first) == [PollNodes(starting=True), SpawnWorkers(starting=True)]
    assert engine.ran(replace(first, starts_pending=True)) == [AwaitStarts(first=True)]
    # All came up: the missing ones (none) are started again, then the group forms.
    assert engine.ran(first) == [PollNodes(starting=True), SpawnWorkers(starting=True)]
    assert engine.ran(Facts(pending=True, regroup_due=True)) == [
        Regroup(),
    ]
    assert engine.ran(Facts(pending=True), ok=True) == [
        MarkRunning(),
        BeginEpoch(),
        Replan(),
    ]
    # The epoch opened: the segment after this one may go ahead, but not into the next
    # epoch when a checkpoint is due between them.
    crossing = Crossing(
        next_epoch=1,
        epochs=3,
        goodput=False,
        next_batch=64,
        batch=64,
        checkpoint_due=True,
        replans_at_end=False,
    )
    assert engine.ran(Facts(epoch_open=True, crossing=crossing)) == [
        TrainSegment(ahead=True, across=False)
    ]
    assert engine.ran(Facts(epoch_open=True, check_due=True), ok=True) == [
        Replan("check")
    ]
    assert engine.ran(Facts(epoch_open=True)) == [PublishReady(), EndStep()]
    # Next boundary, a segment in flight: no requests applied, no regroup; nodes listed
    # when due; it completes the epoch.
    in_flight = Facts(in_flight=True, epoch_open=True, node_poll_due=True, regroup_due=True)
    assert engine.on(Boundary(in_flight)) == [AdoptStarted(), *PLACE]
    nothing_due = replace(crossing, checkpoint_due=False)
    assert engine.ran(Facts(in_flight=True, epoch_open=True, crossing=nothing_due)) == [
        TrainSegment(ahead=True, across=True),
    ]
    assert engine.ran(Facts(epoch_open=True, epoch_complete=True), ok=True) == END
    assert engine.ran(Facts()) == [PublishReady(), EndStep()]
    # A retry runs alone (nothing is sent ahead of it); the segment failed after its last
    # step's collective and still completed the epoch.
    assert engine.on(Boundary(Facts(epoch_open=True))) == [ApplyRequests()]
    assert engine.ran(Facts(epoch_open=True)) == [AdoptStarted()]
    assert engine.ran(Facts(epoch_open=True, retrying=True)) == [
        TrainSegment(ahead=False, across=False),
    ]
    assert engine.ran(Facts(epoch_open=True, epoch_complete=True), ok=False) == END
    assert engine.ran(Facts()) == [PublishReady(), EndStep()]


def test_a_drain_waits_for_the_evaluations_in_flight() -> None:
    """A drained worker may still owe its shard of an evaluation: the requests are taken in,
    then the evaluations settle, then the drained workers leave (and the group regroups)."""
    engine = Engine()
    asked = Facts(epoch_open=True, requests_pending=True)
    assert engine.on(Boundary(asked)) == [ApplyRequests()]
    assert engine.ran(replace(asked, drains_due=True)) == [
        Settle(),
        ApplyDrains(),
        AdoptStarted(),
    ]
    changed = Facts(epoch_open=True, regroup_due=True)
    assert engine.ran(changed) == PLACE  # a changed group lists the nodes first
    assert engine.ran(changed) == [Regroup()]
    # A scale up drains nobody: nothing waits for the evaluations.
    engine = Engine()
    assert engine.on(Boundary(asked)) == [ApplyRequests()]
    assert engine.ran(asked) == [AdoptStarted()]


def test_a_replan_inside_the_segment_in_flight_is_posted_to_its_workers_at_once() -> None:
    engine = Engine()
    # A check after a segment: the re-plan changed the batches from a step of the segment
    # sent ahead; it is posted before the boundary ends.
    engine.on(Boundary(Facts(in_flight=True, epoch_open=True)))
    assert engine.ran(Facts(in_flight=True, epoch_open=True)) == [
        TrainSegment(ahead=True, across=False),
    ]
    assert engine.ran(Facts(in_flight=True, epoch_open=True, check_due=True)) == [
        Replan("check")
    ]
    offered = Facts(in_flight=True, epoch_open=True, update_offered=True)
    assert engine.ran(offered) == [PostPlanUpdate()]
    assert engine.ran(Facts(in_flight=True, epoch_open=True)) == [PublishReady(), EndStep()]
    # The epoch's opening plan, with the next epoch's first segment already sent: posted,
    # then the segment.
    assert engine.on(Boundary(Facts(in_flight=True))) == [AdoptStarted()]
    assert engine.ran(Facts(in_flight=True)) == [
        BeginEpoch(),
        Replan(),
    ]
    assert engine.ran(replace(offered, epoch_open=True)) == [PostPlanUpdate()]
    assert engine.ran(Facts(in_flight=True, epoch_open=True)) == [
        TrainSegment(ahead=True, across=False)
    ]


def test_the_first_start_waits_for_its_workers_then_gives_up_those_not_up() -> None:
    """The first start's wait is the engine's: a little at a time while workers are
    starting; the ones that failed started again once none is left starting; those still
    starting given up past the start timeout (counted from the first wait: a timeout left
    over from an earlier boundary does not cut it) or on a cancel, which then cancels the
    job rather than wait for workers."""
    start = [PollNodes(starting=True), SpawnWorkers(starting=True)]
    starting = Facts(pending=True, starting=True)
    waiting = replace(starting, starts_pending=True)
    engine = Engine()
    _requests_applied(engine, starting)
    assert engine.ran(starting) == start
    assert engine.ran(replace(waiting, start_overdue=True)) == [AwaitStarts(first=True)]
    assert engine.ran(waiting) == [AwaitStarts()]
    assert engine.ran(starting) == start  # none left starting: replace the failed ones
    assert engine.ran(waiting) == [AwaitStarts()]
    assert engine.ran(replace(waiting, start_overdue=True)) == [GiveUpStarts()]
    given_up = Facts(pending=True, starting=True, shortfall="0 of 2 workers", stopping=True)
    assert engine.ran(given_up) == [
        KillLeaving(), WaitForMinimum("0 of 2 workers"), EndStep()]

    # All up at the first wait: the group forms (nothing failed, nothing is started again).
    _requests_applied(engine, starting)
    assert engine.ran(starting) == start
    assert engine.ran(waiting) == [AwaitStarts(first=True)]
    assert engine.ran(starting) == start
    assert engine.ran(Facts(pending=True, regroup_due=True)) == [
        Regroup()]

    # A cancel during the wait gives up at once; the job ends at the next boundary.
    engine = Engine()
    _requests_applied(engine, starting)
    assert engine.ran(starting) == start
    assert engine.ran(replace(waiting, cancel_requested=True)) == [GiveUpStarts()]
    gave_up = Facts(pending=True, cancel_requested=True, shortfall="0 of 2", stopping=True)
    assert engine.ran(gave_up) == [KillLeaving(), Settle()]


@settings(max_examples=300)
@given(data=st.data())
def test_the_first_starts_wait_follows_its_rules(data: st.DataObject) -> None:
    """Random facts after every command of the first start's wait (the big property above
    reaches it rarely): it waits while workers are starting, the first wait whatever a
    timeout left over says; once none is left starting after a wait, the ones that failed
    are started again; still starting past the timeout or on a cancel, they are given up;
    a terminal job ends the step; otherwise who trains is known and the wait is over."""
    during = st.builds(
        Facts, terminal=rarely, cancel_requested=rarely, pending=st.just(True),
        starting=st.booleans(), starts_pending=st.booleans(), start_overdue=st.booleans(),
        shortfall=st.none() | st.just("0 of 2 workers"), regroup_due=st.booleans(),
        stopping=rarely)
    engine = Engine()
    _requests_applied(engine, Facts(pending=True, starting=True))
    previous = engine.ran(Facts(pending=True, starting=True))
    assert previous == [PollNodes(starting=True), SpawnWorkers(starting=True)]
    waits = 0
    for _ in range(40):
        f = data.draw(during)
        if waits >= 4:  # the start timeout is over by then
            f = replace(f, start_overdue=True)
        commands = engine.ran(f)
        assert (commands[:1] == [KillLeaving()]) == f.stopping
        body = commands[1:] if f.stopping else commands
        if f.terminal:
            assert body == [EndStep()]
            return
        if f.starts_pending:
            if f.cancel_requested or (f.start_overdue and waits > 0):
                assert body == [GiveUpStarts()]
                return
            assert body == [AwaitStarts(first=waits == 0)]
            waits += 1
        elif isinstance(previous[-1], AwaitStarts):
            assert body == [PollNodes(starting=True), SpawnWorkers(starting=True)]
        else:  # who trains is known: no more waiting or starting at this boundary
            assert not any(isinstance(c, (AwaitStarts, GiveUpStarts, PollNodes)) for c in body)
            return
        previous = body
    pytest.fail("the first start's wait did not end")


def test_a_group_formed_mid_epoch_resplits_the_rest_of_the_epoch_before_training() -> None:
    engine = Engine()
    _requests_applied(engine, Facts(epoch_open=True))
    mid = Facts(epoch_open=True, regroup_due=True)
    assert engine.ran(mid) == PLACE
    assert engine.ran(mid) == [Regroup()]
    assert engine.ran(Facts(epoch_open=True), ok=True) == [Replan("membership")]
    assert engine.ran(Facts(epoch_open=True)) == [
        TrainSegment(ahead=True, across=False),
    ]
    # The re-split had nothing in flight to post to: the group trains on whatever the facts
    # say next (here an epoch to open; a stray offer is not a re-plan's to post).
    assert engine.ran(Facts(epoch_open=True)) == [PublishReady(), EndStep()]
    _requests_applied(engine, Facts(epoch_open=True))
    engine.ran(mid)
    engine.ran(mid)
    assert engine.ran(Facts(epoch_open=True), ok=True) == [Replan("membership")]
    assert engine.ran(Facts(update_offered=True)) == [
        BeginEpoch(),
        Replan(),
    ]
    # Between epochs (the next is planned when it begins), or the epoch complete: no re-split.
    engine = Engine()
    _requests_applied(engine, Facts())
    engine.ran(Facts(regroup_due=True))
    engine.ran(Facts(regroup_due=True))
    assert engine.ran(Facts(), ok=True) == [BeginEpoch(), Replan()]


def test_workers_taken_out_are_killed_before_anything_else() -> None:
    """A segment failed with a worker lost and the next segment sent: the lost worker is
    killed before the one sent ahead is collected (what it queued then fails at once), and
    drained workers before the nodes are listed and workers spawned on them."""
    engine = Engine()
    _requests_applied(engine, Facts(epoch_open=True))
    engine.ran(Facts(epoch_open=True))
    lost = Facts(in_flight=True, epoch_open=True, stopping=True)
    assert engine.ran(lost, ok=False) == [KillLeaving(), AbsorbAhead()]
    assert engine.ran(Facts(epoch_open=True)) == [PublishReady(), EndStep()]
    assert engine.on(Boundary(Facts(epoch_open=True))) == [ApplyRequests()]
    assert engine.ran(Facts(epoch_open=True, drains_due=True)) == [
        Settle(), ApplyDrains(), AdoptStarted()]
    drained = Facts(epoch_open=True, regroup_due=True, stopping=True)
    assert engine.ran(drained) == [KillLeaving(), *PLACE]
    # A job that ended inside a command still stops them.
    assert engine.ran(Facts(terminal=True, stopping=True)) == [KillLeaving(), EndStep()]


def test_what_was_sent_ahead_of_a_failed_segment_is_absorbed_in_its_epoch() -> None:
    engine = Engine()
    _requests_applied(engine, Facts(epoch_open=True))
    engine.ran(Facts(epoch_open=True))
    # The segment failed mid-epoch with the next one sent: that one is collected.
    assert engine.ran(Facts(in_flight=True, epoch_open=True), ok=False) == [AbsorbAhead()]
    assert engine.ran(Facts(epoch_open=True)) == [PublishReady(), EndStep()]
    # It failed after completing the epoch, with the next epoch's first sent: the epoch
    # ends, the next begins, then the one sent ahead is absorbed (and may complete it).
    _requests_applied(engine, Facts(epoch_open=True))
    engine.ran(Facts(epoch_open=True))
    done = Facts(in_flight=True, epoch_open=True, epoch_complete=True)
    assert engine.ran(done, ok=False) == END
    assert engine.ran(Facts(in_flight=True)) == [
        BeginEpoch(),
        AbsorbAhead(),
    ]
    assert engine.ran(Facts(epoch_open=True, epoch_complete=True)) == END
    assert engine.ran(Facts()) == [PublishReady(), EndStep()]
    # A segment that failed with nothing sent ahead: nothing to absorb.
    _requests_applied(engine, Facts(epoch_open=True))
    engine.ran(Facts(epoch_open=True))
    assert engine.ran(Facts(epoch_open=True), ok=False) == [PublishReady(), EndStep()]


def test_an_epochs_end_awaits_its_evaluation_then_writes_the_checkpoints_it_calls_for() -> None:
    ending = [EndEpoch(), Evaluate()]
    engine = Engine()
    _requests_applied(engine, Facts(epoch_open=True))
    engine.ran(Facts(epoch_open=True))
    # A checkpoint due: the epoch's evaluation is awaited (the checkpoint holds its record,
    # scores included), the checkpoint is written as the next epoch's start.
    due = Facts(epoch_open=True, epoch_complete=True, checkpoint_due=True)
    assert engine.ran(due) == [*ending, Settle(), Checkpoint("epoch"), NextEpoch()]
    assert engine.ran(Facts()) == [PublishReady(), EndStep()]
    # A judged epoch (early stopping, keep_best): judged once its evaluation is in; the best
    # so far and early stopping's stop are written (early stopping's only when the job keeps
    # checkpoints), then the training ends.
    judged = Facts(epoch_open=True, epoch_complete=True, judges_epochs=True,
                   keeps_checkpoints=True)
    for best, stop, keeps, due, saves in [
        (True, True, True, False, [Checkpoint("best", BEST), Checkpoint("early stopping")]),
        (False, True, False, False, []),
        (True, False, True, True, [Checkpoint("best", BEST), Checkpoint("epoch")]),
        (False, True, True, True, [Checkpoint("epoch")]),
        (False, False, True, False, []),
    ]:
        _requests_applied(engine, Facts(epoch_open=True))
        engine.ran(Facts(epoch_open=True))
        before = replace(judged, keeps_checkpoints=keeps, checkpoint_due=due)
        assert engine.ran(before) == [*ending, Settle(), JudgeEpoch()]
        verdict = Verdict(BEST if best else None, "stopped" if stop else None)
        assert engine.ran(Facts(), verdict) == [*saves, NextEpoch(verdict.stop)]
        assert engine.ran(Facts(trained=stop, trained_any=True)) == (
            [Settle()] if stop
            else [PublishReady(), EndStep()]
        )
        if stop:
            engine.ran(Facts(trained=True, trained_any=True))
    # The job ended while the evaluation was awaited: the step ends, nothing is written.
    _requests_applied(engine, Facts(epoch_open=True))
    engine.ran(Facts(epoch_open=True))
    engine.ran(judged)
    assert engine.ran(Facts(terminal=True), Verdict(BEST)) == [EndStep()]


def test_a_cancel_commits_a_segment_sent_across_the_epochs_end_in_its_epoch() -> None:
    engine = Engine()
    assert engine.on(Boundary(Facts(cancel_requested=True, in_flight=True))) == [
        BeginEpoch(),
        CommitInFlight(),
    ]


def test_too_few_workers_wait_and_a_failed_regroup_ends_the_step() -> None:
    engine = Engine()
    _requests_applied(engine, Facts())
    short = Facts(shortfall="1 of 2 workers", regroup_due=True)
    assert engine.ran(short) == PLACE  # the group changed: list nodes at once
    assert engine.ran(short) == [
        WaitForMinimum("1 of 2 workers"),
        EndStep(),
    ]
    _requests_applied(engine, Facts())
    assert engine.ran(Facts(regroup_due=True, node_poll_due=False)) == PLACE
    assert engine.ran(Facts(regroup_due=True)) == [Regroup()]
    assert engine.ran(Facts(regroup_due=True), ok=False) == [EndStep()]
    # No member holds the committed state: the checkpoint is loaded first (RollingBack);
    # weights restored and not yet loaded (a regroup that failed after loading them) need
    # no second load.
    _requests_applied(engine, Facts())
    lost = Facts(regroup_due=True, needs_state=True)
    assert engine.ran(lost) == PLACE
    assert engine.ran(lost) == [
        Settle(),
        LoadCheckpoint(),
    ]
    assert engine.state == RollingBack()  # inside the regroup, which goes on with it
    assert engine.ran(Facts(regroup_due=True)) == [Regroup()]
    assert engine.state == Regrouping()
    engine.ran(Facts(regroup_due=True), ok=False)
    _requests_applied(engine, Facts())
    engine.ran(replace(lost, holding_restored=True))
    assert engine.ran(replace(lost, holding_restored=True)) == [
        Regroup(),
    ]


def test_a_wait_for_workers_is_the_engines_state_and_carries_since_when() -> None:
    """Too few workers: the engine rests ``Waiting`` since the wait began; a boundary that
    finds too few again goes on with that wait (the job fails once it is over its limit),
    one that trains ends it, and a later shortfall starts a new one."""
    engine = Engine()
    short = Facts(shortfall="1 of 2 workers", now=10.0)
    _requests_applied(engine, short)
    assert engine.ran(short) == [WaitForMinimum("1 of 2 workers"), EndStep()]
    assert engine.state == Waiting(10.0, "1 of 2 workers")
    later = replace(short, now=25.0, shortfall="1 of 2 workers (node01 lost)")
    _requests_applied(engine, later)
    assert engine.ran(later) == [WaitForMinimum(later.shortfall, since=10.0), EndStep()]
    assert engine.state == Waiting(10.0, later.shortfall)
    # Enough workers: the group trains, and the wait is over.
    _requests_applied(engine, Facts(now=30.0))
    assert engine.ran(Facts(now=30.0)) == [BeginEpoch(), Replan()]
    assert engine.ran(Facts(epoch_open=True)) == [TrainSegment(ahead=True, across=False)]
    assert engine.ran(Facts(epoch_open=True)) == [PublishReady(), EndStep()]
    assert engine.state == AtRest()
    again = Facts(shortfall="1 of 2 workers", epoch_open=True, now=50.0)
    _requests_applied(engine, again)
    assert engine.ran(again) == [WaitForMinimum("1 of 2 workers"), EndStep()]
    assert engine.state == Waiting(50.0, "1 of 2 workers")
    # A cancel ends a wait at the next boundary.
    assert engine.on(Boundary(replace(again, cancel_requested=True))) == [Settle()]
    assert engine.state == CancelSettling()


def test_a_cancel_while_the_group_formed_cancels() -> None:
    engine = Engine()
    _requests_applied(engine, Facts(pending=True))
    assert engine.ran(Facts(pending=True, cancel_requested=True)) == [
        MarkRunning(),
        Settle(),
    ]
    assert engine.ran(Facts(cancel_requested=True, trained_any=True)) == [
        Checkpoint("cancel"),
        SaveModel("cancel"),
        FinishCancelled(),
        EndStep(stop=True),
    ]


def test_a_cancel_commits_the_segment_in_flight_and_its_last_epoch_can_succeed() -> None:
    engine = Engine()
    cancel = Facts(cancel_requested=True, in_flight=True, epoch_open=True)
    assert engine.on(Boundary(cancel)) == [CommitInFlight()]
    done = Facts(cancel_requested=True, epoch_open=True, epoch_complete=True)
    assert engine.ran(done) == END
    # That was the last epoch: the job finishes SUCCEEDED, not CANCELLED.
    trained = Facts(cancel_requested=True, trained=True, trained_any=True)
    assert engine.ran(trained) == [Settle()]
    assert engine.ran(trained) == [SaveModel("end"), FinishSucceeded(), EndStep(stop=True)]
    # Not the last: back to cancelling.
    engine.on(Boundary(cancel))
    engine.ran(done)
    assert engine.ran(Facts(cancel_requested=True, trained_any=True)) == [
        Settle(),
    ]
    # Nothing was trained: no model goes out.
    engine = Engine()
    engine.on(Boundary(Facts(cancel_requested=True)))
    assert engine.ran(Facts(cancel_requested=True)) == [
        Checkpoint("cancel"),
        FinishCancelled(),
        EndStep(stop=True),
    ]


def test_a_cancels_judged_epoch_end_that_finds_the_job_terminal_stops_the_loop() -> None:
    # Found by test_every_boundary_follows_the_loops_rules in a fresh-clone run: the
    # review's simplification to a plain EndStep() broke "a cancel stops the loop".
    engine = Engine()
    cancel = Facts(cancel_requested=True, in_flight=True, epoch_open=True)
    assert engine.on(Boundary(cancel)) == [CommitInFlight()]
    done = Facts(cancel_requested=True, epoch_open=True, epoch_complete=True,
                 judges_epochs=True)
    assert engine.ran(done)[-1] == JudgeEpoch()
    assert engine.ran(Facts(terminal=True)) == [EndStep(stop=True)]


def test_finishing_awaits_the_last_evaluations_and_yields_to_a_cancel_or_a_lost_holder():
    engine = Engine()
    _requests_applied(engine, Facts(epoch_open=True))
    engine.ran(Facts(epoch_open=True))
    assert engine.ran(Facts(epoch_open=True, epoch_complete=True)) == END
    trained = Facts(trained=True, trained_any=True)
    assert engine.ran(trained) == [Settle()]
    assert engine.state == Finishing(cancelling=False)
    assert engine.ran(trained) == [SaveModel("end"), FinishSucceeded(), EndStep()]
    # A cancel that came while the last evaluations were awaited wins at the next boundary.
    _requests_applied(engine, Facts())
    assert engine.ran(trained) == [Settle()]
    assert engine.ran(replace(trained, cancel_requested=True)) == [EndStep()]
    # The last holder was lost meanwhile: the next boundary regroups and trains on.
    _requests_applied(engine, Facts())
    engine.ran(trained)
    assert engine.ran(replace(trained, holders=False)) == [EndStep()]
    # Trained, but no holder: nothing to finish with yet.
    _requests_applied(engine, Facts())
    assert engine.ran(replace(trained, holders=False)) == [
        EndStep(),
    ]


def test_an_outcome_nobody_waits_for_is_a_bug() -> None:
    engine = Engine()
    with pytest.raises(InvalidEvent, match="Done while AtRest"):
        engine.on(Done(Facts()))
    engine.on(Boundary(Facts()))
    with pytest.raises(InvalidEvent, match="Boundary while Requesting"):
        _requests_applied(engine, Facts())
    engine.interrupted()  # the job ended inside a command: the next boundary is fresh
    assert engine.on(Boundary(Facts(terminal=True))) == [EndStep(stop=True)]


def test_each_state_takes_only_the_outcome_its_batch_yields() -> None:
    """An executor that answers a batch with another command's outcome (a regroup's for a
    segment, a segment's for the requests) is refused, not read as something else."""
    engine = Engine()
    engine.on(Boundary(Facts()))  # ApplyRequests
    with pytest.raises(InvalidEvent, match="SegmentDone while Requesting"):
        engine.on(SegmentDone(Facts(), all_ran=False))
    engine.interrupted()
    _requests_applied(engine, Facts(epoch_open=True))
    assert engine.ran(Facts(epoch_open=True)) == [
        TrainSegment(ahead=True, across=False)]
    with pytest.raises(InvalidEvent, match="Regrouped while Training"):
        engine.on(Regrouped(Facts(epoch_open=True), formed=True))
    # The segment's own outcome: a lost worker's segment (not all ran) re-plans nothing.
    assert engine.on(SegmentDone(Facts(epoch_open=True, check_due=True), all_ran=False)) == [
        PublishReady(), EndStep()]


@pytest.mark.parametrize(("command", "kind"), [
    (TrainSegment(), SegmentDone), (AbsorbAhead(), SegmentDone), (CommitInFlight(), SegmentDone),
    (Regroup(), Regrouped), (AdoptStarted(), WorkersStarted), (AwaitStarts(), WorkersStarted),
    (PollNodes(), WorkersPlaced), (SpawnWorkers(), WorkersPlaced), (TendSpares(), WorkersPlaced),
    (ApplyRequests(), RequestsTaken), (Settle(), EvaluationsIn), (JudgeEpoch(), EvaluationsIn),
    (NextEpoch(), Done), (Replan(), Done), (LoadCheckpoint(), Done), (GiveUpStarts(), Done),
    (PostPlanUpdate(), Done), (LoadData(), Done),
])
def test_a_command_is_answered_with_its_own_kind_of_outcome(command, kind) -> None:
    f = Facts(epoch_open=True)
    event = outcome(command, f, ok=False)
    assert type(event) is kind and event.facts is f
    if kind is SegmentDone:
        assert event.all_ran is False
    if kind is Regrouped:
        assert event.formed is False


def test_nothing_answers_the_end_of_a_step() -> None:
    with pytest.raises(ValueError, match="EndStep"):
        outcome(EndStep(), Facts())

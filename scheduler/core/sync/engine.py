"""The synchronous job's step loop as a pure engine: events in, commands out.

The driver (``dynabatch.scheduler.sync.coordinator``) does not decide what a step boundary
does; it feeds :class:`SyncEngine` events and carries out the :class:`Command` s it gets
back, on whatever runtime it drives (Ray, or the simulator: the unit tests' too), with no
per-runtime branch. Each event carries :class:`Facts`, what the driver's machines say at
that moment (read after the previous command ran: a cancel can arrive, an epoch can end,
the job can finish inside any command), so the engine never reads the driver's state. The
events are the boundary (the loop's tick) and what the last batch's last command did: a
segment done (``all_ran``: no worker lost or failed in it), a regroup (``formed``), workers
started, workers placed, requests taken, evaluations in, or done; a request (scale, drain,
assign, cancel) and a worker lost between events show in the facts of the next one.

Workers taken out of the job inside a command (lost, evicted, drained, started unwanted
or too late: ``Facts.stopping``) are killed first thing in the next batch, whatever it is.

One boundary, as the engine decides it:

* the job is terminal: nothing (the loop stops);
* a cancellation is pending: cancel (below);
* otherwise: load the data if it is not loaded; then, with a segment in flight, only
  take in the assignments queued first (so that their new workers start now, while the
  group trains on), take in workers that came up and *place* when due (at once after an
  assignment): list the nodes, start the workers the membership misses on them, tend the
  spares (other membership changes wait for the next boundary with nothing in flight);
  else *reconcile* the group: apply the requests (the
  workers they drain leave once the evaluations in flight are in: a drained worker may owe
  a shard), take in started workers, place when due (at once when the group changed, and
  at the first start, which starts no spares and then waits for its workers: half a
  second at a time, starting those that failed again, giving up those not up in the
  start timeout), then wait when fewer than the minimum are in (``Waiting``, since
  when it began: a boundary that waits again goes on with it; the step ends), or regroup
  when the group changed (``Regrouping``; one that fails ends the
  step, the next boundary tries again; one formed mid-epoch has the rest of the epoch
  re-split over it), loading the last checkpoint first, once the evaluations in flight
  are in, when no member holds the committed state (``RollingBack``; without one the job
  fails); a job that was PENDING is RUNNING once its group is ready;
* a cancellation that came while the group formed: cancel;
* train: begin the epoch if none is open (and plan it), run a segment (sending the next
  ahead when the next boundary need not have the group at rest), then end the epoch when
  it is complete, or re-plan when the rebalance rule's check is due after a segment that
  all ran; a re-plan (the epoch's, or a check's) that changed the batches from a step
  inside the segment in flight is posted to that segment's workers at once (a plan
  update; refused, it takes effect after the segment); after a failed segment, absorb the
  one sent ahead of it (what it trained past the failure is committed), in the next epoch
  when the failed one completed this; publish the evaluations that are in;
* an epoch's end: verify and record it, and have the holders evaluate it
  (unless that evaluation was sent ahead of the end); when its checkpoint is due or the
  epoch is judged (early stopping, keep_best), await its evaluation first; a judged epoch's
  judgement decides the checkpoints (the best so far; early stopping's, when the job keeps
  them); then the next epoch begins where they were written;
* once every epoch is trained and a member holds the final state: ``Finishing``, the last
  evaluations awaited, then the model handed out and the job SUCCEEDED. A cancel that
  comes meanwhile wins at the next boundary; a holder lost meanwhile makes the next
  boundary regroup (rolling back) and train on.

A cancellation commits the segment in flight (in its epoch, begun first when it was sent
across the epoch's end; ending the epoch it completed; when that was the last, the job
finishes SUCCEEDED instead), awaits the evaluations, writes the checkpoint, hands out the
model when anything was trained, and ends the job CANCELLED.

What each command does inside (a regroup, a segment's commit, an epoch's record) is the
driver's parts' and the other pure machines' (protocol, membership, ledger, boundary).
The engine's state is where the loop stands, its one vocabulary
(:data:`~dynabatch.scheduler.core.sync.states.LoopState`): between boundaries
``AtRest`` or ``Waiting`` for workers; inside one, each state says which command's outcome
it waits for and carries what that outcome is judged by.
"""

from __future__ import annotations

from dataclasses import asdict

from dynabatch.scheduler.core.sync.boundary import must_roll_back
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
    WaitForMinimum,
    WorkersPlaced,
    WorkersStarted,
)
from dynabatch.scheduler.core.sync.pipeline import can_cross_epoch, can_send_ahead
from dynabatch.scheduler.core.sync.states import (
    Absorbing,
    AtRest,
    AwaitingStarts,
    CancelCommitting,
    CancelEndingEpoch,
    CancelSettling,
    Checking,
    Ending,
    EndingToAbsorb,
    Finishing,
    Gathering,
    GivingUp,
    Judging,
    LoopState,
    Opening,
    Placing,
    Posting,
    Regrouping,
    Requesting,
    Resplitting,
    RollingBack,
    Training,
    Waiting,
    Watching,
)


class InvalidEvent(RuntimeError):
    """An event the engine cannot take in its state: a bug in the executor."""


class SyncEngine:
    """The step loop's decisions. :meth:`on` takes an event and returns the commands to
    carry out in order. A batch that does not end with :class:`EndStep` is answered with
    the event its last command yields (:func:`~dynabatch.scheduler.core.sync.messages.
    outcome`: :class:`SegmentDone` after a segment, :class:`Regrouped` after a regroup,
    :class:`WorkersStarted`, :class:`WorkersPlaced`, :class:`RequestsTaken`,
    :class:`EvaluationsIn`, or :class:`Done`), with the facts after it. Each state takes
    only the kinds its batch can yield: any other is an :class:`InvalidEvent`."""

    def __init__(self) -> None:
        self.state: LoopState = AtRest()

    def on(self, event: Event) -> list[Command]:
        commands = self._decide(event)
        # Workers taken out of the job inside the last batch (lost, evicted, drained,
        # started unwanted) are stopped before anything else: what a hung worker queued
        # then fails at once rather than after another grace period, and its node's
        # resources are free before workers are spawned or the group formed again.
        return [KillLeaving(), *commands] if event.facts.stopping else commands

    def _decide(self, event: Event) -> list[Command]:
        match self.state, event:
            case AtRest() | Waiting(), Boundary(f):
                return self._boundary(f)
            case Watching(), WorkersStarted(f) | WorkersPlaced(f):
                return self._formed(f)
            case Requesting(waiting), RequestsTaken(f):
                if f.terminal:
                    return self._rest(EndStep())
                self.state = Gathering(waiting)
                # A drained worker may still owe its shard of an evaluation: settle first.
                drain = [Settle(), ApplyDrains()] if f.drains_due else []
                return [*drain, AdoptStarted()]
            case Gathering(waiting), WorkersStarted(f):
                if f.terminal:
                    return self._rest(EndStep())
                # Nodes are listed when due, and at once when the group changed or the job
                # starts (its first workers).
                if f.starting:  # its workers are started, then awaited
                    self.state = AwaitingStarts(adopted=False, first=True, waiting=waiting)
                    return self._place(starting=True)
                if f.node_poll_due or f.regroup_due:
                    self.state = Placing(waiting)
                    return self._place(starting=False)
                return self._gathered(f, waiting)
            case AwaitingStarts(adopted, first, waiting), WorkersStarted(f) | WorkersPlaced(f):
                return self._await_starts(f, adopted, first, waiting)
            case Placing(waiting), WorkersPlaced(f):
                return self._gathered(f, waiting)
            case GivingUp(waiting), Done(f):
                return self._gathered(f, waiting)
            case RollingBack(), Done():
                # The checkpoint's weights wait in the driver: the regroup loads them.
                self.state = Regrouping()
                return [Regroup()]
            case Regrouping(), Regrouped(f, formed):
                if not formed:
                    return self._rest(EndStep())  # the next boundary tries again
                if f.epoch_open and not f.epoch_complete:
                    # Formed mid-epoch: the rest of the epoch is split over the new group
                    # (an epoch that has not begun is planned when it begins).
                    self.state = Resplitting()
                    return [Replan("membership")]
                return self._formed(f)
            case Resplitting(), Done(f):
                return self._formed(f)
            case Opening(), Done(f):
                return self._replanned(f, opening=True)
            case Training(), SegmentDone(f, all_ran):
                if not all_ran and f.in_flight:
                    # The segment failed with the next one sent: what that one trained past
                    # the failure is committed, in the next epoch when it completed this one.
                    if f.epoch_complete:
                        return self._end_epoch(f, EndingToAbsorb())
                    self.state = Absorbing()
                    return [AbsorbAhead()]
                if f.epoch_complete:
                    return self._end_epoch(f, Ending())
                if all_ran and f.check_due:
                    self.state = Checking()
                    return [Replan("check")]
                return self._rest(PublishReady(), EndStep())
            case EndingToAbsorb(), Done(f):
                if f.terminal:
                    return self._rest(EndStep())
                self.state = Absorbing()
                return [BeginEpoch(), AbsorbAhead()]
            case Absorbing(), SegmentDone(f):
                if f.epoch_complete:  # what it trained completed the epoch
                    return self._end_epoch(f, Ending())
                return self._rest(PublishReady(), EndStep())
            case Judging(then, due, keeps), EvaluationsIn(f, verdict):
                if f.terminal:  # the job ended while the evaluation was awaited
                    # A cancel's epoch end stops the loop, as every cancel does.
                    return self._rest(EndStep(stop=isinstance(then, CancelEndingEpoch)))
                best = [Checkpoint("best", verdict.best)] if verdict.best else []
                if due:
                    save = [Checkpoint("epoch")]
                else:
                    save = [Checkpoint("early stopping")] if verdict.stop and keeps else []
                self.state = then
                return [*best, *save, NextEpoch(verdict.stop)]
            case Checking(), Done(f):
                return self._replanned(f, opening=False)
            case Posting(opening), Done(f):
                return self._segment(f) if opening else self._rest(PublishReady(), EndStep())
            case Ending(), Done(f):
                if f.terminal:
                    return self._rest(EndStep())
                # The epoch ended: the job finishes, or returns to training.
                back = [PublishReady(), EndStep()]
                return self._finishing(f, cancelling=False) or self._rest(*back)
            case Finishing(cancelling), EvaluationsIn(f):
                if f.cancel_requested and not cancelling:
                    return self._rest(EndStep())  # the next boundary cancels the job
                if f.holders:
                    return self._rest(SaveModel("end"), FinishSucceeded(), EndStep(stop=cancelling))
                # The last holder was lost in the final evaluations: the next boundary
                # regroups (rolling back) and trains on; a cancellation goes on cancelling.
                return self._settle(f) if cancelling else self._rest(EndStep())
            case CancelCommitting(), SegmentDone(f):
                if f.epoch_complete and f.epoch_open:
                    return self._end_epoch(f, CancelEndingEpoch())
                return self._settle(f)
            case CancelEndingEpoch(), Done(f):
                if f.terminal:
                    return self._rest(EndStep(stop=True))
                return self._finishing(f, cancelling=True) or self._settle(f)
            case CancelSettling(), EvaluationsIn(f):
                save = [SaveModel("cancel")] if f.trained_any else []
                return self._rest(
                    Checkpoint("cancel"), *save, FinishCancelled(), EndStep(stop=True)
                )
        raise InvalidEvent(f"{type(event).__name__} while {type(self.state).__name__}")

    def interrupted(self) -> None:
        """The boundary was cut short: the job ended inside a command (the failure
        policy's ``Fail``, or a bug). The next boundary starts afresh (and finds the job
        terminal)."""
        self.state = AtRest()

    # ------------------------------------------------------------------ the steps
    def _boundary(self, f: Facts) -> list[Command]:
        if f.terminal:
            return self._rest(EndStep(stop=True))
        if f.cancel_requested:
            return self._cancel(f)
        load = [] if f.data_loaded else [LoadData()]
        if f.in_flight:  # membership changes wait for the next boundary
            self.state = Watching()
            # An assignment's workers start now, while the segment in flight trains: they
            # join at a boundary once up.
            take = [ApplyRequests(assignments=True)] if f.assignment_queued else []
            poll = self._place(starting=False) if f.node_poll_due or take else []
            return [*load, *take, AdoptStarted(), *poll]
        # A wait for workers goes on through this boundary's reconcile (or ends with it).
        self.state = Requesting(self.state if isinstance(self.state, Waiting) else None)
        return [*load, ApplyRequests()]

    @staticmethod
    def _place(starting: bool) -> list[Command]:
        """List the nodes, start the workers the membership misses on them, then tend the
        spares (not at the first start: they would compete with its workers' start-up)."""
        spares = [] if starting else [TendSpares()]
        return [PollNodes(starting=starting), SpawnWorkers(starting=starting), *spares]

    def _await_starts(self, f: Facts, adopted: bool, first: bool, waiting: Waiting | None
                      ) -> list[Command]:
        """The first start waits for its workers a little at a time, taking in those that
        came up; once none is left starting, it starts the ones that failed again (on the
        nodes listed again). Those still starting when the start timeout is over, or when a
        cancel comes, are given up; then who trains is known."""
        if f.terminal:
            return self._rest(EndStep())
        if f.starts_pending:
            if f.cancel_requested or (f.start_overdue and not first):
                self.state = GivingUp(waiting)
                return [GiveUpStarts()]
            self.state = AwaitingStarts(adopted=True, first=False, waiting=waiting)
            return [AwaitStarts(first=first)]
        if adopted:  # none left starting: replace those that failed to start
            self.state = AwaitingStarts(adopted=False, first=False, waiting=waiting)
            return self._place(starting=True)
        return self._gathered(f, waiting)

    def _gathered(self, f: Facts, waiting: Waiting | None) -> list[Command]:
        """Who trains is known: too few (wait: since ``waiting`` began, or from now), a
        changed group (regroup), or ready. Too few with a cancellation pending (it came
        during the first start's wait, say) cancels: the wait would only delay it, or fail
        the job first."""
        if f.terminal:
            return self._rest(EndStep())
        if f.shortfall is not None and f.cancel_requested:
            return self._cancel(f)
        if f.shortfall is not None:
            since = waiting.since if waiting else None
            self.state = Waiting(f.now if since is None else since, f.shortfall)
            return [WaitForMinimum(f.shortfall, since), EndStep()]
        if f.regroup_due:
            if must_roll_back(needs_state=f.needs_state, holding_restored=f.holding_restored):
                self.state = RollingBack()
                # The records of epochs before the checkpoint first: its history
                # replaces them all.
                return [Settle(), LoadCheckpoint()]
            self.state = Regrouping()
            return [Regroup()]
        return self._formed(f)

    def _formed(self, f: Facts) -> list[Command]:
        """The group is ready: mark the job running, then cancel or train."""
        if f.terminal:
            return self._rest(EndStep())
        running = [MarkRunning()] if f.pending and not f.in_flight else []
        if f.cancel_requested:  # it came while the group formed: train no further
            return [*running, *self._cancel(f)]
        return [*running, *self._train(f)]

    def _train(self, f: Facts) -> list[Command]:
        if f.trained:
            return self._finishing(f, False) or self._rest(EndStep())
        if not f.epoch_open:
            self.state = Opening()
            return [BeginEpoch(), Replan()]
        return self._segment(f)

    def _replanned(self, f: Facts, opening: bool) -> list[Command]:
        """A re-plan that changed the batches inside the segment in flight is posted to
        its workers before anything else (the protocol already plans from its step); then
        the epoch's segment (``opening``), or the boundary's end."""
        if f.update_offered:
            self.state = Posting(opening)
            return [PostPlanUpdate()]
        return self._segment(f) if opening else self._rest(PublishReady(), EndStep())

    def _segment(self, f: Facts) -> list[Command]:
        """Whether the segment after this one goes ahead is decided here: not when the next
        boundary needs the group at rest or the stamps wait on this segment's losses, and
        across the epoch's end only when nothing between the epochs reads the state."""
        ahead = can_send_ahead(
            cancel_requested=f.cancel_requested,
            retrying=f.retrying,
            requests_pending=f.requests_pending,
            regroup_due=f.regroup_due,
            stamps_fixed=f.stamps_fixed,
        )
        c = f.crossing
        across = ahead and c is not None and can_cross_epoch(**asdict(c))
        self.state = Training()
        return [TrainSegment(ahead=ahead, across=across)]

    def _end_epoch(self, f: Facts, then: Ending | EndingToAbsorb | CancelEndingEpoch
                   ) -> list[Command]:
        """The protocol's epoch is complete: end it, then (``then``) finish or go back to
        what its end interrupted. A checkpoint due, or an epoch judged by its evaluation,
        waits for that evaluation first (the checkpoint holds the epoch's record, scores
        included); a judged epoch's checkpoints follow from its judgement. Then the next
        epoch: the checkpoints are written as its start."""
        end = [EndEpoch(), Evaluate()]
        if f.judges_epochs:
            self.state = Judging(then, due=f.checkpoint_due, keeps=f.keeps_checkpoints)
            return [*end, Settle(), JudgeEpoch()]
        self.state = then
        due = [Settle(), Checkpoint("epoch")] if f.checkpoint_due else []
        return [*end, *due, NextEpoch()]

    def _finishing(self, f: Facts, cancelling: bool) -> list[Command]:
        """Every epoch is trained and a member holds the final state: await the last
        evaluations before success (empty: not yet)."""
        if not (f.trained and f.holders):
            return []
        self.state = Finishing(cancelling)
        return [Settle()]

    def _cancel(self, f: Facts) -> list[Command]:
        if f.in_flight:
            # Sent across the epoch's end, which has ended: it is committed in its epoch.
            begin = [] if f.epoch_open else [BeginEpoch()]
            self.state = CancelCommitting()
            return [*begin, CommitInFlight()]
        self.state = CancelSettling()
        return [Settle()]

    def _settle(self, f: Facts) -> list[Command]:
        if f.terminal:  # the committed segment completed the last epoch: it succeeded
            return self._rest(EndStep(stop=True))
        self.state = CancelSettling()
        return [Settle()]

    def _rest(self, *commands: Command) -> list[Command]:
        self.state = AtRest()
        return list(commands)

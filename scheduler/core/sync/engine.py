"""The synchronous job's step loop as a pure engine: events in, commands out.

The driver (``dynabatch.scheduler.sync.coordinator``) does not decide what a step boundary
does; it feeds :class:`SyncEngine` events and carries out the :class:`Command` s it gets
back, on whatever runtime it drives (Ray, the simulator, the tests' fakes), with no
per-runtime branch. Each event carries :class:`Facts`, what the driver's machines say at
that moment (read after the previous command ran: a cancel can arrive, an epoch can end,
the job can finish inside any command), so the engine never reads the driver's state.

One boundary, as the engine decides it:

* the job is terminal: nothing (the loop stops);
* a cancellation is pending: cancel (below);
* otherwise: load the data if it is not loaded; then, with a segment in flight, only
  take in workers that came up and list the nodes when due (membership changes wait for
  the next boundary with nothing in flight); else *reconcile* the group: apply the
  requests, take in started workers, list the nodes when due (at once when the group
  changed, and at the first start, which then waits for its workers), then wait when
  fewer than the minimum are in (WAITING_FOR_WORKERS; the step ends), or regroup when the
  group changed (REGROUPING; one that fails ends the step, the next boundary tries
  again); a job that was PENDING is RUNNING once its group is ready;
* a cancellation that came while the group formed: cancel;
* train: begin the epoch if none is open (and plan it), run a segment (sending the next
  ahead when the next boundary need not have the group at rest), then end the epoch when
  it is complete, or re-plan when the rebalance rule's check is due after a segment that
  all ran; publish the evaluations that are in;
* once every epoch is trained and a member holds the final state: FINISHING, the last
  evaluations awaited, then the model handed out and the job SUCCEEDED. A cancel that
  comes meanwhile wins at the next boundary; a holder lost meanwhile makes the next
  boundary regroup (rolling back) and train on.

A cancellation commits the segment in flight (ending the epoch it completed; when that was
the last, the job finishes SUCCEEDED instead), awaits the evaluations, writes the
checkpoint, hands out the model when anything was trained, and ends the job CANCELLED.

What each command does inside (a regroup, a segment's commit, an epoch's record) is the
driver's parts' and the other pure machines' (protocol, membership, ledger, boundary).
The engine's state is where the boundary stands (:data:`LoopState`): each state says which
command's outcome it waits for and carries what that outcome is judged by.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dynabatch.scheduler.core.sync.phase import Phase
from dynabatch.scheduler.core.sync.pipeline import can_cross_epoch, can_send_ahead

# --- facts and events -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Crossing:
    """What decides whether the next epoch's first segment may be sent before this epoch
    ends (:func:`~dynabatch.scheduler.core.sync.pipeline.can_cross_epoch`)."""

    next_epoch: int
    epochs: int
    goodput: bool  # the regime decides the next batch from the epoch's end
    next_batch: int
    batch: int
    checkpoint_due: bool  # or the epoch is judged (early stopping, keep_best)
    replans_at_end: bool  # rebalance: epoch under a speed-driven policy


@dataclass(frozen=True, slots=True)
class Facts:
    """What the driver's machines say now."""

    terminal: bool = False  # the job ended (its JobState is terminal)
    cancel_requested: bool = False
    data_loaded: bool = True
    in_flight: bool = False  # a segment sent ahead has not been collected
    trained: bool = False  # every epoch is trained, or early stopping ended the training
    epoch_open: bool = False  # the epoch has begun (its totals are open) and not ended
    epoch_complete: bool = False  # every step of the protocol's epoch is committed
    check_due: bool = False  # the rebalance rule's check is due at this step
    trained_any: bool = False  # an epoch was recorded, or a step of this one trained
    # What decides whether a segment may be sent ahead of the one before it:
    retrying: bool = False  # the next segment retries a failure (it runs alone)
    requests_pending: bool = False  # scale, drain or assign requests, or a hand-over
    regroup_due: bool = False  # a worker joined or was lost: the next boundary regroups
    stamps_fixed: bool = True  # the next segment's stamps do not wait on this one's losses
    crossing: Crossing | None = None  # None before the data is loaded
    # Who trains:
    pending: bool = False  # the job's state is PENDING (it has not trained, or waits)
    starting: bool = False  # no member yet, no group formed: the job's first start
    node_poll_due: bool = False  # nodes were last listed long enough ago to list again
    shortfall: str | None = None  # fewer workers than the job's minimum: which, and why
    holders: bool = True  # a member holds the committed state


@dataclass(frozen=True, slots=True)
class Boundary:
    """A step boundary: the loop's turn."""

    facts: Facts


@dataclass(frozen=True, slots=True)
class Ran:
    """The last batch of commands was carried out; ``ok``: its last command succeeded (a
    regroup formed, a segment all ran; other commands: True)."""

    facts: Facts
    ok: bool = True


Event = Boundary | Ran

# --- commands ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Become:
    """Move the loop's phase (reported; its moves are enforced by ``Phase``)."""

    phase: Phase


@dataclass(frozen=True, slots=True)
class LoadData:
    """Load the dataset and build the protocol at the job's position."""


@dataclass(frozen=True, slots=True)
class ApplyRequests:
    """Apply the scale, drain and assign requests queued since the last boundary (drained
    workers leave now)."""


@dataclass(frozen=True, slots=True)
class AdoptStarted:
    """Take in the workers whose start finished (they join at the next regroup)."""


@dataclass(frozen=True, slots=True)
class PollNodes:
    """List the nodes: start workers where members are missing, tend the spares."""

    starting: bool = False


@dataclass(frozen=True, slots=True)
class AwaitInitial:
    """The first start: wait (up to the start timeout) for the workers to come up."""


@dataclass(frozen=True, slots=True)
class WaitForMinimum:
    """Too few workers: say why, fail once the wait is over its limit, else wait a little
    (the step ends: the next boundary looks again)."""

    shortfall: str


@dataclass(frozen=True, slots=True)
class Regroup:
    """Form the next generation (loading the checkpoint first when no member holds the
    committed state). Answered with ``Ran.ok``: it formed."""


@dataclass(frozen=True, slots=True)
class MarkRunning:
    """The job trains: PENDING becomes RUNNING."""


@dataclass(frozen=True, slots=True)
class FinishSucceeded:
    """End the job SUCCEEDED (with early stopping's reason, when it stopped the training)."""


@dataclass(frozen=True, slots=True)
class BeginEpoch:
    """Open the epoch (its global batch, totals, ledger)."""


@dataclass(frozen=True, slots=True)
class Replan:
    """Re-plan the rest of the epoch, from the step after the segment in flight if any:
    at the epoch's start, or when the rebalance rule's check is due (``check``)."""

    check: bool = False


@dataclass(frozen=True, slots=True)
class TrainSegment:
    """Run the next segment and commit what its state holders completed; answered with
    ``Ran.ok``: it all ran. ``ahead``: send the segment after it before its results are
    read; ``across``: that may be the next epoch's first (behind this epoch's
    evaluation)."""

    ahead: bool = False
    across: bool = False


@dataclass(frozen=True, slots=True)
class EndEpoch:
    """Verify, record and checkpoint the epoch; queue its evaluation (ENDING_EPOCH: the
    engine then moves the loop on, to FINISHING or back to what the epoch's end
    interrupted)."""


@dataclass(frozen=True, slots=True)
class PublishReady:
    """Publish the epochs whose evaluation is in."""


@dataclass(frozen=True, slots=True)
class CommitInFlight:
    """Collect the segment in flight and commit it (a cancellation keeps what it trained)."""


@dataclass(frozen=True, slots=True)
class Settle:
    """Await the evaluations in flight and publish them."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Write the job's checkpoint (when it keeps them)."""

    reason: str


@dataclass(frozen=True, slots=True)
class SaveModel:
    """Hand out the trained model's files."""

    reason: str


@dataclass(frozen=True, slots=True)
class FinishCancelled:
    """End the job CANCELLED, with the cancellation's reason."""


@dataclass(frozen=True, slots=True)
class EndStep:
    """The boundary is over. ``stop``: the loop ends whatever the job's state; otherwise it
    goes on unless the job is terminal."""

    stop: bool = False


Command = (
    Become
    | LoadData
    | ApplyRequests
    | AdoptStarted
    | PollNodes
    | AwaitInitial
    | WaitForMinimum
    | Regroup
    | MarkRunning
    | FinishSucceeded
    | BeginEpoch
    | Replan
    | TrainSegment
    | EndEpoch
    | PublishReady
    | CommitInFlight
    | Settle
    | Checkpoint
    | SaveModel
    | FinishCancelled
    | EndStep
)

# --- where the boundary stands ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AtRest:
    """Between boundaries."""


@dataclass(frozen=True, slots=True)
class Watching:
    """A segment is in flight: waiting for started workers to be noticed and nodes
    listed (membership changes wait for the next boundary with nothing in flight)."""


@dataclass(frozen=True, slots=True)
class Gathering:
    """Nothing in flight: waiting for the requests to be applied and started workers taken
    in (then nodes are listed when due)."""


@dataclass(frozen=True, slots=True)
class Placing:
    """Waiting for workers to be started on the nodes listed (and, at the first start, to
    come up)."""


@dataclass(frozen=True, slots=True)
class Regrouping:
    """Waiting for the next generation to form (its ``ok`` decides)."""


@dataclass(frozen=True, slots=True)
class Opening:
    """Waiting for the epoch to open and be planned (the segment is sent from what that
    leaves: its global batch decides whether the next epoch's first may go ahead)."""


@dataclass(frozen=True, slots=True)
class Training:
    """Waiting for the segment (its ``ok`` and the epoch's completion decide what
    follows)."""


@dataclass(frozen=True, slots=True)
class Ending:
    """Waiting for the epoch a segment completed to end (the job may be trained now)."""


@dataclass(frozen=True, slots=True)
class Finishing:
    """Every epoch is trained: waiting for the last evaluations. ``cancelling``: a
    cancellation's last segment completed the last epoch, so the job succeeds."""

    cancelling: bool


@dataclass(frozen=True, slots=True)
class CancelCommitting:
    """Cancelling: waiting for the segment in flight to be committed."""


@dataclass(frozen=True, slots=True)
class CancelEndingEpoch:
    """Cancelling: the committed segment completed the epoch, which is ending (the job may
    have succeeded in it)."""


@dataclass(frozen=True, slots=True)
class CancelSettling:
    """Cancelling: waiting for the evaluations (they decide whether anything was trained
    that the model would hold)."""


LoopState = (
    AtRest
    | Watching
    | Gathering
    | Placing
    | Regrouping
    | Opening
    | Training
    | Ending
    | Finishing
    | CancelCommitting
    | CancelEndingEpoch
    | CancelSettling
)


class InvalidEvent(RuntimeError):
    """An event the engine cannot take in its state: a bug in the executor."""


class SyncEngine:
    """The step loop's decisions. :meth:`on` takes an event and returns the commands to
    carry out in order. A batch that does not end with :class:`EndStep` is answered with
    :class:`Ran`: the facts after its last command, and that command's ``ok`` (a
    :class:`Regroup` that formed, a :class:`TrainSegment` that all ran)."""

    def __init__(self) -> None:
        self.state: LoopState = AtRest()

    def on(self, event: Event) -> list[Command]:
        match self.state, event:
            case AtRest(), Boundary(f):
                return self._boundary(f)
            case Watching(), Ran(f):
                return self._formed(f)
            case Gathering(), Ran(f):
                # Nodes are listed when due, and at once when the group changed or the job
                # starts (its first workers).
                if f.starting or f.node_poll_due or f.regroup_due:
                    self.state = Placing()
                    wait = [AwaitInitial()] if f.starting else []
                    return [PollNodes(starting=f.starting), *wait]
                return self._gathered(f)
            case Placing(), Ran(f):
                return self._gathered(f)
            case Regrouping(), Ran(f, ok):
                if not ok:
                    return self._rest(EndStep())  # the next boundary tries again
                return self._formed(f)
            case Opening(), Ran(f):
                return self._segment(f)
            case Training(), Ran(f, ok):
                if f.epoch_complete:
                    self.state = Ending()
                    return [EndEpoch()]
                check = [Replan(check=True)] if ok and f.check_due else []
                return self._rest(*check, PublishReady(), EndStep())
            case Ending(), Ran(f):
                if f.terminal:
                    return self._rest(EndStep())
                # The epoch ended: the job finishes, or returns to training.
                back = [Become(Phase.TRAINING), PublishReady(), EndStep()]
                return self._finishing(f, cancelling=False) or self._rest(*back)
            case Finishing(cancelling), Ran(f):
                if f.cancel_requested and not cancelling:
                    return self._rest(EndStep())  # the next boundary cancels the job
                if f.holders:
                    return self._rest(SaveModel("end"), FinishSucceeded(), EndStep(stop=cancelling))
                # The last holder was lost in the final evaluations: the next boundary
                # regroups (rolling back) and trains on; a cancellation goes on cancelling.
                return self._settle(f) if cancelling else self._rest(EndStep())
            case CancelCommitting(), Ran(f):
                if f.epoch_complete and f.epoch_open:
                    self.state = CancelEndingEpoch()
                    return [EndEpoch()]
                return self._settle(f)
            case CancelEndingEpoch(), Ran(f):
                if f.terminal:
                    return self._rest(EndStep(stop=True))
                back = [Become(Phase.CANCELLING)]
                return self._finishing(f, cancelling=True) or [*back, *self._settle(f)]
            case CancelSettling(), Ran(f):
                save = [SaveModel("cancel")] if f.trained_any else []
                return self._rest(
                    Checkpoint("cancel"), *save, FinishCancelled(), EndStep(stop=True)
                )
        raise InvalidEvent(f"{type(event).__name__} while {type(self.state).__name__}")

    def interrupted(self) -> None:
        """The boundary was cut short: the job ended inside a command (a failure unwinds
        the step). The next boundary starts afresh (and finds the job terminal)."""
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
            poll = [PollNodes()] if f.node_poll_due else []
            return [*load, AdoptStarted(), *poll]
        self.state = Gathering()
        return [*load, ApplyRequests(), AdoptStarted()]

    def _gathered(self, f: Facts) -> list[Command]:
        """Who trains is known: too few (wait), a changed group (regroup), or ready."""
        if f.terminal:
            return self._rest(EndStep())
        if f.shortfall is not None:
            return self._rest(
                Become(Phase.WAITING_FOR_WORKERS), WaitForMinimum(f.shortfall), EndStep()
            )
        if f.regroup_due:
            self.state = Regrouping()
            return [Become(Phase.REGROUPING), Regroup()]
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
            return [Become(Phase.TRAINING), *(self._finishing(f, False) or self._rest(EndStep()))]
        if not f.epoch_open:
            self.state = Opening()
            return [Become(Phase.TRAINING), BeginEpoch(), Replan()]
        return [Become(Phase.TRAINING), *self._segment(f)]

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

    def _finishing(self, f: Facts, cancelling: bool) -> list[Command]:
        """Every epoch is trained and a member holds the final state: await the last
        evaluations before success (empty: not yet)."""
        if not (f.trained and f.holders):
            return []
        self.state = Finishing(cancelling)
        return [Become(Phase.FINISHING), Settle()]

    def _cancel(self, f: Facts) -> list[Command]:
        if f.in_flight:
            self.state = CancelCommitting()
            return [Become(Phase.CANCELLING), CommitInFlight()]
        self.state = CancelSettling()
        return [Become(Phase.CANCELLING), Settle()]

    def _settle(self, f: Facts) -> list[Command]:
        if f.terminal:  # the committed segment completed the last epoch: it succeeded
            return self._rest(EndStep(stop=True))
        self.state = CancelSettling()
        return [Settle()]

    def _rest(self, *commands: Command) -> list[Command]:
        self.state = AtRest()
        return list(commands)

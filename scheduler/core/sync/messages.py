"""What passes between the step loop's engine and its executor.

:class:`Facts` (what the driver's machines say, read after each batch of commands) ride on
every event: :class:`Boundary` (a step boundary: the loop's turn), and the outcome of the
last batch of commands, typed by what its last command did (:func:`outcome`: a segment
done, a group regrouped, workers started or placed, requests taken, evaluations in, or just
done); the engine answers with :data:`Command` s, which the driver
(``dynabatch.scheduler.sync.coordinator``) carries out on its parts. The decisions are the
engine's (``dynabatch.scheduler.core.sync.engine``); these are frozen values with no
behaviour, so any executor (Ray's driver, the simulator's, a test) speaks them alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dynabatch.scheduler.core.lifecycle import MarkRunning

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
    # The first queued request is an assignment: its workers start at the next boundary,
    # also with a segment in flight (they start up while the group trains on).
    assignment_queued: bool = False
    regroup_due: bool = False  # a worker joined or was lost: the next boundary regroups
    drains_due: bool = False  # workers asked to leave, or that an assignment moves now
    stamps_fixed: bool = True  # the next segment's stamps do not wait on this one's losses
    crossing: Crossing | None = None  # None before the data is loaded
    # Who trains:
    pending: bool = False  # the job's state is PENDING (it has not trained, or waits)
    starting: bool = False  # no member yet, no group formed: the job's first start
    starts_pending: bool = False  # workers were started and have not come up yet
    start_overdue: bool = False  # the first start's wait is past the start timeout
    node_poll_due: bool = False  # nodes were last listed long enough ago to list again
    shortfall: str | None = None  # fewer workers than the job's minimum: which, and why
    holders: bool = True  # a member holds the committed state
    # The next regroup has no member holding the committed state to broadcast from, and no
    # weights restored from a checkpoint are waiting to be loaded.
    needs_state: bool = False
    holding_restored: bool = False
    # A re-plan changed the batches from a step inside the segment in flight: its workers
    # have not been sent it yet.
    update_offered: bool = False
    # At the end of the protocol's epoch (read before it ends): the job's checkpoint is due
    # at the next epoch's start; each epoch is judged by its evaluation (early_stopping,
    # checkpoint.keep_best); the job keeps checkpoints at all.
    checkpoint_due: bool = False
    judges_epochs: bool = False
    keeps_checkpoints: bool = False
    # Workers taken out of the job (lost, evicted, drained, started unwanted or too late)
    # whose processes have not been stopped yet.
    stopping: bool = False
    now: float = 0.0  # the driver's clock (a wait for workers is timed from it)


@dataclass(frozen=True, slots=True)
class Boundary:
    """The loop's turn (its tick): a step boundary begins."""

    facts: Facts


# What the last command of a batch did. A batch of commands that does not end with
# EndStep is answered with one of these (``outcome``): the kind its last command yields,
# with the facts after it. Each engine state takes only the kinds its batch can yield.


@dataclass(frozen=True, slots=True)
class Done:
    """A command with nothing to report beyond the facts after it: the data loaded, a
    re-plan made or posted, the checkpoint rolled back to, an epoch ended, the workers that
    did not start given up."""

    facts: Facts


@dataclass(frozen=True, slots=True)
class RequestsTaken:
    """The scale, drain and assign requests queued since the last boundary were taken into
    the membership (``Facts.drains_due``: workers they drain leave next)."""

    facts: Facts


@dataclass(frozen=True, slots=True)
class WorkersStarted:
    """The workers whose start finished were taken in (``Facts.starts_pending``: others are
    still starting; ``Facts.regroup_due``: one joins at the next regroup)."""

    facts: Facts


@dataclass(frozen=True, slots=True)
class WorkersPlaced:
    """The nodes were listed and workers started where the membership misses members (and
    the spares tended): their start is under way."""

    facts: Facts


@dataclass(frozen=True, slots=True)
class Regrouped:
    """The next generation was asked to form. ``formed``: it did; not formed (a worker was
    lost or failed while it formed), the next boundary tries again."""

    facts: Facts
    formed: bool


@dataclass(frozen=True, slots=True)
class SegmentDone:
    """A segment was collected and what its state holders completed committed (the one
    just run, the one sent ahead of a failed one, or the one in flight at a cancel).
    ``all_ran``: every worker ran its part; not so, a worker was lost or failed in it, and
    the facts say what that left (``regroup_due``, ``stopping``, ``in_flight``)."""

    facts: Facts
    all_ran: bool = True


@dataclass(frozen=True, slots=True)
class Verdict:
    """What judging the epoch that ended by its evaluation said: ``best``, what it is the
    best by (keep_best's metric, mode, value and epoch), when it is the best so far;
    ``stop``, early stopping's reason to end the training after it."""

    best: dict[str, Any] | None = None
    stop: str | None = None


@dataclass(frozen=True, slots=True)
class EvaluationsIn:
    """The evaluations in flight were awaited and published (and, after ``JudgeEpoch``, the
    epoch that ended judged by its own: ``verdict``)."""

    facts: Facts
    verdict: Verdict = Verdict()


Outcome = (
    Done | RequestsTaken | WorkersStarted | WorkersPlaced | Regrouped | SegmentDone | EvaluationsIn
)
Event = Boundary | Outcome

# --- commands ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadData:
    """Load the dataset and build the protocol at the job's position."""


@dataclass(frozen=True, slots=True)
class ApplyRequests:
    """Take the scale, drain and assign requests queued since the last boundary into the
    membership (the workers they drain leave at :class:`ApplyDrains`). ``assignments``:
    only the assignments at the head of the queue (a boundary with a segment in flight:
    their new workers start now; the rest waits for a boundary at rest)."""

    assignments: bool = False


@dataclass(frozen=True, slots=True)
class ApplyDrains:
    """Remove the workers asked to leave, and those an assignment moves now (after a
    ``Settle``: a drained worker may still owe its shard of an evaluation)."""


@dataclass(frozen=True, slots=True)
class AdoptStarted:
    """Take in the workers whose start finished (they join at the next regroup)."""


@dataclass(frozen=True, slots=True)
class PollNodes:
    """List the nodes (the job's first start says when there are none), and note the
    spares lost before they were adopted."""

    starting: bool = False


@dataclass(frozen=True, slots=True)
class SpawnWorkers:
    """Start workers where the membership misses members, on the nodes last listed (which
    nodes: the membership's; at the first start a small cluster shares nodes). A spare's
    worker adopted with nothing in flight is awaited briefly, so it joins this regroup."""

    starting: bool = False


@dataclass(frozen=True, slots=True)
class TendSpares:
    """Start and stop spare workers per the membership's spare plan on the nodes last
    listed (once the first workers are up: spares would compete with their start)."""


@dataclass(frozen=True, slots=True)
class KillLeaving:
    """Stop the processes of the workers taken out of the job since the last stop."""


@dataclass(frozen=True, slots=True)
class AwaitStarts:
    """The first start: wait a little (half a second) for the workers starting to come up,
    and take in those that did. ``first``: the first start's wait begins now (its limit,
    the start timeout, counts from here)."""

    first: bool = False


@dataclass(frozen=True, slots=True)
class GiveUpStarts:
    """The workers still starting when the first start's wait ended (over the start
    timeout, or the job cancelled) are given up: out of the membership, queued to be
    killed."""


@dataclass(frozen=True, slots=True)
class WaitForMinimum:
    """Too few workers: say why, fail once the wait is over its limit, else wait a little
    (the step ends: the next boundary looks again). ``since``: when the wait began (None:
    it begins now)."""

    shortfall: str
    since: float | None = None


@dataclass(frozen=True, slots=True)
class Regroup:
    """Form the next generation (loading the checkpoint first when no member holds the
    committed state). Answered with :class:`Regrouped` (``formed``)."""


@dataclass(frozen=True, slots=True)
class LoadCheckpoint:
    """No member holds the committed state: load the last checkpoint (its weights wait for
    the regroup), or fail the job with the reason (the failure policy's ``RollBack`` or
    ``Fail``)."""


@dataclass(frozen=True, slots=True)
class FinishSucceeded:
    """End the job SUCCEEDED (with early stopping's reason, when it stopped the training)."""


@dataclass(frozen=True, slots=True)
class BeginEpoch:
    """Open the epoch (its global batch, totals, ledger)."""


@dataclass(frozen=True, slots=True)
class Replan:
    """Re-plan the rest of the epoch, from the step after the segment in flight if any.
    ``cause``: the epoch's start (``epoch``), the rebalance rule's check (``check``), or a
    group formed mid-epoch that the rest of the epoch is split over (``membership``)."""

    cause: Literal["epoch", "check", "membership"] = "epoch"


@dataclass(frozen=True, slots=True)
class PostPlanUpdate:
    """Send the workers of the segment in flight the re-plan offered inside it (from its
    step where they apply it; refused, it takes effect after the segment)."""


@dataclass(frozen=True, slots=True)
class TrainSegment:
    """Run the next segment and commit what its state holders completed; answered with
    :class:`SegmentDone` (``all_ran``). ``ahead``: send the segment after it before its
    results are read; ``across``: that may be the next epoch's first (behind this epoch's
    evaluation)."""

    ahead: bool = False
    across: bool = False


@dataclass(frozen=True, slots=True)
class AbsorbAhead:
    """After a failed segment, collect the one sent ahead of it: commit what its workers
    trained past the failure (they went on in lockstep when it came after every
    collective of the segment: a result lost with its node), discard the rest."""


@dataclass(frozen=True, slots=True)
class EndEpoch:
    """Verify the epoch from the workers' reports (the job fails when the exactly-once check
    does not hold) and build its record."""


@dataclass(frozen=True, slots=True)
class Evaluate:
    """Have the holders score the ended epoch's final weights, each its shard of the
    held-out set (unless that was sent ahead of the epoch's end), and attach the epoch's
    record to that evaluation: the record is published when it is in."""


@dataclass(frozen=True, slots=True)
class JudgeEpoch:
    """Judge the epoch that ended by its evaluation (awaited first): whether it is the best
    by keep_best's metric, and whether early stopping ends the training after it."""


@dataclass(frozen=True, slots=True)
class NextEpoch:
    """Close the epoch that ended: the protocol moves to the next epoch's start (the job
    shows it from now on; training ends there when early stopping said so: ``stop``, its
    reason), and the evaluations that are in are published."""

    stop: str | None = None


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
    """Write the job's checkpoint (when it keeps them). ``reason``: ``cancel`` (where the job
    stands), or at the end of an epoch, as the start of the next: ``epoch`` (due),
    ``early stopping`` (the training ends), ``best`` (the best epoch so far by keep_best's
    metric, written beside the latest: ``best`` says by what)."""

    reason: Literal["cancel", "epoch", "early stopping", "best"]
    best: dict[str, Any] | None = None


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
    LoadData
    | ApplyRequests
    | ApplyDrains
    | AdoptStarted
    | PollNodes
    | SpawnWorkers
    | TendSpares
    | KillLeaving
    | AwaitStarts
    | GiveUpStarts
    | WaitForMinimum
    | LoadCheckpoint
    | Regroup
    | MarkRunning
    | FinishSucceeded
    | BeginEpoch
    | Replan
    | PostPlanUpdate
    | TrainSegment
    | AbsorbAhead
    | EndEpoch
    | Evaluate
    | JudgeEpoch
    | NextEpoch
    | PublishReady
    | CommitInFlight
    | Settle
    | Checkpoint
    | SaveModel
    | FinishCancelled
    | EndStep
)


def outcome(command: Command, facts: Facts, ok: bool | Verdict = True) -> Outcome:
    """The event that answers a batch whose last command was ``command``: its kind is the
    command's, ``facts`` are read after it, and ``ok`` is what the command returned (a
    regroup formed, a segment all ran, an epoch's verdict; True for the rest)."""
    match command:
        case JudgeEpoch():
            return EvaluationsIn(facts, ok if isinstance(ok, Verdict) else Verdict())
        case TrainSegment() | AbsorbAhead() | CommitInFlight():
            return SegmentDone(facts, all_ran=ok)
        case Regroup():
            return Regrouped(facts, formed=ok)
        case AdoptStarted() | AwaitStarts():
            return WorkersStarted(facts)
        case PollNodes() | SpawnWorkers() | TendSpares():
            return WorkersPlaced(facts)
        case ApplyRequests():
            return RequestsTaken(facts)
        case Settle() | JudgeEpoch():
            return EvaluationsIn(facts)
        case EndStep():
            raise ValueError("EndStep ends the boundary: nothing answers it")
        case _:
            return Done(facts)

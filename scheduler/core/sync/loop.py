"""A synchronous job's life in one file: the step loop as a reducer.

``step(state, event, config) -> (state, effects)`` is pure (no Ray, no torch, no clock).
The executor (``dynabatch.scheduler.sync.coordinator``) feeds it what happened and carries
the effects out in order, on Ray's runtime, the simulator's or a test's alike. Events are
what happened (a step boundary, or the answer to the last batch of effects, with
:class:`Seen`: what the job's machines say after it); effects carry what the executor needs;
states say where the loop stands and carry their data, with :class:`Memo`, what the reducer
remembers across boundaries. What is due (a checkpoint, an epoch's judgement, the rebalance
rule's check, listing the nodes, the first start's deadline, sending a segment ahead) the
reducer derives from its state, :class:`LoopConfig` and the event. The state diagram, and
what each state and effect means, is in ``docs/architecture.md`` ("The step loop").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from dynabatch.scheduler.core.lifecycle import InvalidEvent, JobState
from dynabatch.scheduler.core.membership import SparePlan, Spawn
from dynabatch.scheduler.core.sync.ahead import can_cross_epoch, can_send_ahead
from dynabatch.scheduler.core.sync.protocol import Position, RebalanceRule, SegmentPlan
from dynabatch.scheduler.core.sync.update import OfferedUpdate

# How often nodes are listed (every step boundary at most, and between segments sent
# ahead): a node that joins gets its worker or spare this soon. Listing costs two GCS
# calls of about a millisecond.
NODE_POLL_S = 0.2


# --- what the reducer is told once, and each time ---------------------------------------


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """What the job's spec fixes for its life."""

    epochs: int
    rule: RebalanceRule = field(default_factory=RebalanceRule)
    policy_static: bool = False  # the policy never re-plans from speed
    goodput: bool = False  # the regime decides the next global batch at each epoch's end
    checkpoint_dir: bool = False  # the job keeps checkpoints
    checkpoint_every: int = 1
    judges_epochs: bool = False  # early_stopping or checkpoint.keep_best
    # ISGD: a segment's stamps wait on the losses of the one before it (its chart), so no
    # segment is sent ahead. (Goodput's AdaScale gain changes only at epoch ends.)
    isgd: bool = False
    start_timeout_s: float = 600.0

    def checkpoint_due(self, epoch: int) -> bool:
        """A checkpoint is written as ``epoch`` begins (the one before it ended): every
        ``checkpoint_every`` epochs and after the last, when the job keeps checkpoints."""
        return self.checkpoint_dir and (epoch % self.checkpoint_every == 0
                                        or epoch == self.epochs)



@dataclass(frozen=True, slots=True)
class MembershipView:
    """What the membership holds (``dynabatch.scheduler.core.membership``), as worker ids:
    what is due from it (a drain, a regroup and its state, the first start) the reducer
    derives here."""

    generation: int = 0  # groups formed so far
    # The members, in the next group's rank order: holders of the committed state first.
    members: tuple[str, ...] = ()
    holders: tuple[str, ...] = ()  # the members holding the committed state
    starting: tuple[str, ...] = ()  # workers started that have not come up yet
    draining: tuple[str, ...] = ()  # asked to leave, or moved now by an assignment
    # Moved off their nodes by the assignment in force, now or at a later boundary at rest.
    moving: tuple[str, ...] = ()
    dirty: bool = False  # a worker joined or was lost: the next boundary at rest regroups
    shortfall: str | None = None  # fewer workers than the minimum: which, and why

    @property
    def first_start(self) -> bool:
        """No member and no group formed yet."""
        return not self.members and self.generation == 0

    @property
    def needs_state(self) -> bool:
        """A regroup is due and no member of it holds the committed state."""
        return self.dirty and (not self.members or self.members[0] not in self.holders)


@dataclass(frozen=True, slots=True)
class Seen:
    """What the job's machines say after the last effect (read by the executor)."""

    cancel: str | None = None  # a cancellation's reason, once requested
    epoch: int = 0  # the protocol's (or, before the data is loaded, the job's position)
    step: int = 0  # steps of the epoch committed
    steps_per_epoch: int = 1
    recorded: int = 0  # epochs recorded in the job's history
    batch: int = 0  # the global batch in force
    next_batch: int = 0  # the regime's for the next epoch
    requests: tuple[str, ...] = ()  # the kinds queued: "scale", "drain", "assign"
    membership: MembershipView = MembershipView()
    leaving: tuple[str, ...] = ()  # workers taken out whose processes still run

    @property
    def epoch_complete(self) -> bool:
        """Every step of the protocol's epoch is committed."""
        return self.step >= self.steps_per_epoch


@dataclass(frozen=True, slots=True)
class Verdict:
    """An ended epoch judged by its evaluation: ``best`` (keep_best's metric, mode, value
    and epoch) when it is the best so far; ``stop``, early stopping's reason to end."""

    best: dict[str, Any] | None = None
    stop: str | None = None


@dataclass(frozen=True, slots=True)
class Boundary:
    """A step boundary begins."""

    seen: Seen
    now: float


@dataclass(frozen=True, slots=True)
class Done:
    """The batch ended with an effect that reports nothing but what it left."""

    seen: Seen
    now: float


@dataclass(frozen=True, slots=True)
class Replanned:
    """A re-plan was made; ``offer``: it changed the batches from a step inside the segment
    in flight, whose workers have not been sent it yet."""

    seen: Seen
    now: float
    offer: OfferedUpdate | None = None


@dataclass(frozen=True, slots=True)
class RequestsTaken:
    seen: Seen
    now: float


@dataclass(frozen=True, slots=True)
class WorkersStarted:
    seen: Seen
    now: float


@dataclass(frozen=True, slots=True)
class Placed:
    """The nodes are listed: the workers to start on them where the membership misses
    members (``spawns``, the membership's), and the spares to start and stop."""

    seen: Seen
    now: float
    spawns: tuple[Spawn, ...] = ()
    spares: SparePlan = field(default_factory=SparePlan)

    @property
    def nothing(self) -> bool:
        return not self.spawns and self.spares == SparePlan()


@dataclass(frozen=True, slots=True)
class WorkersPlaced:
    """The workers of a placement are starting, and its spares tended."""

    seen: Seen
    now: float


@dataclass(frozen=True, slots=True)
class Regrouped:
    seen: Seen
    now: float
    formed: bool  # not formed: a worker was lost or failed while it formed


@dataclass(frozen=True, slots=True)
class SegmentOrder:
    """A segment to train at ``position``: each of its workers' stamped plan. ``sent``: it
    is the segment in flight (sent ahead; its plans as updated since): it is collected, not
    sent. ``ahead``: the segment to send before this one's results are read, with
    ``shards`` when it is the next epoch's first: the evaluation of this epoch's final
    weights queued on its workers in front of it."""

    position: Position
    plans: Mapping[str, SegmentPlan]
    sent: bool = False
    ahead: SegmentOrder | None = None
    shards: Mapping[str, tuple[int, int]] | None = None


@dataclass(frozen=True, slots=True)
class SegmentPlanned:
    """The segment a :class:`PlanSegment` asked for, planned."""

    seen: Seen
    now: float
    order: SegmentOrder


@dataclass(frozen=True, slots=True)
class SegmentDone:
    """A segment ran, or the one in flight was collected."""

    seen: Seen
    now: float
    all_ran: bool = True  # not so: a worker was lost or failed in it


@dataclass(frozen=True, slots=True)
class EpochEnded:
    """The epoch is verified and its ``record`` built (the executor's); ``shards``: each
    holder's share of the held-out set to score its final weights on (None: the evaluation
    sent ahead of the epoch's end scores them)."""

    seen: Seen
    now: float
    record: Any
    shards: Mapping[str, tuple[int, int]] | None = None


@dataclass(frozen=True, slots=True)
class EvaluationsIn:
    seen: Seen
    now: float
    verdict: Verdict = Verdict()


@dataclass(frozen=True, slots=True)
class Failed:
    """The failure policy decided to fail the job (or the executor hit a bug): ``reason``
    says why. It answers any batch."""

    reason: str


Answer = Done | Replanned | RequestsTaken | WorkersStarted | Placed | WorkersPlaced | Regrouped \
    | SegmentPlanned | SegmentDone | EpochEnded | EvaluationsIn
Event = Boundary | Answer | Failed


# --- effects ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadData:
    """Load the dataset and build the protocol at the job's position."""


@dataclass(frozen=True, slots=True)
class TakeRequests:
    """Take the queued scale, drain and assign requests into the membership (``assignments``:
    only the assignments at the head of the queue, their workers starting now)."""

    assignments: bool = False


@dataclass(frozen=True, slots=True)
class ApplyDrains:
    """Remove the workers asked to leave and those an assignment moves now."""


@dataclass(frozen=True, slots=True)
class AdoptStarted:
    """Take in the workers whose start finished (they join at the next regroup)."""


@dataclass(frozen=True, slots=True)
class Place:
    """List the nodes, and plan the workers to start on them where the membership misses
    members and, except at the first start, the spares (``starting``: it says when there
    are no nodes, and spares would compete with its workers' start-up); answered with
    :class:`Placed`."""

    starting: bool = False


@dataclass(frozen=True, slots=True)
class StartWorkers:
    """Start ``spawns``' workers. ``wait``: one adopts its node's spare with nothing in
    flight, so it is waited for a moment (it joins this boundary's regroup)."""

    spawns: tuple[Spawn, ...]
    wait: bool = False


@dataclass(frozen=True, slots=True)
class TendSpares:
    """Start and stop spares as ``plan`` says."""

    plan: SparePlan


@dataclass(frozen=True, slots=True)
class StopWorkers:
    """Stop these workers' processes (taken out of the job)."""

    workers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AwaitStarts:
    """Wait a little (half a second) for the workers starting, and take in those up."""


@dataclass(frozen=True, slots=True)
class GiveUpStarts:
    """Give up the workers still starting: out of the membership, to be stopped."""


@dataclass(frozen=True, slots=True)
class WaitForMinimum:
    """Too few workers since ``since``: say why, fail once the wait is over its limit, else
    wait a little (the step ends)."""

    shortfall: str
    since: float | None = None


@dataclass(frozen=True, slots=True)
class LoadCheckpoint:
    """No member holds the committed state: load the last checkpoint (its weights wait for
    the regroup), or fail (the failure policy's ``RollBack`` or ``Fail``)."""


@dataclass(frozen=True, slots=True)
class Regroup:
    """Form the next generation of ``members`` in rank order; rank 0 is the source of the
    state: the committed state it holds (``holder``), or the weights restored from a
    checkpoint, loaded into it first (``checkpoint``). Answered with :class:`Regrouped`."""

    members: tuple[str, ...]
    source: Literal["holder", "checkpoint"] = "holder"


@dataclass(frozen=True, slots=True)
class BeginEpoch:
    """Open the epoch (its global batch, totals, ledger)."""


@dataclass(frozen=True, slots=True)
class Replan:
    """Re-plan the rest of the epoch (from the step after the segment in flight, if any):
    at its start (``epoch``), the rebalance rule's check (``check``), or over a group
    formed mid-epoch (``membership``)."""

    cause: Literal["epoch", "check", "membership"] = "epoch"


@dataclass(frozen=True, slots=True)
class PostPlanUpdate:
    """Send the segment in flight's workers the re-plan offered inside it (refused, it takes
    effect after the segment)."""

    offer: OfferedUpdate


@dataclass(frozen=True, slots=True)
class PlanSegment:
    """Plan the next segment (the one in flight, when it starts there); answered with
    :class:`SegmentPlanned`. ``ahead``: plan the one after it too, to send before its
    results are read; ``across``: that may be the next epoch's first."""

    ahead: bool = False
    across: bool = False


@dataclass(frozen=True, slots=True)
class TrainSegment:
    """Run ``order`` (send it, then the one ahead of it, and read its results) and commit
    what it completed; answered with :class:`SegmentDone`."""

    order: SegmentOrder


@dataclass(frozen=True, slots=True)
class AbsorbAhead:
    """After a failed segment, collect the one sent ahead of it: commit what it trained past
    the failure, discard the rest."""


@dataclass(frozen=True, slots=True)
class CommitInFlight:
    """Collect the segment in flight and commit it (a cancellation keeps what it trained)."""


@dataclass(frozen=True, slots=True)
class EndEpoch:
    """Verify the epoch from the workers' reports and build its record; answered with
    :class:`EpochEnded`."""


@dataclass(frozen=True, slots=True)
class Evaluate:
    """Have the holders score ``epoch``'s final weights, each its shard (None: the
    evaluation sent ahead of its end does), and attach the epoch's ``record`` to that
    evaluation: the record is published when it is in."""

    epoch: int
    shards: Mapping[str, tuple[int, int]] | None
    record: Any


@dataclass(frozen=True, slots=True)
class JudgeEpoch:
    """Await the ended epoch's evaluation and judge it (best so far; early stopping)."""


@dataclass(frozen=True, slots=True)
class NextEpoch:
    """The protocol moves to the next epoch's start (training ends there when early
    stopping said so: ``stop``); the evaluations in are published."""

    stop: str | None = None


@dataclass(frozen=True, slots=True)
class PublishReady:
    """Publish the epochs whose evaluation is in."""


@dataclass(frozen=True, slots=True)
class Settle:
    """Await the evaluations in flight and publish them."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Write the job's checkpoint at ``position`` (None: where the job stands). ``reason``:
    ``cancel``, ``epoch`` (due), ``early stopping``, ``best`` (``best`` says by what)."""

    reason: Literal["cancel", "epoch", "early stopping", "best"]
    position: Position | None = None
    best: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class SaveModel:
    """Hand out the trained model's files."""

    reason: Literal["end", "cancel"]


@dataclass(frozen=True, slots=True)
class EndJob:
    """The job ends with ``outcome`` (SUCCEEDED, CANCELLED or FAILED) and ``reason``."""

    outcome: JobState
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class EndStep:
    """The boundary is over; ``stop``: the loop ends."""

    stop: bool = False


Effect = (
    LoadData | TakeRequests | ApplyDrains | AdoptStarted | Place | StartWorkers | TendSpares
    | StopWorkers | AwaitStarts
    | GiveUpStarts | WaitForMinimum | LoadCheckpoint | Regroup | BeginEpoch | Replan
    | PostPlanUpdate | PlanSegment | TrainSegment | AbsorbAhead | CommitInFlight | EndEpoch
    | Evaluate | JudgeEpoch | NextEpoch | PublishReady | Settle | Checkpoint | SaveModel | EndJob
    | EndStep
)


def answer(effect: Effect, seen: Seen, now: float, ok: Any = True) -> Answer:
    """The event that answers a batch whose last effect was ``effect``: ``seen`` after it,
    ``ok`` what it returned (a regroup formed, a segment's order or whether it all ran, an
    epoch's verdict, a re-plan's offer)."""
    match effect:
        case Replan():
            return Replanned(seen, now, ok if isinstance(ok, OfferedUpdate) else None)
        case JudgeEpoch():
            return EvaluationsIn(seen, now, ok if isinstance(ok, Verdict) else Verdict())
        case PlanSegment():
            if not isinstance(ok, SegmentOrder):
                raise TypeError(f"a segment's plan is a SegmentOrder, not {ok!r}")
            return SegmentPlanned(seen, now, ok)
        case TrainSegment() | AbsorbAhead() | CommitInFlight():
            return SegmentDone(seen, now, bool(ok))
        case EndEpoch():
            if not isinstance(ok, tuple):
                raise TypeError(f"an epoch's end is its record and shards, not {ok!r}")
            return EpochEnded(seen, now, *ok)
        case Regroup():
            return Regrouped(seen, now, formed=bool(ok))
        case AdoptStarted() | AwaitStarts():
            return WorkersStarted(seen, now)
        case Place():  # (ok True, as a test may answer: nothing to start)
            return Placed(seen, now, *ok) if isinstance(ok, tuple) else Placed(seen, now)
        case StartWorkers() | TendSpares():
            return WorkersPlaced(seen, now)
        case TakeRequests():
            return RequestsTaken(seen, now)
        case Settle():
            return EvaluationsIn(seen, now)
        case EndStep():
            raise ValueError("EndStep ends the boundary: nothing answers it")
        case _:
            return Done(seen, now)


# --- states -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Memo:
    """What the reducer remembers across boundaries."""

    polled_at: float | None = None  # when the nodes were last listed
    # A segment sent ahead has not been collected (the last segment run said so).
    in_flight: bool = False
    # The data is loaded and the protocol built (LoadData, at the first boundary).
    data_loaded: bool = False
    # An epoch is open: begun (BeginEpoch) and not yet closed (NextEpoch, or a roll-back).
    epoch_open: bool = False
    # The last segment did not all run: the next is its retry, and runs alone (through
    # regroups and waits, until a segment all runs).
    retrying: bool = False
    # Weights restored from a checkpoint (resuming, checkpoint.from, a roll-back) wait for
    # the next group to form with them.
    restored: bool = False
    # Early stopping's reason, once an epoch's judgement ended the training.
    stopped: str | None = None
    # A group formed and the job has not waited for workers since: it is RUNNING.
    running: bool = False


@dataclass(frozen=True, slots=True)
class AtRest:
    """Between boundaries."""

    memo: Memo = Memo()


@dataclass(frozen=True, slots=True)
class Waiting:
    """Between boundaries, too few workers (``shortfall``) since ``since``: the next
    boundary looks again; the job fails once the wait is over its limit."""

    since: float
    shortfall: str
    memo: Memo = Memo()


ReconcileStage = Literal["watching", "requests", "gathering", "placing", "awaiting",
                         "giving_up"]


@dataclass(frozen=True, slots=True)
class Reconciling:
    """Settling who trains. ``stage``: ``watching`` (a segment in flight: workers started
    and nodes listed only), ``requests``, ``gathering`` (drains, started workers),
    ``placing``, ``awaiting`` (the first start's workers; ``adopted``: the last effect took
    in those up; ``deadline``: when the wait for them ends, once begun), ``giving_up``.
    ``waiting``: the wait for workers this boundary began in."""

    stage: ReconcileStage
    waiting: Waiting | None = None
    adopted: bool = False
    deadline: float | None = None
    memo: Memo = Memo()


@dataclass(frozen=True, slots=True)
class Regrouping:
    """Forming the next generation. ``stage``: ``rolling_back`` (loading the last checkpoint
    first), ``forming``, ``resplitting`` (formed mid-epoch: the rest of it re-planned)."""

    stage: Literal["rolling_back", "forming", "resplitting"]
    memo: Memo = Memo()


@dataclass(frozen=True, slots=True)
class Training:
    """Training ``epoch``. ``stage``: ``opening`` (the epoch begun and planned),
    ``checking`` (the rebalance rule's re-plan), ``posting`` (a plan update; ``opening``
    when the epoch's segment follows), ``planning`` the segment, ``segment`` (``order``,
    running), ``absorbing`` (what was sent ahead of a failed segment)."""

    epoch: int
    stage: Literal["opening", "checking", "posting", "planning", "segment", "absorbing"]
    opening: bool = False
    memo: Memo = Memo()
    order: SegmentOrder | None = None


Then = Literal["train", "absorb", "cancel"]


@dataclass(frozen=True, slots=True)
class EndingEpoch:
    """Ending ``epoch``. ``then``: what follows (train on; absorb the next epoch's first,
    sent ahead of the failed segment that completed it; or go on cancelling, for
    ``cancel``). ``judging``: its evaluation is awaited to judge it; ``due``: its checkpoint
    is due anyway; ``record``: the epoch's, once built (None: :class:`EndEpoch` builds it)."""

    epoch: int
    then: Then
    judging: bool = False
    due: bool = False
    memo: Memo = Memo()
    cancel: str | None = None
    record: Any = None


@dataclass(frozen=True, slots=True)
class Finishing:
    """Every epoch trained: awaiting the last evaluations. ``cancel``: the reason of a
    cancellation whose last segment completed the last epoch (the job succeeds)."""

    cancel: str | None
    memo: Memo = Memo()


@dataclass(frozen=True, slots=True)
class Cancelling:
    """Cancelling for ``reason``: ``committing`` the segment in flight, or ``settling``
    the evaluations."""

    reason: str
    stage: Literal["committing", "settling"]
    memo: Memo = Memo()


@dataclass(frozen=True, slots=True)
class Concluded:
    """The job ended: ``outcome`` and why."""

    outcome: JobState
    reason: str | None = None
    memo: Memo = field(default_factory=Memo)


LoopState = (AtRest | Waiting | Reconciling | Regrouping | Training | EndingEpoch | Finishing
             | Cancelling | Concluded)


Effects = list[Effect]


def public_state(state: LoopState) -> JobState:
    """The job's lifecycle state, derived from where its loop stands: PENDING until its
    first group forms and while it waits for workers (until a group forms again), RUNNING
    otherwise, and the outcome once concluded. The executor publishes it after each
    ``step`` (the outcome once the concluding batch's effects are carried out:
    :class:`EndJob`)."""
    if isinstance(state, Concluded):
        return state.outcome
    return JobState.RUNNING if state.memo.running else JobState.PENDING


# --- the reducer ------------------------------------------------------------------------


def step(state: LoopState, event: Event, config: LoopConfig) -> tuple[LoopState, Effects]:
    """Where the loop goes from ``state`` on ``event``, and the effects to carry out in
    order. A batch not ending with :class:`EndStep` is answered with :func:`answer`'s event
    for its last effect (or :class:`Failed`)."""
    if isinstance(event, Failed):
        if isinstance(state, Concluded):
            return state, [EndStep(stop=True)]
        return (Concluded(JobState.FAILED, event.reason, state.memo),
                [EndJob(JobState.FAILED, event.reason), EndStep(stop=True)])
    if isinstance(event, SegmentDone):  # a run sends the next ahead, or collects all
        flying = isinstance(state, Training) and state.order is not None \
            and state.order.ahead is not None
        state = replace(state, memo=replace(state.memo, in_flight=flying,
                                            retrying=not event.all_ran))
    new, effects = _decide(state, event, config)
    if (memo := _remember(new.memo, effects)) is not new.memo:
        new = replace(new, memo=memo)
    if event.seen.leaving:
        # Workers taken out in the last batch are stopped before anything else: what a hung
        # worker queued then fails at once, and its node is free before others start.
        effects = [StopWorkers(event.seen.leaving), *effects]
    return new, effects


def _remember(memo: Memo, effects: Effects) -> Memo:
    """What ``effects`` leave behind: LoadData loads the data; BeginEpoch opens an epoch;
    NextEpoch closes it, and so does loading the last checkpoint (the job goes back to its
    start)."""
    loaded, is_open = memo.data_loaded, memo.epoch_open
    for e in effects:
        if isinstance(e, LoadData):
            loaded = True
        elif isinstance(e, BeginEpoch):
            is_open = True
        elif isinstance(e, (NextEpoch, LoadCheckpoint)):
            is_open = False
    if (loaded, is_open) == (memo.data_loaded, memo.epoch_open):
        return memo
    return replace(memo, data_loaded=loaded, epoch_open=is_open)


def _decide(state: LoopState, event: Answer | Boundary, cfg: LoopConfig
            ) -> tuple[LoopState, Effects]:
    d = _Decisions(cfg, state.memo, event.now)
    f = event.seen
    match state, event:
        case Concluded(), Boundary():
            return state, [EndStep(stop=True)]
        case AtRest() | Waiting(), Boundary():
            return d.tick(f, state if isinstance(state, Waiting) else None)
        case Reconciling("watching" | "awaiting" | "placing" as stage), Placed() \
                if not event.nothing:
            # A spare adopted with nothing in flight is waited for: it joins this regroup.
            wait = stage != "watching" and any(sp.adopt for sp in event.spawns)
            start: Effects = [StartWorkers(event.spawns, wait)] if event.spawns else []
            tend = [] if event.spares == SparePlan() else [TendSpares(event.spares)]
            return state, [*start, *tend]
        case Reconciling("watching"), WorkersStarted() | Placed() | WorkersPlaced():
            return d.formed(f)
        case Reconciling("requests", waiting), RequestsTaken():
            drain = [Settle(), ApplyDrains()] if f.membership.draining else []
            return Reconciling("gathering", waiting, memo=d.memo), [*drain, AdoptStarted()]
        case Reconciling("gathering", waiting), WorkersStarted():
            if f.membership.first_start:  # its workers are started, then awaited
                return d.place(Reconciling("awaiting", waiting), starting=True)
            if d.poll_due() or f.membership.dirty:
                return d.place(Reconciling("placing", waiting), starting=False)
            return d.gathered(f, waiting)
        case Reconciling("awaiting", waiting, adopted, deadline), \
                WorkersStarted() | Placed() | WorkersPlaced():
            return d.await_starts(f, adopted, deadline, waiting)
        case Reconciling("placing", waiting), Placed() | WorkersPlaced():
            return d.gathered(f, waiting)
        case Reconciling("giving_up", waiting), Done():
            return d.gathered(f, waiting)
        case Regrouping("rolling_back"), Done():  # the checkpoint's weights wait
            d = replace(d, memo=replace(d.memo, restored=True))
            return Regrouping("forming", d.memo), [d.regroup(f)]
        case Regrouping("forming"), Regrouped(formed=formed):
            if not formed:
                return d.rest(EndStep())  # the next boundary tries again
            d = replace(d, memo=replace(d.memo, restored=False))  # loaded into the group
            if d.memo.epoch_open and not f.epoch_complete:
                # Formed mid-epoch: the rest of the epoch is split over the new group.
                return Regrouping("resplitting", d.memo), [Replan("membership")]
            return d.formed(f)
        case Regrouping("resplitting"), Replanned():
            return d.formed(f)  # at rest: nothing in flight to offer a re-plan to
        case Training(_, "opening"), Replanned(offer=offer):
            return d.replanned(f, offer, opening=True)
        case Training(_, "checking"), Replanned(offer=offer):
            return d.replanned(f, offer, opening=False)
        case Training(_, "posting", opening), Done():
            return d.segment(f) if opening else d.rest(PublishReady(), EndStep())
        case Training(epoch, "planning"), SegmentPlanned(order=order):
            return Training(epoch, "segment", memo=d.memo, order=order), [TrainSegment(order)]
        case Training(epoch, "segment"), SegmentDone(all_ran=all_ran):
            if not all_ran and d.memo.in_flight:
                # Failed with the next one sent: what that trained past the failure is
                # committed, in the next epoch when this one completed the epoch.
                if f.epoch_complete:
                    return d.end_epoch(f, "absorb")
                return Training(epoch, "absorbing", memo=d.memo), [AbsorbAhead()]
            if f.epoch_complete:
                return d.end_epoch(f, "train")
            if all_ran and cfg.rule.due(f.step, f.steps_per_epoch):
                return Training(epoch, "checking", memo=d.memo), [Replan("check")]
            return d.rest(PublishReady(), EndStep())
        case Training(_, "absorbing"), SegmentDone():
            if f.epoch_complete:
                return d.end_epoch(f, "train")
            return d.rest(PublishReady(), EndStep())
        case EndingEpoch(epoch, _, judging, due, record=None), \
                EpochEnded(record=record, shards=shards):
            # A checkpoint due, or an epoch judged by its evaluation, awaits that first (the
            # checkpoint holds the epoch's record, scores included); the checkpoints are
            # written as the next epoch's start.
            evaluate = Evaluate(epoch, shards, record)
            state = replace(state, record=record, memo=d.memo)
            if judging:
                return state, [evaluate, Settle(), JudgeEpoch()]
            save = [Settle(), Checkpoint("epoch", Position(epoch + 1, 0))] if due else []
            return state, [evaluate, *save, NextEpoch()]
        case EndingEpoch(record=None), _:
            pass  # its record is being built: only EpochEnded answers (refused below)
        case EndingEpoch(epoch, then, True, due), EvaluationsIn(verdict=verdict):
            best = [Checkpoint("best", Position(epoch + 1, 0), verdict.best)] \
                if verdict.best else []
            if due:
                save = [Checkpoint("epoch", Position(epoch + 1, 0))]
            elif verdict.stop and cfg.checkpoint_dir:
                save = [Checkpoint("early stopping", Position(epoch + 1, 0))]
            else:
                save = []
            memo = replace(d.memo, stopped=verdict.stop) if verdict.stop else d.memo
            return (EndingEpoch(epoch, then, memo=memo, cancel=state.cancel, record=state.record),
                    [*best, *save, NextEpoch(verdict.stop)])
        case EndingEpoch(epoch, "absorb", False), Done():
            return Training(epoch + 1, "absorbing", memo=d.memo), [BeginEpoch(), AbsorbAhead()]
        case EndingEpoch(_, "train", False), Done():
            return d.finishing(f, cancel=None) or d.rest(PublishReady(), EndStep())
        case EndingEpoch(_, "cancel", False, cancel=reason), Done():
            return d.finishing(f, cancel=reason) or d.settle_cancel(reason)
        case Finishing(cancel), EvaluationsIn():
            cancelling = cancel is not None
            if f.cancel is not None and not cancelling:
                return d.rest(EndStep())  # the next boundary cancels the job
            if f.membership.holders:
                return d.conclude(JobState.SUCCEEDED, d.memo.stopped, SaveModel("end"),
                                  stop=cancelling)
            # The last holder was lost in the final evaluations: the next boundary regroups
            # (rolling back) and trains on; a cancellation goes on cancelling.
            return d.settle_cancel(cancel) if cancel is not None else d.rest(EndStep())
        case Cancelling(reason, "committing"), SegmentDone():
            if f.epoch_complete and d.memo.epoch_open:
                return d.end_epoch(f, "cancel", cancel=reason)
            return d.settle_cancel(reason)
        case Cancelling(reason, "settling"), EvaluationsIn():
            save = [SaveModel("cancel")] if f.recorded or f.step > 0 else []
            return d.conclude(JobState.CANCELLED, reason, Checkpoint("cancel"), *save,
                              stop=True)
    raise InvalidEvent(f"{type(event).__name__} while {state!r}")


@dataclass(frozen=True, slots=True)
class _Decisions:
    """The decisions one event's handling shares: the config, what the reducer remembers
    (updated as effects are chosen) and the event's time."""

    cfg: LoopConfig
    memo: Memo
    now: float

    def poll_due(self) -> bool:
        m = self.memo
        return m.polled_at is None or self.now - m.polled_at >= NODE_POLL_S

    def rest(self, *effects: Effect) -> tuple[LoopState, Effects]:
        return AtRest(self.memo), list(effects)

    def conclude(self, outcome: JobState, reason: str | None, *effects: Effect,
                 stop: bool) -> tuple[LoopState, Effects]:
        return (Concluded(outcome, reason, self.memo),
                [*effects, EndJob(outcome, reason), EndStep(stop=stop)])

    def tick(self, f: Seen, waiting: Waiting | None) -> tuple[LoopState, Effects]:
        if f.cancel is not None:
            return self.cancel(f)
        load = [] if self.memo.data_loaded else [LoadData()]
        if self.memo.in_flight:  # membership changes wait for a boundary at rest
            # An assignment's workers start now, while the segment in flight trains.
            take = [TakeRequests(assignments=True)] if f.requests[:1] == ("assign",) else []
            state: LoopState = Reconciling("watching", memo=self.memo)
            poll: Effects = []
            if self.poll_due() or take:
                state, poll = self.place(state, starting=False)
            return state, [*load, *take, AdoptStarted(), *poll]
        # An assignment taken now has its workers started at once: the nodes are listed.
        memo = replace(self.memo, polled_at=None) if "assign" in f.requests else self.memo
        return Reconciling("requests", waiting, memo=memo), [*load, TakeRequests()]

    def place(self, state: Reconciling, starting: bool) -> tuple[LoopState, Effects]:
        return replace(state, memo=replace(self.memo, polled_at=self.now)), [Place(starting)]

    def await_starts(self, f: Seen, adopted: bool, deadline: float | None,
                     waiting: Waiting | None) -> tuple[LoopState, Effects]:
        """The first start waits for its workers a little at a time up to the start timeout
        (from its first wait), starting again those that failed once none is left starting;
        those still starting at the deadline, or at a cancel, are given up."""
        memo = self.memo
        if f.membership.starting:
            if f.cancel is not None or (deadline is not None and self.now >= deadline):
                return Reconciling("giving_up", waiting, memo=memo), [GiveUpStarts()]
            if deadline is None:  # the wait begins: the start timeout counts from now
                deadline = self.now + self.cfg.start_timeout_s
            return (Reconciling("awaiting", waiting, adopted=True, deadline=deadline, memo=memo),
                    [AwaitStarts()])
        if adopted:  # none left starting: replace those that failed to start
            return self.place(Reconciling("awaiting", waiting, deadline=deadline),
                              starting=True)
        return self.gathered(f, waiting)

    def gathered(self, f: Seen, waiting: Waiting | None) -> tuple[LoopState, Effects]:
        """Who trains is known: too few (wait), a changed group (regroup), or ready. Too few
        with a cancellation pending cancels: the wait would only delay it."""
        r = f.membership
        if r.shortfall is not None and f.cancel is not None:
            return self.cancel(f)
        if r.shortfall is not None:
            since = waiting.since if waiting else None
            memo = replace(self.memo, running=False)  # the job waits: PENDING
            return (Waiting(self.now if since is None else since, r.shortfall, memo),
                    [WaitForMinimum(r.shortfall, since), EndStep()])
        if r.dirty:
            # No member holds the committed state: load the last checkpoint, unless weights
            # restored from one wait already (a regroup that failed after loading them).
            if r.needs_state and not self.memo.restored:
                # The records of epochs before the checkpoint first: its history replaces them.
                return Regrouping("rolling_back", self.memo), [Settle(), LoadCheckpoint()]
            return Regrouping("forming", self.memo), [self.regroup(f)]
        return self.formed(f)

    def regroup(self, f: Seen) -> Regroup:
        """The membership's next generation, its state from the weights a checkpoint
        restored when they wait to be loaded, else from the holder at rank 0."""
        return Regroup(f.membership.members, "checkpoint" if self.memo.restored else "holder")

    def trained(self, f: Seen) -> bool:
        """Every epoch is trained, or early stopping ended the training."""
        return f.epoch >= self.cfg.epochs or self.memo.stopped is not None

    def formed(self, f: Seen) -> tuple[LoopState, Effects]:
        """The group is ready: the job runs (RUNNING: :func:`public_state`); then cancel or
        train."""
        d = replace(self, memo=replace(self.memo, running=True))
        return d.cancel(f) if f.cancel is not None else d.train(f)

    def train(self, f: Seen) -> tuple[LoopState, Effects]:
        if self.trained(f):
            return self.finishing(f, None) or self.rest(EndStep())
        if not self.memo.epoch_open:
            return Training(f.epoch, "opening", memo=self.memo), [BeginEpoch(), Replan()]
        return self.segment(f)

    def replanned(self, f: Seen, offer: OfferedUpdate | None, opening: bool
                  ) -> tuple[LoopState, Effects]:
        """A re-plan that changed the batches inside the segment in flight is posted first;
        then the epoch's segment (``opening``), or the boundary's end."""
        if offer is not None:
            return Training(f.epoch, "posting", opening, self.memo), [PostPlanUpdate(offer)]
        return self.segment(f) if opening else self.rest(PublishReady(), EndStep())

    def segment(self, f: Seen) -> tuple[LoopState, Effects]:
        """The next segment, and whether the one after it goes ahead: not when the next
        boundary needs the group at rest or the stamps wait on this segment's losses; across
        the epoch's end only when nothing between the epochs reads the state."""
        cfg = self.cfg
        ahead = can_send_ahead(
            cancel_requested=f.cancel is not None, retrying=self.memo.retrying,
            requests_pending=bool(f.requests) or f.membership.moving,
            regroup_due=f.membership.dirty,
            stamps_fixed=not cfg.isgd)
        nxt = f.epoch + 1
        across = ahead and can_cross_epoch(
            next_epoch=nxt, epochs=cfg.epochs, goodput=cfg.goodput, next_batch=f.next_batch,
            batch=f.batch, checkpoint_due=cfg.judges_epochs or cfg.checkpoint_due(nxt),
            replans_at_end=cfg.rule.mode == "epoch" and not cfg.policy_static)
        return Training(f.epoch, "planning", memo=self.memo), [PlanSegment(ahead, across)]

    def end_epoch(self, f: Seen, then: Then, cancel: str | None = None
                  ) -> tuple[LoopState, Effects]:
        """The protocol's epoch is complete: end it, then evaluate it."""
        cfg = self.cfg
        return (EndingEpoch(f.epoch, then, cfg.judges_epochs, cfg.checkpoint_due(f.epoch + 1),
                            self.memo, cancel), [EndEpoch()])

    def finishing(self, f: Seen, cancel: str | None) -> tuple[LoopState, Effects] | None:
        """Every epoch trained and a member holding the final state: await the last
        evaluations before success (None: not yet)."""
        if not (self.trained(f) and f.membership.holders):
            return None
        return Finishing(cancel, self.memo), [Settle()]

    def cancel(self, f: Seen) -> tuple[LoopState, Effects]:
        reason = f.cancel or "cancelled"
        if self.memo.in_flight:
            # Sent across the epoch's end, which has ended: it is committed in its epoch.
            begin: Effects = [] if self.memo.epoch_open else [BeginEpoch()]
            return Cancelling(reason, "committing", self.memo), [*begin, CommitInFlight()]
        return self.settle_cancel(reason)

    def settle_cancel(self, reason: str) -> tuple[LoopState, Effects]:
        return Cancelling(reason, "settling", self.memo), [Settle()]

"""The step loop's pure reducer (``scheduler/core/sync/loop.py``): what a boundary does, from
events, what they say the machines see (:class:`Seen`) and the job's :class:`LoopConfig`,
with no driver behind it.

The property drives it with random readings after every effect (a cancel can arrive, an
epoch can end, the failure policy can fail the job inside any effect) and checks the loop's
rules, what is due computed here from the config and the clock (a checkpoint, a judged
epoch, the rebalance rule's check, listing the nodes, the first start's deadline); the real
driver carrying these effects out is tested through the coordinator's own tests.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import pytest
from dynabatch.actors.contracts import SegmentPlan
from dynabatch.scheduler.core.lifecycle import InvalidEvent, JobState
from dynabatch.scheduler.core.membership import SparePlan, Spawn
from dynabatch.scheduler.core.sync.allocation import Allocation, Decision
from dynabatch.scheduler.core.sync.loop import (
    NODE_POLL_S,
    AbsorbAhead,
    AdoptStarted,
    ApplyDrains,
    AtRest,
    AwaitStarts,
    BeginEpoch,
    Boundary,
    Cancelling,
    Checkpoint,
    CommitInFlight,
    Concluded,
    Done,
    Effect,
    Effects,
    EndEpoch,
    EndingEpoch,
    EndJob,
    EndStep,
    EpochEnded,
    Evaluate,
    EvaluationsIn,
    Event,
    Failed,
    Finishing,
    GiveUpStarts,
    JudgeEpoch,
    LoadCheckpoint,
    LoadData,
    LoopConfig,
    LoopState,
    MembershipView,
    Memo,
    NextEpoch,
    Place,
    Placed,
    PlanSegment,
    PostPlanUpdate,
    PublishReady,
    Reconciling,
    Regroup,
    Regrouped,
    Regrouping,
    Replan,
    Replanned,
    RequestsTaken,
    SaveModel,
    Seen,
    SegmentDone,
    SegmentOrder,
    SegmentPlanned,
    Settle,
    StartWorkers,
    StopWorkers,
    TakeRequests,
    TendSpares,
    Training,
    TrainSegment,
    Verdict,
    WaitForMinimum,
    Waiting,
    WorkersPlaced,
    WorkersStarted,
    answer,
    public_state,
    step,
)
from dynabatch.scheduler.core.sync.protocol import Position, RebalanceRule
from dynabatch.scheduler.core.sync.update import OfferedUpdate
from hypothesis import given, settings
from hypothesis import strategies as st

T0 = 100.0  # the examples' clock: the nodes were last listed then (not due again before
LATER = T0 + NODE_POLL_S  # this)
CFG = LoopConfig(epochs=3)  # no checkpoints, nothing judged, re-planned at each epoch's start
_VIEW = {f.name for f in fields(MembershipView)}


# The next generation the membership plans when a regroup is due, rank 0 first.
GROUP = ("w0", "w1")
REGROUP = Regroup(GROUP, "holder")


# Shorthands for a membership (:func:`V`), each the facts that make it so.
_SAYS = {"first_start", "starts_pending", "drains_due", "needs_state", "group", "holders"}


def V(**kw) -> MembershipView:
    """The membership's view: by default a formed group of :data:`GROUP`, all holding the
    committed state. Shorthands: ``first_start`` (no member, no group formed yet),
    ``starts_pending`` (a worker starting), ``drains_due`` (a member to drain),
    ``needs_state`` (no member holds the state), ``holders=False`` (the same, no regroup
    implied), ``group`` (the members in rank order)."""
    members = kw.pop("group", GROUP)
    view = {"generation": 1, "members": members, "holders": members}
    if kw.pop("first_start", False):
        view.update(generation=0, members=(), holders=())
    if kw.pop("starts_pending", False):
        view["starting"] = ("w9",)
    if kw.pop("drains_due", False):
        view["draining"] = (members[-1],)
    if kw.pop("needs_state", False) or kw.pop("holders", True) is False:
        view["holders"] = ()
    return MembershipView(**{**view, **kw})


def S(**kw) -> Seen:
    """What the machines say: :class:`Seen`'s fields and the membership's (:func:`V`'s
    facts and shorthands), in one call."""
    view = {k: kw.pop(k) for k in list(kw) if k in _VIEW or k in _SAYS}
    return Seen(membership=V(**view), **kw)


def _memo(**kw: object) -> Memo:
    """What the reducer remembers, in a job whose data is loaded."""
    return Memo(data_loaded=True, **kw)


class Loop:
    """The reducer driven as the executor drives it: its state kept, each batch that does
    not end the step answered with the event its last effect yields (``answer``)."""

    def __init__(self, config: LoopConfig = CFG, state: LoopState | None = None) -> None:
        self.config = config
        self.state: LoopState = AtRest(_memo(polled_at=T0)) if state is None else state
        self.last: Effects = []

    def on(self, event: Event) -> Effects:
        self.state, self.last = step(self.state, event, self.config)
        return self.last

    def tick(self, seen: Seen, now: float = T0) -> Effects:
        return self.on(Boundary(seen, now))

    def ran(self, seen: Seen, ok: object = True, now: float = T0) -> Effects:
        """Answer the last batch: its last effect ran (``ok``: it formed, it all ran, its
        verdict, its offer, the segment it planned), and ``seen`` is what the machines say
        after it."""
        return self.on(answer(self.last[-1], seen, now, ok))

    def trains(self, seen: Seen, planned: SegmentOrder, now: float = T0) -> None:
        """Answer a :class:`PlanSegment` with ``planned``: that segment is run, and the
        loop's state carries it."""
        epoch = self.state.epoch
        assert self.ran(seen, planned, now) == [TrainSegment(planned)]
        assert self.state == Training(epoch, "segment", memo=self.state.memo, order=planned)

    def ends(self, seen: Seen, ok: object = True, now: float = T0) -> Effects:
        """Answer the last batch (a segment, ``ok``) with ``seen`` where the epoch is
        complete: it ends (``EndEpoch`` alone), and its end is answered with its record and
        the holders' shards; returns what the loop then does."""
        assert self.ran(seen, ok, now) == [EndEpoch()]
        assert isinstance(self.state, EndingEpoch) and self.state.record is None
        return self.ran(seen, (RECORD, SHARDS), now)


def closing(epoch: int) -> Effects:
    """An epoch's end with nothing due and nothing judged, once its record is built."""
    return [Evaluate(epoch, SHARDS, RECORD), NextEpoch()]


# keep_best's description of the best epoch so far (a judged epoch's Verdict).
BEST = {"metric": "loss", "mode": "min", "value": 0.5, "epoch": 0}
# A re-plan that changed the batches from step 5 of the segment in flight (to step 8).
OFFER = OfferedUpdate(
    Decision(Allocation(("w0", "w1"), (40, 24), (600, 400), 64, 1000), True, "affine"),
    early=5, end=8, why="adaptive check")
# Nodes listed after the first start: the missing workers started on them, spares tended.
PLACE = [Place()]
# Workers a placement starts: on a free node, and on a node holding the job's spare.
SPAWN = Spawn("w9", 9, "n9", 1.0, 0.0)
ADOPTING = Spawn("w8", 8, "n8", 1.0, 0.0, adopt=True)
START = [Place(starting=True)]
# An epoch's end with nothing due and nothing judged.
# An ended epoch's record (the executor's, opaque to the loop) and its evaluation's shards.
RECORD = "the epoch's record"
SHARDS = {"w0": (0, 60), "w1": (60, 100)}


def order(at: Position, ahead: Position | None = None, group: tuple[str, ...] = GROUP,
          sent: bool = False) -> SegmentOrder:
    """A segment of :data:`GROUP` planned at ``at`` (``sent``: the one in flight), with the
    one after it at ``ahead`` (the next epoch's first: behind the epoch's evaluation)."""
    plans = {w: SegmentPlan(at.epoch, 0, 1000, ()) for w in group}
    nxt = None
    if ahead is not None:
        shards = {w: (i, i + 1) for i, w in enumerate(group)} if ahead.epoch != at.epoch \
            else None
        nxt = SegmentOrder(ahead, {w: SegmentPlan(ahead.epoch, 0, 1000, ()) for w in group},
                           shards=shards)
    return SegmentOrder(at, plans, sent, nxt)


# A segment planned with the next to send ahead (it is in flight once it ran), and one alone.
AHEAD = order(Position(0, 0), ahead=Position(0, 4))
ALONE = order(Position(0, 0))
# Between boundaries in an open epoch; the same with a segment in flight; and with the next
# epoch's first segment in flight (sent across the epoch's end, which has ended).
OPEN = AtRest(_memo(polled_at=T0, epoch_open=True))
FLYING = AtRest(_memo(polled_at=T0, in_flight=True, epoch_open=True))
ACROSS = AtRest(_memo(polled_at=T0, in_flight=True))


def _requests_taken(loop: Loop, seen: Seen, now: float = T0) -> None:
    """A boundary at rest, up to its requests taken in (none drain anyone)."""
    assert loop.tick(seen, now) in ([TakeRequests()], [LoadData(), TakeRequests()])
    assert loop.ran(seen, now=now) == [AdoptStarted()]


# ------------------------------------------------------------------ what is due, from outside


def _checkpoint_due(cfg: LoopConfig, epoch: int) -> bool:
    """The job's checkpoint is written as ``epoch`` begins: every N epochs, and the last."""
    return cfg.checkpoint_dir and (epoch % cfg.checkpoint_every == 0 or epoch == cfg.epochs)


def _check_due(cfg: LoopConfig, seen: Seen) -> bool:
    """The rebalance rule re-plans before this step (``steps``: every N; ``adaptive``: at
    every boundary; ``epoch``: never inside an epoch)."""
    rule = cfg.rule
    if rule.mode == "epoch" or seen.step >= seen.steps_per_epoch:
        return False
    return rule.mode == "adaptive" or seen.step % rule.every_steps == 0


def _trained(cfg: LoopConfig, seen: Seen, memo: Memo) -> bool:
    """Every epoch is trained, or early stopping ended the training."""
    return seen.epoch >= cfg.epochs or memo.stopped is not None


def _ahead(cfg: LoopConfig, seen: Seen, retrying: bool) -> bool:
    """The next segment may be sent before this one's results are read: it is not a retry
    (``retrying``: the last segment did not all run), the next boundary need not have the
    group at rest, and its stamps do not wait on this one's losses."""
    return (seen.cancel is None and not retrying and not seen.requests
            and not seen.membership.moving and not seen.membership.dirty and not cfg.isgd)


def _across(cfg: LoopConfig, seen: Seen, retrying: bool) -> bool:
    """That next segment may be the next epoch's first: there is one, at the same batch,
    and nothing between the epochs reads the state or re-plans from the epoch's end."""
    nxt = seen.epoch + 1
    return (_ahead(cfg, seen, retrying) and nxt < cfg.epochs and not cfg.goodput
            and seen.next_batch == seen.batch and not cfg.judges_epochs
            and not _checkpoint_due(cfg, nxt)
            and not (cfg.rule.mode == "epoch" and not cfg.policy_static))


# ------------------------------------------------------------------ the property


@dataclass(frozen=True)
class Batch:
    """One decision: the state before it, the event, the effects, the state after."""

    before: LoopState
    event: Event
    effects: Effects
    after: LoopState

    @property
    def seen(self) -> Seen | None:
        return None if isinstance(self.event, Failed) else self.event.seen

    @property
    def body(self) -> Effects:
        """The effects past the workers stopped first."""
        return [e for e in self.effects if not isinstance(e, StopWorkers)]


rarely = st.sampled_from([False, False, False, True])  # so that most boundaries train
mostly = st.sampled_from([True, True, True, False])
cancels = st.sampled_from([None] * 7 + ["enough"])
verdicts = st.builds(Verdict, st.sampled_from([None, BEST]),
                     st.sampled_from([None, "early stopping: loss has not improved"]))


@st.composite
def views(draw) -> MembershipView:
    """Views a membership can be in: its holders are the first members in rank order."""
    first = draw(rarely)
    # () after the first start: every member was lost.
    members = () if first else draw(st.sampled_from([GROUP, GROUP, ("w2", "w0", "w1"), ()]))
    held = draw(st.sampled_from([len(members)] * 3 + [0, 1]))
    return MembershipView(
        generation=0 if first else draw(st.sampled_from([1, 1, 2])),
        members=members, holders=members[:held],
        starting=("w9",) if draw(rarely) else (),
        draining=members[-1:] if draw(rarely) else (),
        moving=members[:1] if draw(rarely) else (),
        dirty=draw(rarely), shortfall=draw(st.sampled_from([None, None, None, "1 of 2 workers"])))


seens = st.builds(
    Seen, cancel=cancels,
    # (trained mostly not: the epochs are 1 to 4, early stopping rare)
    epoch=st.sampled_from([0, 0, 0, 1, 1, 2, 4]), step=st.integers(0, 8),
    steps_per_epoch=st.sampled_from([4, 8]),
    recorded=st.integers(0, 2),
    batch=st.sampled_from([64, 64, 32]), next_batch=st.sampled_from([64, 64, 32]),
    requests=st.sampled_from([(), (), (), (), (), ("scale",), ("assign",), ("drain", "assign")]),
    membership=views(),
    leaving=st.sampled_from([(), (), (), ("w3",), ("w1", "w2")]))
configs = st.builds(
    LoopConfig, epochs=st.integers(1, 4),
    rule=st.sampled_from([RebalanceRule(), RebalanceRule("steps", every_steps=2),
                          RebalanceRule("adaptive")]),
    policy_static=st.booleans(), goodput=rarely, checkpoint_dir=st.booleans(),
    checkpoint_every=st.integers(1, 3), judges_epochs=rarely, isgd=rarely,
    start_timeout_s=st.just(5.0))
# Time between two events: listing the nodes falls due (NODE_POLL_S) now and then.
pauses = st.sampled_from([0.0, 0.0, 0.05, 0.3, 1.0])
failing = st.sampled_from([False] * 30 + [True])  # the failure policy fails the job


def _draw_seen(data: st.DataObject, cancel: str | None) -> Seen:
    """Random readings; a cancel once requested stays requested (the job's control never
    withdraws one)."""
    seen = data.draw(seens)
    return seen if cancel is None else replace(seen, cancel=cancel)


def _planned(plan: PlanSegment, seen: Seen, data: st.DataObject) -> SegmentOrder:
    """What the executor plans: a segment of the group where the protocol stands (at times
    the one in flight), and the one after it when asked, unless that is the next epoch's
    first and may not be."""
    at = Position(seen.epoch, seen.step)
    nxt = data.draw(st.sampled_from([Position(seen.epoch, seen.step + 1),
                                     Position(seen.epoch + 1, 0)]))
    ahead = nxt if plan.ahead and (plan.across or nxt.epoch == at.epoch) else None
    return order(at, ahead, seen.membership.members, sent=data.draw(st.booleans()))


def _boundary(loop: Loop, tick: Boundary, data: st.DataObject) -> list[Batch]:
    """One boundary: every decision, each answered with random readings after it (or the
    job failed in it), until one ends the step."""
    cancel = tick.seen.cancel
    batches: list[Batch] = []
    event: Event = tick
    now = tick.now
    for _ in range(24):
        before = loop.state
        effects = loop.on(event)
        batches.append(Batch(before, event, effects, loop.state))
        last = effects[-1]
        if isinstance(last, EndStep):
            return batches
        if data.draw(failing):
            event = Failed("the failure policy failed the job")
            continue
        now += data.draw(pauses)
        if isinstance(last, AwaitStarts):  # a wait takes its time: the deadline comes
            now += 2.0
        if isinstance(last, JudgeEpoch):  # the epoch's judgement comes with its answer
            ok = data.draw(verdicts)
        elif isinstance(last, Replan):  # a re-plan may offer an update to the segment in flight
            ok = data.draw(st.sampled_from([None, OFFER]))
        elif isinstance(last, Place):  # workers to start, spares (not at the first start)
            spares = SparePlan() if last.starting else data.draw(
                st.sampled_from([SparePlan(), SparePlan(), SparePlan(("n8",), ("n7",))]))
            ok = (data.draw(st.sampled_from([(), (), (SPAWN,), (ADOPTING, SPAWN)])), spares)
        elif isinstance(last, EndEpoch):  # its record, and the holders' shards (or none)
            ok = (RECORD, data.draw(st.sampled_from([None, SHARDS])))
        elif isinstance(last, PlanSegment):  # the next goes ahead only when asked, and
            # across the epoch's end only when it may
            ok = _planned(last, event.seen, data)
        else:
            ok = data.draw(st.booleans())
        event = answer(last, _draw_seen(data, cancel), now, ok)
        cancel = event.seen.cancel
    pytest.fail("a boundary did not end within 24 batches")


def _starts(b: Batch) -> bool:
    """The batch starts a placement's workers or tends its spares (answering ``Place``)."""
    return isinstance(b.event, Placed) and not b.event.nothing


def _asked(batches: list[Batch], i: int) -> Effect:
    """The last effect decided before batch ``i``, past the workers a placement started."""
    j = i - 1
    while _starts(batches[j]):
        j -= 1
    return batches[j].body[-1]


def _answer(batches: list[Batch], i: int) -> Batch | None:
    """The decision on the event that answered batch ``i`` (None: it ended the step)."""
    return batches[i + 1] if i + 1 < len(batches) else None


def _epoch_end(cfg: LoopConfig, batches: list[Batch], i: int) -> int:
    """Check the epoch's end decided at batch ``i`` (EndEpoch, alone: its record is built)
    and return the batch that decides what follows it: the epoch is evaluated on the shards
    its end answered with, its record attached; a checkpoint due or a judged epoch awaits
    the evaluation first; a judged epoch's checkpoints follow its judgement (the best so
    far; early stopping's when the job keeps checkpoints, a due one anyway), written as the
    next epoch's start; then the next epoch begins."""
    b = batches[i]
    epoch = b.seen.epoch
    at = Position(epoch + 1, 0)
    due = _checkpoint_due(cfg, epoch + 1)
    assert b.body == [EndEpoch()]
    assert isinstance(b.after, EndingEpoch) and b.after.epoch == epoch
    assert b.after.record is None
    ended = _answer(batches, i)
    if ended is None or ended.seen is None:  # it failed as the record was built
        return i + 1
    e = ended.event
    assert ended.body[:1] == [Evaluate(epoch, e.shards, e.record)]
    assert isinstance(ended.after, EndingEpoch) and ended.after.record is e.record
    if not cfg.judges_epochs:
        saves = [Settle(), Checkpoint("epoch", at)] if due else []
        assert ended.body[1:] == [*saves, NextEpoch()]
        return i + 2
    assert ended.body[1:] == [Settle(), JudgeEpoch()]
    judged = _answer(batches, i + 1)
    if judged is None or judged.seen is None:  # it failed while the evaluation was awaited
        return i + 2
    verdict = judged.event.verdict
    saves = [Checkpoint("best", at, BEST)] if verdict.best else []
    if due:
        saves.append(Checkpoint("epoch", at))
    elif verdict.stop and cfg.checkpoint_dir:
        saves.append(Checkpoint("early stopping", at))
    assert judged.body == [*saves, NextEpoch(verdict.stop)]
    # Early stopping's reason is remembered from then on (the job is trained).
    assert judged.after.memo.stopped == (verdict.stop or judged.before.memo.stopped)
    assert isinstance(judged.after, EndingEpoch) and judged.after.epoch == epoch
    assert judged.after.record is e.record
    return i + 3


def _check_boundary(cfg: LoopConfig, rest: LoopState, batches: list[Batch],
                    polled: float | None) -> float | None:
    """The loop's rules over one boundary; returns when the nodes were last listed."""
    tick = batches[0].event
    first = tick.seen
    flat = [e for b in batches for e in b.body]
    if isinstance(rest, Concluded):  # the job ended: nothing more
        assert flat == [EndStep(stop=True)] and batches[0].after is rest
        return polled
    in_flight = rest.memo.in_flight and first.cancel is None
    if not in_flight and first.cancel is None and "assign" in first.requests:
        polled = None  # an assignment's workers start at once: the nodes are listed now
    cancel_at = next((i for i, b in enumerate(batches) if isinstance(b.after, Cancelling)),
                     None)
    failed = isinstance(batches[-1].event, Failed)
    if cancel_at is not None and not failed:  # a cancel trains nothing new, stops the loop
        assert flat[-1] == EndStep(stop=True)
        after_cancel = [e for b in batches[cancel_at:] for e in b.body]
        assert not any(isinstance(e, (PlanSegment, TrainSegment, TakeRequests, ApplyDrains,
                                      Regroup, AbsorbAhead)) for e in after_cancel)
        for j, e in enumerate(after_cancel):  # only the segment in flight's epoch
            if isinstance(e, BeginEpoch):
                assert after_cancel[j + 1] == CommitInFlight()
        ends = [e for e in flat if isinstance(e, EndJob)]
        reason = batches[cancel_at].after.reason
        assert reason == batches[cancel_at].seen.cancel  # the cancel's, to the end
        assert all(b.after.reason == reason for b in batches[cancel_at:]
                   if isinstance(b.after, Cancelling))
        if ends and ends[0].outcome == JobState.CANCELLED:
            # the checkpoint holds what was trained; the cancel's reason ends the job
            j = flat.index(ends[0])
            assert ends[0] == EndJob(JobState.CANCELLED, reason)
            assert flat[j - 1] in (Checkpoint("cancel"), SaveModel("cancel"))
            assert Settle() in flat[:j]
    waits: list[float] = []  # when the first start's waits were decided
    for i, b in enumerate(batches):
        seen, effects, body = b.seen, b.effects, b.body
        if seen is None:  # the failure policy failed the job: it ends, once
            assert effects == [EndJob(JobState.FAILED, b.event.reason), EndStep(stop=True)]
            assert b.after == Concluded(JobState.FAILED, b.event.reason, b.before.memo)
            continue
        now = b.event.now
        prev = batches[i - 1] if i else None
        nxt = _answer(batches, i)
        answered = nxt.seen if nxt is not None else None
        # The job's public state is the loop's: RUNNING whenever it trains, PENDING while it
        # waits for workers, the outcome (the one EndJob carries out) once concluded.
        public = public_state(b.after)
        if any(isinstance(e, TrainSegment) for e in body):
            assert public is JobState.RUNNING
        if isinstance(b.after, Waiting):
            assert public is JobState.PENDING
        for e in body:
            if isinstance(e, EndJob):
                assert isinstance(b.after, Concluded) and public is e.outcome
        # Workers taken out are stopped first thing in the next batch, all of them, and only
        # then.
        assert (effects[:1] == [StopWorkers(seen.leaving)]) == bool(seen.leaving), effects
        assert sum(isinstance(e, StopWorkers) for e in effects) == bool(seen.leaving)
        assert body, "a batch is never empty"
        assert not any(isinstance(e, EndStep) for e in body[:-1])
        poll_due = polled is None or now - polled >= NODE_POLL_S
        for e in body:
            if isinstance(e, LoadData):
                assert not b.before.memo.data_loaded and b.after.memo.data_loaded
            if isinstance(e, BeginEpoch):  # only with none open (the last one closed)
                assert not b.before.memo.epoch_open
            if isinstance(e, EndJob) and e.outcome == JobState.SUCCEEDED:
                # After finishing awaited the last evaluations, with a holder left, and not
                # beside a pending cancel unless the cancel's own segment ended it.
                assert isinstance(b.before, Finishing) and prev.body[-1] == Settle()
                assert seen.membership.holders
                assert body == [SaveModel("end"), e, EndStep(stop=b.before.cancel is not None)]
                assert e.reason == b.before.memo.stopped
                assert seen.cancel is None or b.before.cancel is not None
                assert b.after == Concluded(JobState.SUCCEEDED, e.reason, b.before.memo)
            if isinstance(e, PlanSegment):
                # Decided to train by the readings of the batch that began training.
                began = next(x for x in batches if isinstance(x.after, Training))
                assert began.seen.cancel is None
                assert not _trained(cfg, began.seen, began.before.memo)
                assert b.after.memo.epoch_open and b.after.memo.data_loaded  # an open epoch
                # Sent ahead exactly when the next boundary need not have the group at rest;
                # across the epoch exactly when nothing between the epochs reads the state.
                retrying = b.before.memo.retrying
                assert e == PlanSegment(ahead=_ahead(cfg, seen, retrying),
                                        across=_across(cfg, seen, retrying))
                assert b.after == Training(seen.epoch, "planning", memo=b.after.memo)
            if isinstance(e, TrainSegment):  # the segment just planned, alone
                assert body == [e] and isinstance(b.event, SegmentPlanned)
                assert e.order is b.event.order
                assert b.after == Training(b.before.epoch, "segment", memo=b.after.memo,
                                           order=e.order)
            if isinstance(e, (TakeRequests, ApplyDrains, Regroup, AwaitStarts, GiveUpStarts)):
                # membership changes wait for a rest (an assignment's workers start now)
                assert not in_flight or e == TakeRequests(assignments=True)
            if isinstance(e, TakeRequests) and in_flight:
                assert i == 0 and seen.requests[:1] == ("assign",)
            if isinstance(e, TakeRequests) and not in_flight:  # alone; what it drains leaves
                assert i == 0 and body[-1] == e and e == TakeRequests()
                if answered is not None:
                    drain = [Settle(), ApplyDrains()] if answered.membership.draining else []
                    assert nxt.body == [*drain, AdoptStarted()]
            if isinstance(e, ApplyDrains):  # only right after the requests, when due
                assert seen.membership.draining and prev.body[-1] == TakeRequests()
                assert body[: body.index(e) + 1] == [Settle(), e]
        # Listing the nodes: when due, or at once after an assignment, a change or at the
        # first start; the first start's waits list them again to replace workers that
        # failed to start.
        polls = [e for e in body if isinstance(e, Place)]
        waited = prev is not None and prev.body[-1] == AwaitStarts()
        if in_flight and i == 0:
            assert bool(polls) == (poll_due or TakeRequests(assignments=True) in body)
        gathering = not in_flight and prev is not None and prev.body[-1] == AdoptStarted()
        if gathering:
            m = seen.membership
            assert bool(polls) == (m.first_start or m.dirty or poll_due)
        for e in polls:
            assert (in_flight and i == 0) or gathering or waited
            if waited:
                # None is left starting: those that failed to start are started again.
                assert e.starting and not seen.membership.starting
                assert body == START
            elif gathering:
                assert e.starting == seen.membership.first_start
            else:
                assert not e.starting
            polled = now
        if _starts(b):  # the placement's workers started, its spares tended, then as before
            e = b.event
            assert isinstance(prev.body[-1], Place) and isinstance(b.before, Reconciling)
            # (a spare adopted at rest is waited for: it joins this boundary's regroup)
            wait = b.before.stage != "watching" and any(sp.adopt for sp in e.spawns)
            start = [StartWorkers(e.spawns, wait)] if e.spawns else []
            tend = [TendSpares(e.spares)] if e.spares != SparePlan() else []
            assert body == [*start, *tend] and b.after == b.before
        assert b.after.memo.polled_at == polled  # when the loop last listed the nodes
        # A segment is in flight exactly when the last segment run's order sent one ahead;
        # the next is a retry exactly when the last did not all run.
        if isinstance(b.event, SegmentDone):
            assert b.after.memo.in_flight == (isinstance(prev.body[-1], TrainSegment)
                                              and prev.body[-1].order.ahead is not None)
            assert b.after.memo.retrying == (not b.event.all_ran)
        else:
            assert b.after.memo.in_flight == b.before.memo.in_flight
            assert b.after.memo.retrying == b.before.memo.retrying
        # The first start's wait: a little at a time while workers are starting; given up
        # once the start timeout (counted from the first wait) is over, or on a cancel.
        if isinstance(b.before, Reconciling) and b.before.stage == "awaiting" \
                and seen.membership.starting and not _starts(b):
            over = bool(waits) and now >= waits[0] + cfg.start_timeout_s
            assert body == ([GiveUpStarts()] if seen.cancel is not None or over
                            else [AwaitStarts()])
        for e in body:
            if isinstance(e, AwaitStarts):
                assert body == [e] and seen.membership.starting
                assert seen.cancel is None
                assert _asked(batches, i) in (Place(starting=True), AwaitStarts())
                waits.append(now)
                assert b.after.deadline == waits[0] + cfg.start_timeout_s
                assert now < b.after.deadline
                if answered is not None and not answered.membership.starting:
                    assert nxt.body == START  # none left starting: replace those that failed
            if isinstance(e, GiveUpStarts):
                assert body == [e] and seen.membership.starting
                assert seen.cancel is not None or (waits and now >= b.before.deadline)
                assert _asked(batches, i) in (Place(starting=True), AwaitStarts())
            if isinstance(e, WaitForMinimum):  # too few: wait, and the step ends
                assert e.shortfall == seen.membership.shortfall
                assert seen.cancel is None  # a pending cancel cancels instead
                assert body[-2:] == [e, EndStep()]
                # A wait goes on from the one the boundary began in, or starts now.
                assert e.since == (rest.since if isinstance(rest, Waiting) else None)
                since = now if e.since is None else e.since
                assert b.after == Waiting(since, e.shortfall, b.after.memo)
            if isinstance(e, LoadCheckpoint):  # no holder: the checkpoint first
                m = seen.membership
                assert m.dirty and m.shortfall is None
                assert m.needs_state and not b.before.memo.restored
                assert body == [Settle(), LoadCheckpoint()]  # the evaluations settled first
                if answered is not None:
                    # (the group planned after the roll-back: the rule below)
                    assert len(nxt.body) == 1 and isinstance(nxt.body[0], Regroup)
            if isinstance(e, Regroup):
                assert body == [e]
                # The membership's plan, its state restored weights when they wait.
                assert e.members == seen.membership.members
                assert e.source == ("checkpoint" if b.after.memo.restored else "holder")
                if not any(LoadCheckpoint() in x.body for x in batches):
                    m = seen.membership
                    assert m.dirty and m.shortfall is None
                    assert not m.needs_state or b.before.memo.restored
        if body[-1:] and isinstance(body[-1], Regroup) and answered is not None:
            if not nxt.event.formed:  # it failed: the step ends
                assert nxt.body == [EndStep()]
            else:
                # Formed mid-epoch: the rest of the epoch is split over the new group first.
                resplit = nxt.before.memo.epoch_open and not answered.epoch_complete
                assert (nxt.body[:1] == [Replan("membership")]) == resplit
                if resplit:
                    assert nxt.body == [Replan("membership")]
        if Replan("membership") in body:
            assert isinstance(prev.body[-1], Regroup) and len(prev.body) == 1
            assert b.event.formed
        if any(isinstance(e, TrainSegment) for e in body) and not in_flight:
            # Trained only with the group formed: no shortfall, no change pending. (With a
            # regroup, the readings that decided it had none: the rule above.)
            began = next(x for x in batches if isinstance(x.after, Training))
            if not any(isinstance(e, Regroup) for e in flat):
                assert began.seen.membership.shortfall is None
                assert not began.seen.membership.dirty
        if isinstance(body[-1], TrainSegment) and answered is not None:
            ok = nxt.event.all_ran
            if not ok and body[-1].order.ahead is not None:
                # Failed with the next segment sent: that one is absorbed, in the next epoch
                # when the failed one completed this.
                if not answered.epoch_complete:
                    assert nxt.body == [AbsorbAhead()]
                    assert nxt.after == Training(b.after.epoch, "absorbing",
                                                 memo=nxt.after.memo)
                    continue
                j = _epoch_end(cfg, batches, i + 1)
                if j < len(batches) and batches[j].seen is not None:
                    assert batches[j].body == [BeginEpoch(), AbsorbAhead()]
                    assert batches[j].after == Training(answered.epoch + 1, "absorbing",
                                                        memo=batches[j].after.memo)
                continue
            if answered.epoch_complete:
                assert nxt.body[:1] == [EndEpoch()]
            elif ok and _check_due(cfg, answered):  # a check re-plans only after a full run
                assert nxt.body == [Replan("check")]
            else:
                assert nxt.body == [PublishReady(), EndStep()]
        if isinstance(body[-1], Replan) and body[-1].cause != "membership" \
                and answered is not None:
            # A re-plan offered inside the segment in flight is posted at once, alone; then
            # the epoch's segment (at its opening) or the boundary's end.
            after = nxt
            if nxt.event.offer is not None:
                assert nxt.body == [PostPlanUpdate(nxt.event.offer)]
                after = _answer(batches, i + 1)
            if after is not None and after.seen is not None:
                if body[-1].cause == "check":
                    assert after.body == [PublishReady(), EndStep()]
                else:
                    assert len(after.body) == 1 and isinstance(after.body[0], PlanSegment)
        if AbsorbAhead() in body:  # what was sent ahead of a failed segment
            failed_at = [x for x in batches[:i] if x.body[-1:] and
                         isinstance(x.body[-1], TrainSegment)]
            assert failed_at
            if answered is not None:
                if answered.epoch_complete:
                    assert nxt.body[:1] == [EndEpoch()]
                else:
                    assert nxt.body == [PublishReady(), EndStep()]
        for e in body:
            if isinstance(e, PostPlanUpdate):  # only right after a re-plan offered one
                assert body == [e] and e.offer is b.event.offer is not None
                assert isinstance(prev.body[-1], Replan) and prev.body[-1].cause != "membership"
            if isinstance(e, EndEpoch):  # always the start of an epoch's end
                assert body[0] == e
            if isinstance(e, (JudgeEpoch, NextEpoch)) or (
                    isinstance(e, Checkpoint) and e.reason != "cancel"):
                # only in an epoch's end, written as the next epoch's start
                assert isinstance(body[0], Evaluate) or isinstance(prev.body[0], Evaluate)
            if isinstance(e, Evaluate):  # the ended epoch's, as soon as its record is built
                assert body[0] == e and prev.body == [EndEpoch()]
            if isinstance(e, Checkpoint) and e.reason == "cancel":
                assert e.position is None and isinstance(b.before, Cancelling)
                save = [SaveModel("cancel")] if seen.recorded or seen.step > 0 else []
                assert body == [e, *save, EndJob(JobState.CANCELLED, b.before.reason),
                                EndStep(stop=True)]
        absorbing = prev is not None and isinstance(prev.body[-1], TrainSegment) \
            and not b.event.all_ran and prev.body[-1].order.ahead is not None
        if body[:1] == [EndEpoch()]:
            j = _epoch_end(cfg, batches, i)
            if j < len(batches) and batches[j].seen is not None and not absorbing \
                    and cancel_at is None:
                after = batches[j]  # then finishing, or back
                m = after.seen
                if _trained(cfg, m, after.before.memo) and m.membership.holders:
                    assert after.body == [Settle()]
                    assert after.after == Finishing(None, after.after.memo)
                else:
                    assert after.body == [PublishReady(), EndStep()]
                    assert isinstance(after.after, AtRest)
        # Finishing only with every epoch trained and a holder of the final state.
        if isinstance(b.after, Finishing):
            assert _trained(cfg, seen, b.before.memo) and seen.membership.holders
        # An epoch is open from its BeginEpoch to its NextEpoch (or a roll-back).
        if EndEpoch() in body or AbsorbAhead() in body or CommitInFlight() in body:
            assert b.after.memo.epoch_open or NextEpoch() in body \
                or any(isinstance(e, NextEpoch) for e in body)
        if any(isinstance(e, (NextEpoch, LoadCheckpoint)) for e in body):
            assert not b.after.memo.epoch_open
    return polled


@settings(max_examples=500)  # cheap examples; the rules have many branches
@given(cfg=configs, first=seens, data=st.data())
def test_every_boundary_follows_the_loops_rules(cfg: LoopConfig, first: Seen,
                                                data: st.DataObject) -> None:
    # (the job may resume between boundaries with an epoch open, a segment in flight)
    flying = data.draw(st.booleans())
    opened = flying or data.draw(st.booleans())
    loop = Loop(cfg, AtRest(Memo(
        data_loaded=data.draw(mostly), polled_at=T0, in_flight=flying, epoch_open=opened,
        retrying=data.draw(rarely), restored=data.draw(rarely),
        stopped=data.draw(st.sampled_from([None] * 5 + ["early"])))))
    now, polled = T0, T0
    for _ in range(3):  # consecutive boundaries: each starts where the last left the loop
        rest = loop.state  # between boundaries: at rest, waiting for workers, or concluded
        assert isinstance(rest, (AtRest, Waiting, Concluded))
        batches = _boundary(loop, Boundary(first, now), data)
        polled = _check_boundary(cfg, rest, batches, polled)
        if batches[-1].effects[-1] == EndStep(stop=True):
            # The loop is over: it stays concluded, whatever comes.
            assert isinstance(loop.state, Concluded)
            ended = loop.state
            assert loop.on(Failed("again")) == [EndStep(stop=True)] and loop.state is ended
            assert loop.tick(S()) == [EndStep(stop=True)] and loop.state is ended
            break
        last = next(b.seen for b in reversed(batches) if b.seen is not None)
        now = batches[-1].event.now + data.draw(pauses)
        first = _draw_seen(data, last.cancel)


# ------------------------------------------------------------------ examples


def test_a_training_boundary() -> None:
    # Nothing between epoch 0 and 1 reads the state (no checkpoint due, a static policy):
    # a segment may be sent across; the steps rule re-plans every 4 steps.
    cfg = LoopConfig(epochs=3, policy_static=True, rule=RebalanceRule("steps", every_steps=4))
    loop = Loop(cfg, AtRest())  # the nodes never listed
    first = S(first_start=True)
    assert loop.tick(first) == [LoadData(), TakeRequests()]
    assert loop.ran(first) == [AdoptStarted()]
    assert loop.ran(first) == START
    assert loop.ran(S(first_start=True, starts_pending=True)) == [AwaitStarts()]
    # All came up: the missing ones (none) are started again, then the group forms.
    assert loop.ran(first) == START
    assert loop.ran(S(dirty=True)) == [REGROUP]
    assert public_state(loop.state) is JobState.PENDING
    assert loop.ran(S(), ok=True) == [BeginEpoch(), Replan()]
    assert loop.state == Training(0, "opening",
                                  memo=_memo(polled_at=T0, epoch_open=True, running=True))
    assert public_state(loop.state) is JobState.RUNNING
    opened = S(steps_per_epoch=16, batch=64, next_batch=64)
    assert loop.ran(opened) == [PlanSegment(ahead=True, across=True)]
    loop.trains(opened, AHEAD)
    # At step 4 the rule's check is due after a segment that all ran.
    assert loop.ran(replace(opened, step=4)) == [Replan("check")]
    assert loop.state.memo.in_flight  # the next segment was sent ahead
    assert loop.ran(replace(opened, step=4)) == [PublishReady(), EndStep()]
    # Next boundary, a segment in flight: no requests taken, no regroup; nodes listed once
    # due (NODE_POLL_S after they last were); it completes the epoch.
    in_flight = replace(opened, step=8, membership=V(dirty=True))
    assert loop.tick(in_flight, now=T0 + NODE_POLL_S / 2) == [AdoptStarted()]
    assert loop.ran(replace(in_flight, membership=V())) == [
        PlanSegment(ahead=True, across=True)]
    loop.trains(S(step=8), order(Position(0, 8), ahead=Position(1, 0)))
    assert loop.ends(S(step=1)) == closing(0)
    assert loop.ran(S()) == [PublishReady(), EndStep()]
    # The next epoch's first segment was sent across its end: that epoch begins (and is
    # planned) before the segment is collected.
    assert not loop.state.memo.epoch_open and loop.state.memo.in_flight
    second = replace(opened, epoch=1)
    assert loop.tick(second, now=LATER) == [AdoptStarted(), *PLACE]
    assert loop.state.memo.polled_at == LATER
    assert loop.ran(second) == [BeginEpoch(), Replan()]
    assert loop.ran(second) == [PlanSegment(ahead=True, across=True)]
    loop.trains(second, order(Position(1, 0)))
    # It failed, with nothing sent ahead of it.
    assert loop.ran(replace(second, step=13), ok=False) == [PublishReady(), EndStep()]
    assert not loop.state.memo.in_flight and loop.state.memo.retrying
    # Its retry runs alone (nothing is sent ahead of it); it failed after its last step's
    # collective and still completed the epoch.
    _requests_taken(loop, second, now=LATER)
    assert loop.ran(second, now=LATER) == [PlanSegment(ahead=False, across=False)]
    loop.trains(second, order(Position(1, 0)), now=LATER)
    assert loop.ends(S(epoch=1, step=1), ok=False) == closing(1)
    assert loop.ran(S()) == [PublishReady(), EndStep()]


@pytest.mark.parametrize(("cfg", "seen"), [
    (LoopConfig(epochs=3, checkpoint_dir=True), S()),  # a checkpoint due at epoch 1
    (LoopConfig(epochs=4, checkpoint_dir=True, checkpoint_every=2), S(epoch=1)),  # at 2
    (LoopConfig(epochs=3, judges_epochs=True), S()),  # its evaluation judges the epoch
    (LoopConfig(epochs=3, goodput=True), S()),  # the regime decides the next batch
    (LoopConfig(epochs=3), S()),  # the epoch's end re-plans from its speeds
    (LoopConfig(epochs=3, policy_static=True), S(next_batch=128)),  # the batch changes
    (LoopConfig(epochs=3, policy_static=True), S(epoch=2)),  # no next epoch
], ids=["checkpoint", "checkpoint-every-2", "judged", "goodput", "replans-at-end",
        "batch-changes", "last-epoch"])
def test_a_segment_goes_across_the_epochs_end_only_when_nothing_between_reads_the_state(
        cfg: LoopConfig, seen: Seen) -> None:
    seen = replace(seen, batch=64, next_batch=seen.next_batch or 64)
    loop = Loop(cfg, OPEN)
    _requests_taken(loop, seen)
    assert loop.ran(seen) == [PlanSegment(ahead=True, across=False)]
    # What makes it go across: a static policy, no checkpoint due, nothing judged.
    loop = Loop(LoopConfig(epochs=4, policy_static=True, checkpoint_dir=True,
                           checkpoint_every=2), OPEN)
    _requests_taken(loop, S())
    assert loop.ran(S(batch=64, next_batch=64)) == [
        PlanSegment(ahead=True, across=True)]


def test_nodes_are_listed_when_due_and_at_once_for_an_assignment() -> None:
    """The loop remembers when it listed the nodes (``Memo.polled_at``): a boundary at rest
    lists them again NODE_POLL_S later, or at once when it takes an assignment (its
    workers start now)."""
    loop = Loop(state=OPEN)
    _requests_taken(loop, S(), now=T0 + NODE_POLL_S / 2)
    assert loop.ran(S(), now=T0 + NODE_POLL_S / 2) == [
        PlanSegment(ahead=True, across=False)]
    assert loop.state.memo.polled_at == T0
    loop.trains(S(), ALONE)
    loop.ran(S())
    _requests_taken(loop, S(), now=LATER)
    assert loop.ran(S(), now=LATER) == PLACE
    assert loop.state.memo.polled_at == LATER
    assert loop.ran(S(), now=LATER) == [PlanSegment(ahead=True, across=False)]
    loop.trains(S(), ALONE, now=LATER)
    loop.ran(S())
    assign = S(requests=("assign",))
    assert loop.tick(assign, now=LATER) == [TakeRequests()]
    assert loop.ran(S(), now=LATER) == [AdoptStarted()]
    assert loop.ran(S(), now=LATER) == PLACE
    # With a segment in flight: only the assignment at the head of the queue is taken, its
    # workers started at once.
    loop = Loop(state=FLYING)
    queued = S(requests=("assign", "scale"))
    assert loop.tick(queued) == [TakeRequests(assignments=True), AdoptStarted(), *PLACE]
    loop = Loop(state=FLYING)
    queued = S(requests=("scale", "assign"))
    assert loop.tick(queued) == [AdoptStarted()]


def test_a_drain_waits_for_the_evaluations_in_flight() -> None:
    """A drained worker may still owe its shard of an evaluation: the requests are taken in,
    then the evaluations settle, then the drained workers leave (and the group regroups)."""
    loop = Loop()
    asked = S(requests=("drain",))
    assert loop.tick(asked) == [TakeRequests()]
    assert loop.ran(S(drains_due=True)) == [
        Settle(), ApplyDrains(), AdoptStarted()]
    changed = S(dirty=True)
    assert loop.ran(changed) == PLACE  # a changed group lists the nodes first
    assert loop.ran(changed) == [REGROUP]
    # A scale up drains nobody: nothing waits for the evaluations.
    loop = Loop()
    assert loop.tick(replace(asked, requests=("scale",))) == [TakeRequests()]
    assert loop.ran(S()) == [AdoptStarted()]


def test_a_replan_inside_the_segment_in_flight_is_posted_to_its_workers_at_once() -> None:
    # (a checkpoint due at epoch 1: nothing goes across)
    cfg = LoopConfig(epochs=3, rule=RebalanceRule("adaptive"), checkpoint_dir=True)
    loop = Loop(cfg, FLYING)
    # A check after a segment: the re-plan changed the batches from a step of the segment
    # sent ahead; it is posted before the boundary ends.
    flying = S(step=4, steps_per_epoch=16)
    assert loop.tick(flying) == [AdoptStarted()]
    assert loop.ran(flying) == [PlanSegment(ahead=True, across=False)]
    loop.trains(flying, AHEAD)
    assert loop.ran(flying) == [Replan("check")]
    assert loop.ran(flying, ok=OFFER) == [PostPlanUpdate(OFFER)]
    assert loop.ran(flying) == [PublishReady(), EndStep()]
    # The epoch's opening plan, with the next epoch's first segment already sent: posted,
    # then the segment.
    loop = Loop(cfg, ACROSS)
    assert loop.tick(S()) == [AdoptStarted()]
    assert loop.ran(S()) == [BeginEpoch(), Replan()]
    assert loop.ran(flying, ok=OFFER) == [PostPlanUpdate(OFFER)]
    assert loop.ran(flying) == [PlanSegment(ahead=True, across=False)]
    loop.trains(flying, ALONE)
    # A segment where a worker was lost re-plans nothing, whatever the rule says.
    assert loop.ran(flying, ok=False) == [PublishReady(), EndStep()]


def test_a_placement_starts_its_workers_and_tends_its_spares_before_going_on() -> None:
    """The nodes listed, the loop starts the workers the membership planned on them and
    tends the spares as planned; a spare adopted at rest is waited for (it joins this
    boundary's regroup), one adopted while a segment is in flight is not; with nothing to
    start the loop goes on at once."""
    loop = Loop(state=OPEN)
    _requests_taken(loop, S(dirty=True))
    assert loop.ran(S(dirty=True)) == PLACE
    spares = SparePlan(("n7",), ("n6",))
    assert loop.ran(S(dirty=True), ((ADOPTING, SPAWN), spares)) == [
        StartWorkers((ADOPTING, SPAWN), wait=True), TendSpares(spares)]
    assert loop.state.stage == "placing"
    assert loop.ran(S(dirty=True)) == [REGROUP]
    # In flight: started, not waited for; the segment's boundary goes on.
    loop = Loop(state=FLYING)
    assert loop.tick(S(), now=LATER) == [AdoptStarted(), *PLACE]
    assert loop.ran(S(), ((ADOPTING,), SparePlan()), now=LATER) == [
        StartWorkers((ADOPTING,), wait=False)]
    assert loop.ran(S(), now=LATER) == [PlanSegment(ahead=True, across=False)]
    # Nothing to start: on at once.
    loop = Loop(state=OPEN)
    _requests_taken(loop, S(dirty=True))
    loop.ran(S(dirty=True))
    assert loop.ran(S(dirty=True), ((), SparePlan())) == [REGROUP]


def test_every_member_lost_after_the_first_group_is_not_a_first_start() -> None:
    """The view's facts, not a flag: no member and no group formed yet is the first start
    (its workers are started and awaited); no member after a group formed is a lost group
    (the nodes are listed and workers placed, and the job waits for its minimum)."""
    first = S(first_start=True)
    assert first.membership.first_start
    loop = Loop()
    _requests_taken(loop, first)
    assert loop.ran(first) == START
    lost = S(group=(), dirty=True, shortfall="0 of 2 workers")
    assert lost.membership.generation == 1 and not lost.membership.first_start
    loop = Loop()
    _requests_taken(loop, lost)
    assert loop.ran(lost) == PLACE


def test_the_first_start_waits_for_its_workers_then_gives_up_those_not_up() -> None:
    """The first start's wait is the loop's: a little at a time while workers are starting;
    the ones that failed started again once none is left starting; those still starting
    given up once the start timeout is over (``Reconciling.deadline``, counted from the
    boundary's first wait: an earlier boundary's does not cut it) or on a cancel, which then
    cancels the job rather than wait for workers."""
    starting = S(first_start=True)
    waiting = replace(starting, membership=replace(starting.membership, starting=("w9",)))
    loop = Loop(LoopConfig(epochs=3, start_timeout_s=5.0))
    _requests_taken(loop, starting)
    assert loop.ran(starting) == START
    assert loop.state == Reconciling("awaiting", memo=_memo(polled_at=T0))
    assert loop.ran(waiting, now=T0 + 1) == [AwaitStarts()]
    assert loop.state.deadline == T0 + 6  # from the first wait
    assert loop.ran(waiting, now=T0 + 3) == [AwaitStarts()]
    assert loop.state.deadline == T0 + 6
    assert loop.ran(starting, now=T0 + 4) == START  # none left starting: replace the failed
    assert loop.ran(waiting, now=T0 + 5.9) == [AwaitStarts()]
    assert loop.state.deadline == T0 + 6
    assert loop.ran(waiting, now=T0 + 6) == [GiveUpStarts()]
    given_up = S(first_start=True, shortfall="0 of 2 workers",
                 leaving=("w0", "w1"))
    assert loop.ran(given_up, now=T0 + 6) == [
        StopWorkers(("w0", "w1")), WaitForMinimum("0 of 2 workers"), EndStep()]
    assert loop.state == Waiting(T0 + 6, "0 of 2 workers", _memo(polled_at=T0 + 4))

    # All up at the next boundary's first wait, long after the last deadline: the group
    # forms (nothing failed, nothing is started again).
    late = T0 + 60
    _requests_taken(loop, starting, now=late)
    assert loop.ran(starting, now=late) == START
    assert loop.ran(waiting, now=late) == [AwaitStarts()]
    assert loop.state.deadline == late + 5
    assert loop.ran(starting, now=late) == START
    assert loop.ran(S(dirty=True), now=late) == [REGROUP]

    # A cancel during the wait gives up at once; then the job is cancelled.
    loop = Loop()
    _requests_taken(loop, starting)
    assert loop.ran(starting) == START
    assert loop.ran(replace(waiting, cancel="enough")) == [GiveUpStarts()]
    gave_up = S(cancel="enough", shortfall="0 of 2", leaving=("w0",))
    assert loop.ran(gave_up) == [StopWorkers(("w0",)), Settle()]
    assert loop.state == Cancelling("enough", "settling", loop.state.memo)


@settings(max_examples=300)
@given(data=st.data())
def test_the_first_starts_wait_follows_its_rules(data: st.DataObject) -> None:
    """Random readings after every effect of the first start's wait (the big property above
    reaches it rarely): it waits while workers are starting, the first wait whatever time it
    is; once none is left starting after a wait, the ones that failed are started again;
    still starting past the deadline (the first wait's time plus the start timeout) or on a
    cancel, they are given up; the failure policy's Fail ends the job; otherwise who trains
    is known and the wait is over."""
    during = st.builds(
        S, cancel=cancels, first_start=st.booleans(),
        starts_pending=st.booleans(), shortfall=st.none() | st.just("0 of 2 workers"),
        dirty=st.booleans(), leaving=st.sampled_from([(), ("w1",)]))
    cfg = LoopConfig(epochs=3, start_timeout_s=5.0)
    loop = Loop(cfg)
    _requests_taken(loop, S(first_start=True))
    previous = loop.ran(S(first_start=True))
    assert previous == START
    now, first_wait = T0, None
    for _ in range(40):
        f = data.draw(during)
        now += data.draw(st.sampled_from([0.0, 0.5, 2.0, 4.0]))
        if data.draw(failing):
            assert loop.on(Failed("no workers")) == [
                EndJob(JobState.FAILED, "no workers"), EndStep(stop=True)]
            assert loop.state == Concluded(JobState.FAILED, "no workers", loop.state.memo)
            return
        effects = loop.ran(f, now=now)
        assert (effects[:1] == [StopWorkers(f.leaving)]) == bool(f.leaving)
        body = effects[1:] if f.leaving else effects
        if f.membership.starting:
            over = first_wait is not None and now >= first_wait + cfg.start_timeout_s
            if f.cancel is not None or over:
                assert body == [GiveUpStarts()]
                return
            assert body == [AwaitStarts()]
            first_wait = now if first_wait is None else first_wait
            assert loop.state.deadline == first_wait + cfg.start_timeout_s
        elif previous[-1] == AwaitStarts():
            assert body == START
            assert loop.state.deadline == first_wait + cfg.start_timeout_s
        else:  # who trains is known: no more waiting or starting at this boundary
            assert not any(isinstance(e, (AwaitStarts, GiveUpStarts, Place)) for e in body)
            return
        previous = body
    pytest.fail("the first start's wait did not end")


def test_a_group_formed_mid_epoch_resplits_the_rest_of_the_epoch_before_training() -> None:
    loop = Loop(state=OPEN)
    _requests_taken(loop, S())
    mid = S(dirty=True)
    assert loop.ran(mid) == PLACE
    assert loop.ran(mid) == [REGROUP]
    assert loop.ran(S(), ok=True) == [Replan("membership")]
    assert loop.state == Regrouping("resplitting", loop.state.memo)
    assert loop.ran(S()) == [PlanSegment(ahead=True, across=False)]
    loop.trains(S(), ALONE)
    # The re-split had nothing in flight to post to: a stray offer is not a re-plan's to
    # post, and the group trains on.
    assert loop.ran(S()) == [PublishReady(), EndStep()]
    _requests_taken(loop, S(), now=LATER)
    loop.ran(mid, now=LATER)
    loop.ran(mid, now=LATER)
    assert loop.ran(S(), ok=True) == [Replan("membership")]
    assert loop.ran(S(), ok=OFFER) == [PlanSegment(ahead=True, across=False)]
    # Between epochs (the next is planned when it begins), or the epoch complete: no
    # re-split.
    for state, between in ((AtRest(_memo(polled_at=T0)), S()), (OPEN, S(step=1))):
        loop = Loop(state=state)
        _requests_taken(loop, S())
        loop.ran(S(dirty=True))
        loop.ran(S(dirty=True))
        assert loop.ran(between, ok=True)[:1] != [Replan("membership")]


def test_workers_taken_out_are_stopped_before_anything_else() -> None:
    """A segment failed with a worker lost and the next segment sent: the lost worker is
    stopped before the one sent ahead is collected (what it queued then fails at once), and
    drained workers before the nodes are listed and workers spawned on them: exactly the
    workers the machines say are leaving."""
    loop = Loop(state=OPEN)
    _requests_taken(loop, S())
    loop.ran(S())
    loop.trains(S(), AHEAD)
    lost = S(leaving=("w1",))
    assert loop.ran(lost, ok=False) == [StopWorkers(("w1",)), AbsorbAhead()]
    assert loop.ran(S()) == [PublishReady(), EndStep()]
    assert loop.tick(S(requests=("drain",))) == [TakeRequests()]
    assert loop.ran(S(drains_due=True)) == [
        Settle(), ApplyDrains(), AdoptStarted()]
    drained = S(dirty=True, leaving=("w2", "w0"))
    assert loop.ran(drained) == [StopWorkers(("w2", "w0")), *PLACE]
    # At a boundary's start too, and once the job is over.
    assert loop.ran(S(dirty=True, leaving=("w4",))) == [
        StopWorkers(("w4",)), REGROUP]
    loop = Loop(state=Concluded(JobState.SUCCEEDED))
    assert loop.tick(S(leaving=("w3",))) == [StopWorkers(("w3",)), EndStep(stop=True)]


def test_what_was_sent_ahead_of_a_failed_segment_is_absorbed_in_its_epoch() -> None:
    loop = Loop(LoopConfig(epochs=4), OPEN)
    _requests_taken(loop, S(epoch=1))
    loop.ran(S(epoch=1))
    loop.trains(S(epoch=1), AHEAD)
    # The segment failed mid-epoch with the next one sent: that one is collected.
    assert loop.ran(S(epoch=1), ok=False) == [AbsorbAhead()]
    assert loop.state == Training(1, "absorbing", memo=loop.state.memo)
    assert loop.state.memo.in_flight
    assert loop.ran(S(epoch=1)) == [PublishReady(), EndStep()]
    assert not loop.state.memo.in_flight  # collected
    # It failed after completing the epoch, with the next epoch's first sent: the epoch
    # ends, the next begins, then the one sent ahead is absorbed (and may complete it).
    _requests_taken(loop, S(epoch=1))
    loop.ran(S(epoch=1))
    loop.trains(S(epoch=1), order(Position(1, 7), ahead=Position(2, 0)))
    done = S(step=1, epoch=1)
    assert loop.ends(done, ok=False) == closing(1)
    assert loop.state == EndingEpoch(1, "absorb", memo=loop.state.memo, record=RECORD)
    assert loop.ran(S(epoch=2)) == [BeginEpoch(), AbsorbAhead()]
    assert loop.state == Training(2, "absorbing", memo=loop.state.memo)
    assert loop.ends(S(step=1, epoch=2)) == closing(2)
    assert loop.state == EndingEpoch(2, "train", memo=loop.state.memo, record=RECORD)
    assert loop.ran(S(epoch=3)) == [PublishReady(), EndStep()]
    # A segment that failed with nothing sent ahead: nothing to absorb.
    _requests_taken(loop, S(epoch=3))
    assert loop.ran(S(epoch=3)) == [BeginEpoch(), Replan()]
    loop.ran(S(epoch=3))
    loop.trains(S(epoch=3), order(Position(3, 0)))
    assert loop.ran(S(epoch=3), ok=False) == [PublishReady(), EndStep()]


def test_an_epochs_end_awaits_its_evaluation_then_writes_the_checkpoints_it_calls_for() -> None:
    """A checkpoint due (the job keeps them: every N epochs, and after the last) or a judged
    epoch awaits the epoch's evaluation (the checkpoint holds its record, scores included);
    every checkpoint of an epoch's end is written as the next epoch's start."""
    loop = Loop(LoopConfig(epochs=4, checkpoint_dir=True, checkpoint_every=2))
    for epoch, due in [(0, False), (1, True), (2, False), (3, True)]:  # 2 by every, 4 last
        _requests_taken(loop, S(epoch=epoch))
        assert loop.ran(S(epoch=epoch)) == [BeginEpoch(), Replan()]
        loop.ran(S(epoch=epoch))
        loop.trains(S(epoch=epoch), ALONE)
        complete = S(step=1, epoch=epoch)
        saves = [Settle(), Checkpoint("epoch", Position(epoch + 1, 0))] if due else []
        assert loop.ends(complete) == [Evaluate(epoch, SHARDS, RECORD), *saves, NextEpoch()]
        assert loop.state == EndingEpoch(epoch, "train", due=due, memo=loop.state.memo,
                                         record=RECORD)
        # (after the last, the job finishes)
        assert loop.ran(S(epoch=epoch + 1)) == (
            [Settle()] if epoch == 3 else [PublishReady(), EndStep()])
    # A judged epoch (early stopping, keep_best): judged once its evaluation is in; the best
    # so far and early stopping's stop are written (early stopping's only when the job keeps
    # checkpoints), then the training ends.
    at = Position(2, 0)
    for best, stop, keeps, every, saves in [
        (True, True, True, 3, [Checkpoint("best", at, BEST), Checkpoint("early stopping", at)]),
        (False, True, False, 1, []),
        (True, False, True, 1, [Checkpoint("best", at, BEST), Checkpoint("epoch", at)]),
        (False, True, True, 2, [Checkpoint("epoch", at)]),
        (False, False, True, 3, []),
    ]:
        loop = Loop(LoopConfig(epochs=3, judges_epochs=True, checkpoint_dir=keeps,
                               checkpoint_every=every))
        _requests_taken(loop, S(epoch=1))
        loop.ran(S(epoch=1))
        loop.ran(S(epoch=1))
        loop.trains(S(epoch=1), ALONE)
        judged = S(step=1, epoch=1)
        assert loop.ends(judged) == [Evaluate(1, SHARDS, RECORD), Settle(), JudgeEpoch()]
        assert loop.state == EndingEpoch(1, "train", judging=True, due=keeps and every != 3,
                                         memo=loop.state.memo, record=RECORD)
        verdict = Verdict(BEST if best else None, "stopped" if stop else None)
        assert loop.ran(S(epoch=1), verdict) == [*saves, NextEpoch(verdict.stop)]
        assert loop.state == EndingEpoch(1, "train", memo=loop.state.memo, record=RECORD)
        assert loop.state.memo.stopped == verdict.stop
        trained = S(epoch=2, recorded=2)
        assert loop.ran(trained) == ([Settle()] if stop else [PublishReady(), EndStep()])
        if stop:  # early stopping's reason is the job's end
            assert loop.ran(trained) == [
                SaveModel("end"), EndJob(JobState.SUCCEEDED, "stopped"), EndStep()]
    # The job failed while the evaluation was awaited: it ends, nothing is written.
    loop = Loop(LoopConfig(epochs=3, judges_epochs=True, checkpoint_dir=True), OPEN)
    _requests_taken(loop, S())
    loop.ran(S())
    loop.trains(S(), ALONE)
    assert loop.ends(S(step=1))[-1] == JudgeEpoch()
    assert loop.on(Failed("evaluation: w0 raised")) == [
        EndJob(JobState.FAILED, "evaluation: w0 raised"), EndStep(stop=True)]


def test_a_cancel_commits_a_segment_sent_across_the_epochs_end_in_its_epoch() -> None:
    loop = Loop(state=ACROSS)
    assert loop.tick(S(cancel="enough")) == [BeginEpoch(), CommitInFlight()]
    assert loop.state == Cancelling("enough", "committing", loop.state.memo)


def test_too_few_workers_wait_and_a_failed_regroup_ends_the_step() -> None:
    loop = Loop()
    _requests_taken(loop, S())
    short = S(shortfall="1 of 2 workers", dirty=True)
    assert loop.ran(short) == PLACE  # the group changed: list nodes at once
    assert loop.ran(short) == [WaitForMinimum("1 of 2 workers"), EndStep()]
    _requests_taken(loop, S())
    assert loop.ran(S(dirty=True)) == PLACE  # (not due by the clock)
    assert loop.ran(S(dirty=True)) == [REGROUP]
    assert loop.ran(S(dirty=True), ok=False) == [EndStep()]
    assert isinstance(loop.state, AtRest)
    # No member holds the committed state: the checkpoint is loaded first (rolling back);
    # weights restored and not yet loaded (a regroup that failed after loading them) need
    # no second load.
    _requests_taken(loop, S())
    lost = S(dirty=True, needs_state=True)
    assert loop.ran(lost) == PLACE
    assert loop.ran(lost) == [Settle(), LoadCheckpoint()]
    assert loop.state == Regrouping("rolling_back", loop.state.memo)  # inside the regroup
    # The group planned after the roll-back, rank 0 loading the checkpoint's weights.
    restored = S(dirty=True, needs_state=True, group=("w1", "w0"))
    assert loop.ran(restored) == [Regroup(("w1", "w0"), "checkpoint")]
    assert loop.state == Regrouping("forming", loop.state.memo) and loop.state.memo.restored
    loop.ran(S(dirty=True), ok=False)
    _requests_taken(loop, S())
    loop.ran(lost)
    assert loop.ran(lost) == [Regroup(GROUP, "checkpoint")]
    # Formed: the weights are loaded, and the next regroup's state is a holder's.
    assert loop.ran(S(), ok=True) == [BeginEpoch(), Replan()]
    assert not loop.state.memo.restored


def test_a_wait_for_workers_is_the_loops_state_and_carries_since_when() -> None:
    """Too few workers: the loop rests ``Waiting`` since the wait began; a boundary that
    finds too few again goes on with that wait (the job fails once it is over its limit),
    one that trains ends it, and a later shortfall starts a new one."""
    loop = Loop()
    short = S(shortfall="1 of 2 workers")
    _requests_taken(loop, short, now=T0)
    assert loop.ran(short, now=T0) == [WaitForMinimum("1 of 2 workers"), EndStep()]
    assert loop.state == Waiting(T0, "1 of 2 workers", _memo(polled_at=T0))
    later = S(shortfall="1 of 2 workers (node01 lost)")
    _requests_taken(loop, later, now=T0 + 15)
    assert loop.state.waiting == Waiting(T0, "1 of 2 workers", _memo(polled_at=T0))
    assert loop.ran(later, now=T0 + 15) == PLACE  # the nodes listed (due): the wait goes on
    assert loop.ran(later, now=T0 + 15) == [
        WaitForMinimum(later.membership.shortfall, since=T0), EndStep()]
    assert loop.state == Waiting(T0, later.membership.shortfall, _memo(polled_at=T0 + 15))
    # Enough workers: the group trains, and the wait is over.
    _requests_taken(loop, S(), now=T0 + 15)
    assert loop.ran(S(), now=T0 + 15) == [BeginEpoch(), Replan()]
    assert loop.ran(S()) == [PlanSegment(ahead=True, across=False)]
    loop.trains(S(), ALONE)
    assert loop.ran(S()) == [PublishReady(), EndStep()]
    assert isinstance(loop.state, AtRest)
    again = S(shortfall="1 of 2 workers")
    _requests_taken(loop, again, now=T0 + 15.1)
    assert loop.ran(again, now=T0 + 15.1) == [WaitForMinimum("1 of 2 workers"), EndStep()]
    # (the epoch begun stays open)
    assert loop.state == Waiting(T0 + 15.1, "1 of 2 workers",
                                 _memo(polled_at=T0 + 15, epoch_open=True))
    # A cancel ends a wait at the next boundary.
    assert loop.tick(replace(again, cancel="enough"), now=T0 + 16) == [Settle()]
    assert loop.state == Cancelling("enough", "settling", loop.state.memo)


def test_a_cancel_while_the_group_formed_cancels_with_its_reason() -> None:
    loop = Loop()
    _requests_taken(loop, S())
    assert loop.ran(S(cancel="owner: enough")) == [Settle()]
    assert public_state(loop.state) is JobState.RUNNING  # its group formed, then cancelled
    assert loop.state == Cancelling("owner: enough", "settling", loop.state.memo)
    assert loop.ran(S(cancel="owner: enough", recorded=1)) == [
        Checkpoint("cancel"), SaveModel("cancel"),
        EndJob(JobState.CANCELLED, "owner: enough"), EndStep(stop=True)]
    assert loop.state == Concluded(JobState.CANCELLED, "owner: enough", loop.state.memo)


def test_a_cancel_commits_the_segment_in_flight_and_its_last_epoch_can_succeed() -> None:
    loop = Loop(state=FLYING)
    cancel = S(cancel="enough", epoch=2)
    assert loop.tick(cancel) == [CommitInFlight()]
    done = S(cancel="enough", step=1, epoch=2)
    assert loop.ends(done) == closing(2)
    assert loop.state == EndingEpoch(2, "cancel", memo=loop.state.memo, cancel="enough",
                                     record=RECORD)
    # That was the last epoch: the job finishes SUCCEEDED, not CANCELLED.
    trained = S(cancel="enough", recorded=3, epoch=3)
    assert loop.ran(trained) == [Settle()]
    assert loop.state == Finishing("enough", loop.state.memo)
    assert loop.ran(trained) == [
        SaveModel("end"), EndJob(JobState.SUCCEEDED), EndStep(stop=True)]
    # Not the last (of 4): back to cancelling, with the cancel's reason.
    loop = Loop(LoopConfig(epochs=4), FLYING)
    loop.tick(cancel)
    loop.ends(done)
    assert loop.ran(S(cancel="enough", recorded=3, epoch=3)) == [Settle()]
    assert loop.state == Cancelling("enough", "settling", loop.state.memo)
    assert loop.ran(S(cancel="enough", recorded=3, epoch=3)) == [
        Checkpoint("cancel"), SaveModel("cancel"), EndJob(JobState.CANCELLED, "enough"),
        EndStep(stop=True)]
    # Nothing was trained: no model goes out.
    loop = Loop()
    loop.tick(S(cancel="enough"))
    assert loop.ran(S(cancel="enough")) == [
        Checkpoint("cancel"), EndJob(JobState.CANCELLED, "enough"), EndStep(stop=True)]
    # A step of the first epoch trained: the model goes out.
    loop = Loop()
    loop.tick(S(cancel="enough"))
    assert SaveModel("cancel") in loop.ran(S(cancel="enough", step=3))


def test_a_failure_in_a_cancels_judged_epoch_end_concludes_and_stops_the_loop() -> None:
    # Found by test_every_boundary_follows_the_loops_rules in a fresh-clone run (the old
    # engine): a job ended while a cancel's epoch end awaited the evaluation must stop the
    # loop, as every cancel does.
    loop = Loop(LoopConfig(epochs=3, judges_epochs=True), FLYING)
    cancel = S(cancel="enough")
    assert loop.tick(cancel) == [CommitInFlight()]
    done = S(cancel="enough", step=1)
    assert loop.ends(done)[-1] == JudgeEpoch()
    assert loop.state == EndingEpoch(0, "cancel", judging=True, memo=loop.state.memo,
                                     cancel="enough", record=RECORD)
    assert loop.on(Failed("evaluation failed")) == [
        EndJob(JobState.FAILED, "evaluation failed"), EndStep(stop=True)]


def test_finishing_awaits_the_last_evaluations_and_yields_to_a_cancel_or_a_lost_holder():
    loop = Loop(state=OPEN)
    _requests_taken(loop, S(epoch=2))
    loop.ran(S(epoch=2))
    loop.trains(S(epoch=2), ALONE)
    assert loop.ends(S(step=1, epoch=2)) == closing(2)
    trained = S(recorded=3, epoch=3)  # (of 3)
    assert loop.ran(trained) == [Settle()]
    assert loop.state == Finishing(None, loop.state.memo)
    assert loop.ran(trained) == [SaveModel("end"), EndJob(JobState.SUCCEEDED), EndStep()]
    assert loop.state == Concluded(JobState.SUCCEEDED, None, loop.state.memo)
    # A cancel that came while the last evaluations were awaited wins at the next boundary.
    loop = Loop()
    _requests_taken(loop, S())
    assert loop.ran(trained) == [Settle()]
    assert loop.ran(replace(trained, cancel="enough")) == [EndStep()]
    assert isinstance(loop.state, AtRest)
    assert loop.tick(replace(trained, cancel="enough")) == [Settle()]
    # The last holder was lost meanwhile: the next boundary regroups and trains on.
    loop = Loop()
    _requests_taken(loop, S())
    loop.ran(trained)
    assert loop.ran(replace(trained, membership=V(holders=False))) == [EndStep()]
    assert isinstance(loop.state, AtRest)
    # Trained, but no holder: nothing to finish with yet.
    _requests_taken(loop, S())
    assert loop.ran(replace(trained, membership=V(holders=False))) == [EndStep()]


def _states() -> list[LoopState]:
    m = _memo(polled_at=T0)
    return [
        AtRest(m), Waiting(T0, "1 of 2", m), Reconciling("requests", memo=m),
        Reconciling("awaiting", adopted=True, deadline=T0 + 5, memo=m),
        Regrouping("forming", m), Training(1, "segment", memo=m),
        EndingEpoch(1, "train", judging=True, memo=m), Finishing(None, m),
        Cancelling("enough", "settling", m),
    ]


@pytest.mark.parametrize("state", _states(), ids=lambda s: type(s).__name__)
def test_a_failure_answers_any_state_and_concludes_the_job_once(state: LoopState) -> None:
    """The failure policy's Fail (or a bug) answers whatever batch was awaited: the job ends
    FAILED with its reason and the loop stops; the loop stays concluded, so a second failure
    or a later boundary changes nothing and ends nothing again."""
    loop = Loop(state=state)
    assert loop.on(Failed("segment: w1 raised 3 times")) == [
        EndJob(JobState.FAILED, "segment: w1 raised 3 times"), EndStep(stop=True)]
    ended = Concluded(JobState.FAILED, "segment: w1 raised 3 times", state.memo)
    assert loop.state == ended
    assert loop.on(Failed("internal error: again")) == [EndStep(stop=True)]
    assert loop.state == ended
    assert loop.tick(S(cancel="enough")) == [EndStep(stop=True)]
    assert loop.state == ended


def test_an_answer_nobody_waits_for_is_a_bug() -> None:
    loop = Loop()
    with pytest.raises(InvalidEvent, match="Done while AtRest"):
        loop.on(Done(S(), T0))
    loop.tick(S())
    with pytest.raises(InvalidEvent, match="Boundary while Reconciling"):
        _requests_taken(loop, S())
    # Once concluded, only a boundary (or a failure) is taken.
    loop = Loop(state=Concluded(JobState.SUCCEEDED))
    with pytest.raises(InvalidEvent, match="EvaluationsIn while Concluded"):
        loop.on(EvaluationsIn(S(), T0))


def test_each_state_takes_only_the_answer_its_batch_yields() -> None:
    """An executor that answers a batch with another effect's answer (a regroup's for a
    segment, a segment's for the requests) is refused, not read as something else."""
    loop = Loop()
    loop.tick(S())  # TakeRequests
    with pytest.raises(InvalidEvent, match="SegmentDone while Reconciling"):
        loop.on(SegmentDone(S(), T0, all_ran=False))
    loop = Loop(state=OPEN)
    _requests_taken(loop, S())
    assert loop.ran(S()) == [PlanSegment(ahead=True, across=False)]
    with pytest.raises(InvalidEvent, match="Regrouped while Training"):
        loop.on(Regrouped(S(), T0, formed=True))


@pytest.mark.parametrize(("effect", "kind"), [
    (TrainSegment(AHEAD), SegmentDone), (AbsorbAhead(), SegmentDone),
    (CommitInFlight(), SegmentDone), (PlanSegment(), SegmentPlanned),
    (REGROUP, Regrouped), (AdoptStarted(), WorkersStarted), (AwaitStarts(), WorkersStarted),
    (Place(), Placed), (StartWorkers((SPAWN,)), WorkersPlaced),
    (TendSpares(SparePlan()), WorkersPlaced),
    (TakeRequests(), RequestsTaken), (Settle(), EvaluationsIn), (JudgeEpoch(), EvaluationsIn),
    (NextEpoch(), Done), (Replan(), Replanned), (LoadCheckpoint(), Done),
    (GiveUpStarts(), Done), (PostPlanUpdate(OFFER), Done), (LoadData(), Done),
    (StopWorkers(("w1",)), Done),
])
def test_an_effect_is_answered_with_its_own_kind_of_event(effect: Effect, kind: type) -> None:
    seen = S()
    event = answer(effect, seen, 7.5, ok=ALONE if kind is SegmentPlanned else False)
    assert type(event) is kind and event.seen is seen and event.now == 7.5
    if kind is SegmentDone:
        assert event.all_ran is False
    if kind is Regrouped:
        assert event.formed is False
    if kind is Replanned:
        assert event.offer is None
    verdict = Verdict(BEST, "stopped")
    assert answer(JudgeEpoch(), seen, 7.5, verdict) == EvaluationsIn(seen, 7.5, verdict)
    assert answer(Replan("check"), seen, 7.5, OFFER) == Replanned(seen, 7.5, OFFER)
    # A segment's plan is answered with its order, and only with one.
    assert answer(PlanSegment(ahead=True), seen, 7.5, AHEAD) == SegmentPlanned(seen, 7.5, AHEAD)
    with pytest.raises(TypeError, match="SegmentOrder"):
        answer(PlanSegment(), seen, 7.5, True)
    # An epoch's end with its record and the holders' shards, and only with them.
    assert answer(EndEpoch(), seen, 7.5, (RECORD, SHARDS)) == EpochEnded(seen, 7.5, RECORD,
                                                                          SHARDS)
    with pytest.raises(TypeError, match="record and shards"):
        answer(EndEpoch(), seen, 7.5, True)


def test_nothing_answers_the_end_of_a_step() -> None:
    with pytest.raises(ValueError, match="EndStep"):
        answer(EndStep(), S(), T0)


def test_placing_and_giving_up_take_only_their_own_answers() -> None:
    # Found by the port to the reducer: the two states shared one case, so each took the
    # other's answer (a placement answered with Done trained on).
    cfg = LoopConfig(epochs=2)
    with pytest.raises(InvalidEvent, match="Done while Reconciling"):
        step(Reconciling("placing"), Done(S(), 0.0), cfg)
    with pytest.raises(InvalidEvent, match="WorkersPlaced while Reconciling"):
        step(Reconciling("giving_up"), WorkersPlaced(S(), 0.0), cfg)
    # Only a stage that placed takes a placement's answer, with workers to start or not.
    for stage in ("requests", "gathering", "giving_up"):
        with pytest.raises(InvalidEvent, match="Placed while Reconciling"):
            step(Reconciling(stage), Placed(S(), 0.0, (SPAWN,)), cfg)


def test_a_cancels_reason_is_the_states_through_its_epochs_end() -> None:
    # The cancel's reason rides in the states (committing, the epoch's end it completes,
    # settling) to EndJob, whatever a later reading says.
    cfg = LoopConfig(epochs=5)
    committing = Cancelling("owner: stop", "committing", _memo(epoch_open=True))
    state, _ = step(committing, SegmentDone(S(step=1, epoch=1), 0.0), cfg)
    assert isinstance(state, EndingEpoch) and state.cancel == "owner: stop"
    with pytest.raises(InvalidEvent, match="Done while EndingEpoch"):  # its record first
        step(state, Done(S(epoch=2), 0.0), cfg)
    state, effects = step(state, EpochEnded(S(step=1, epoch=1), 0.0, RECORD), cfg)
    assert effects == [Evaluate(1, None, RECORD), NextEpoch()]
    state, effects = step(state, Done(S(epoch=2), 0.0), cfg)
    assert (state, effects) == (Cancelling("owner: stop", "settling", _memo()), [Settle()])
    assert not state.memo.epoch_open  # (closed by the epoch's end)
    state, effects = step(state, EvaluationsIn(S(recorded=2), 0.0), cfg)
    assert effects[-2:] == [EndJob(JobState.CANCELLED, "owner: stop"), EndStep(stop=True)]
    state, _ = step(committing, SegmentDone(S(epoch=1, step=3, steps_per_epoch=8), 0.0), cfg)
    assert state == Cancelling("owner: stop", "settling", committing.memo)

"""The cluster scheduler's rounds: a pure state machine around :func:`decide`.

No Ray, no clock. The scheduler actor (``dynabatch.scheduler.runtime.cluster``) feeds it
events and executes the commands it returns:

* events: a job registered (its bounds, priority, submit time, slots per worker), finished
  or gone, its bounds changed, its telemetry (a :class:`ThroughputModel`, merged into what
  it measured before), the nodes seen now (a node
  that joined or was lost is a change of that set), a start that failed, the job's own
  drain of a worker (:class:`Drained`: one slot less, at once), and a :class:`Tick` at
  ``now``, the only event that decides;
* commands: :class:`Start` (launch a queued job's driver on these nodes) and
  :class:`Assign` (a running job trains on these nodes from its next step boundary).

What it keeps per job (:class:`Entry`): bounds, priority, submit time, its allocation,
when that last changed (the hold), whether its driver runs, and its model. A round builds
the policy's inputs from them, decides, and turns each changed plan into one command:

* a queued job is started only with a whole gang (``min_workers`` workers or more; the
  policy never grants less, and a plan below it is dropped here too);
* a running job's changed plan is one ``Assign`` (its resize);
* a running job is never sent back to the queue: a job has no pause, so the policy sees
  running jobs at the top priority, and a later job of higher priority waits for nodes a
  running job gives up (shrinking to its minimum) or frees by finishing.

:func:`rebuild` is the state a new scheduler starts from (after the API process or the
scheduler actor restarted): the live jobs as they run, each holding its nodes from
``now`` (so nothing moves before the hold, unless a node was lost), touching no job.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from dynabatch.scheduler.core.cluster.policy import decide
from dynabatch.scheduler.core.cluster.throughput import ThroughputModel, bootstrap
from dynabatch.scheduler.core.cluster.values import (
    GPU_UNITS,
    ClusterDecision,
    ClusterJob,
    ClusterKnobs,
    ClusterNode,
    JobPlan,
)
from dynabatch.scheduler.core.cluster.view import ClusterView, view_of

Slots = tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Entry:
    """One job the scheduler knows. ``started``: its driver was launched (it trains on
    ``allocation``); ``eligible``: the node types it may use (None: all). ``note``: why a
    start failed, shown while it waits again."""

    job_id: str
    min_workers: int
    max_workers: int
    priority: int = 0
    submit_s: float = 0.0
    allocation: Slots = ()
    last_resize_s: float | None = None
    started: bool = False
    model: ThroughputModel = ThroughputModel()  # noqa: RUF009 (a frozen value)
    eligible: frozenset[str] | None = None
    note: str | None = None
    worker_slots: int = 1
    gpu_units: int = GPU_UNITS

    @property
    def workers(self) -> int:
        return sum(n for _, n in self.allocation)


@dataclass(frozen=True, slots=True)
class RoundState:
    """Everything the rounds keep: nodes, jobs (by id), the last round's view, counters."""

    nodes: tuple[ClusterNode, ...] = ()
    jobs: tuple[Entry, ...] = ()
    round_no: int = 0
    resizes: int = 0
    view: ClusterView | None = None

    def job(self, job_id: str) -> Entry | None:
        return next((j for j in self.jobs if j.job_id == job_id), None)

    def _with(self, entry: Entry) -> RoundState:
        others = tuple(j for j in self.jobs if j.job_id != entry.job_id)
        return replace(self, jobs=tuple(sorted((*others, entry), key=lambda j: j.job_id)))

    def _without(self, job_id: str) -> RoundState:
        return replace(self, jobs=tuple(j for j in self.jobs if j.job_id != job_id))


# --- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LiveJob:
    """A job found running when a scheduler starts: its bounds and where its driver says it
    trains (its assignment, else its workers' nodes)."""

    job_id: str
    min_workers: int
    max_workers: int
    priority: int = 0
    submit_s: float = 0.0
    allocation: Slots = ()
    eligible: frozenset[str] | None = None
    worker_slots: int = 1
    gpu_units: int = GPU_UNITS


@dataclass(frozen=True, slots=True)
class Running:
    """A job found running (a new scheduler adopting it): it holds its nodes from ``now``,
    so nothing moves it before the hold, a lost node aside. No command follows."""

    job: LiveJob
    now: float


@dataclass(frozen=True, slots=True)
class Registered:
    """A job to place (a second registration of a known id changes nothing).
    ``worker_slots``: the slots one worker takes on a CPU node; ``gpu_units``: those it
    takes on a GPU node (:func:`~.nodes.gpu_units`)."""

    job_id: str
    min_workers: int
    max_workers: int
    priority: int = 0
    submit_s: float = 0.0
    eligible: frozenset[str] | None = None
    worker_slots: int = 1
    gpu_units: int = GPU_UNITS


@dataclass(frozen=True, slots=True)
class Finished:
    """The job ended, or its driver is gone: its nodes are free at the next round."""

    job_id: str


@dataclass(frozen=True, slots=True)
class Bounds:
    """The job's own scale request, recorded as new bounds for the next round."""

    job_id: str
    min_workers: int
    max_workers: int


@dataclass(frozen=True, slots=True)
class Measured:
    """The job's throughput per node type, from its telemetry."""

    job_id: str
    model: ThroughputModel


@dataclass(frozen=True, slots=True)
class NodesSeen:
    """The nodes alive now, with their types and worker slots."""

    nodes: tuple[ClusterNode, ...]


@dataclass(frozen=True, slots=True)
class StartFailed:
    """Its driver could not be launched: back to the queue, holding nothing."""

    job_id: str
    why: str


@dataclass(frozen=True, slots=True)
class Drained:
    """The job's owner drains one of its workers on ``node_id``: the job gives up that slot
    now (one ``Assign``, not a round: the owner chose the node, not the policy), and its
    bounds drop to what it keeps, so no later round hands the slot back (a scale request
    raises them again). Nothing changes when it would keep fewer than ``floor`` workers
    (its own ``min_workers``) or holds no slot there."""

    job_id: str
    node_id: str
    now: float
    floor: int = 1


@dataclass(frozen=True, slots=True)
class Tick:
    """Decide at ``now``."""

    now: float


Event = (
    Registered | Running | Finished | Bounds | Measured | NodesSeen | StartFailed | Drained | Tick
)


# --- commands --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """Launch the queued job's driver to train on ``slots`` (node id, workers)."""

    job_id: str
    slots: Slots

    @property
    def workers(self) -> int:
        return sum(n for _, n in self.slots)


@dataclass(frozen=True, slots=True)
class Assign:
    """The running job trains on ``slots`` from its next step boundary."""

    job_id: str
    slots: Slots

    @property
    def workers(self) -> int:
        return sum(n for _, n in self.slots)


Command = Start | Assign


# --- the machine -----------------------------------------------------------------------------


def step(
    state: RoundState,
    event: Event,
    knobs: ClusterKnobs,
    hints: Mapping[str, float] | None = None,
) -> tuple[RoundState, tuple[Command, ...]]:
    """The state after ``event``, and what to do now (commands come from a Tick, and the
    one ``Assign`` of a :class:`Drained`)."""
    match event:
        case Registered():
            if state.job(event.job_id) is not None:
                return state, ()
            entry = Entry(
                event.job_id,
                event.min_workers,
                event.max_workers,
                event.priority,
                event.submit_s,
                eligible=event.eligible,
                worker_slots=event.worker_slots,
                gpu_units=event.gpu_units,
            )
            return state._with(entry), ()
        case Running(job, now):
            known = state.job(job.job_id)
            entry = Entry(
                job.job_id,
                job.min_workers,
                job.max_workers,
                job.priority,
                job.submit_s,
                allocation=tuple(sorted(job.allocation)),
                last_resize_s=now,
                started=True,
                eligible=job.eligible,
                model=known.model if known is not None else ThroughputModel(),
                worker_slots=job.worker_slots,
                gpu_units=job.gpu_units,
            )
            return state._with(entry), ()
        case Finished(job_id):
            return state._without(job_id), ()
        case Bounds(job_id, lo, hi):
            entry = state.job(job_id)
            if entry is None:
                return state, ()
            return state._with(replace(entry, min_workers=lo, max_workers=hi)), ()
        case Measured(job_id, model):
            entry = state.job(job_id)
            if entry is None:
                return state, ()
            return state._with(replace(entry, model=_merged(entry.model, model))), ()
        case NodesSeen(nodes):
            return replace(state, nodes=tuple(sorted(nodes, key=lambda n: n.node_id))), ()
        case StartFailed(job_id, why):
            entry = state.job(job_id)
            if entry is None:
                return state, ()
            return state._with(
                replace(entry, started=False, allocation=(), last_resize_s=None, note=why)
            ), ()
        case Drained(job_id, node_id, now, floor):
            if drain_refusal(state, job_id, node_id, floor) is not None:
                return state, ()  # the caller words the refusal from the same reason
            entry = state.job(job_id)
            held = dict(entry.allocation)
            held[node_id] -= 1
            slots = tuple(sorted((n, k) for n, k in held.items() if k > 0))
            keeps = sum(k for _, k in slots)
            entry = replace(
                entry,
                allocation=slots,
                min_workers=min(entry.min_workers, keeps),
                max_workers=min(entry.max_workers, keeps),
                last_resize_s=now,
            )
            return replace(state._with(entry), resizes=state.resizes + 1), (Assign(job_id, slots),)
        case Tick(now):
            return _round(state, now, knobs, hints)
    raise TypeError(f"not a cluster event: {event!r}")


def drain_refusal(state: RoundState, job_id: str, node_id: str, floor: int) -> str | None:
    """Why a :class:`Drained` of ``job_id``'s worker on ``node_id`` changes nothing (None:
    it is taken): the job does not run, holds no slot on that node, or would keep fewer
    than ``floor`` workers (at least one)."""
    entry = state.job(job_id)
    if entry is None or not entry.started:
        return f"it does not run job {job_id}"
    held = dict(entry.allocation)
    if held.get(node_id, 0) < 1:
        return f"job {job_id} holds no slot on node {node_id}"
    keeps = sum(held.values()) - 1
    if keeps < max(1, floor):
        return f"refused: {keeps} workers would be below its min_workers {max(1, floor)}"
    return None


def _merged(old: ThroughputModel, new: ThroughputModel) -> ThroughputModel:
    """The job's model after a new measurement: the types measured now take their new
    rates, a type measured before and not now keeps its measurement (a job that moved off
    a type still knows its speed there: a measurement beats any estimate), and the
    overhead and global batch are the newest."""
    rates = {t: r for t, r in old.rates if t in old.measured}
    rates.update({t: r for t, r in new.rates if t in new.measured})
    return ThroughputModel.of(rates, old.measured | new.measured, new.overhead_s, new.global_batch)


def policy_jobs(
    state: RoundState, hints: Mapping[str, float] | None = None
) -> tuple[list[ClusterJob], list[ClusterJob]]:
    """The policy's view of the jobs: (as decided, as shown). Models are completed over the
    node types present (:func:`bootstrap`, unknown speeds from ``hints``, else equal), and
    a type outside a job's ``eligible`` ones gets rate 0. Decided: every running job at the
    top priority, so the policy never queues it; shown: their own priorities."""
    types = sorted({n.node_type for n in state.nodes})
    # Equal speeds by default, over the types present and those a job measured (its only
    # measured type may have no node left: the others are estimated from it).
    measured = {t for j in state.jobs for t in j.model.measured}
    hints = dict(hints) if hints else {t: 1.0 for t in {*types, *measured}}
    models = bootstrap({j.job_id: j.model for j in state.jobs}, types, hints)
    top = max((j.priority for j in state.jobs), default=0)
    shown, decided = [], []
    for j in state.jobs:
        model = models[j.job_id]
        if j.eligible is not None:
            model = ThroughputModel.of(
                {t: (r if t in j.eligible else 0.0) for t, r in model.rates},
                model.measured & j.eligible,
                model.overhead_s,
                model.global_batch,
            )
        job = ClusterJob(
            j.job_id,
            j.min_workers,
            j.max_workers,
            model,
            priority=j.priority,
            submit_s=j.submit_s,
            allocation=j.allocation,
            last_resize_s=j.last_resize_s,
            worker_slots=j.worker_slots,
            gpu_units=j.gpu_units,
        )
        shown.append(job)
        decided.append(replace(job, priority=top) if j.started else job)
    return decided, shown


def _round(
    state: RoundState, now: float, knobs: ClusterKnobs, hints: Mapping[str, float] | None
) -> tuple[RoundState, tuple[Command, ...]]:
    decided, shown = policy_jobs(state, hints)
    decision, stuck = _decide(state, decided, now, knobs)
    commands: list[Command] = []
    resizes = state.resizes
    new = state
    for plan in decision.plans:
        entry = state.job(plan.job_id)
        assert entry is not None
        if plan.job_id in stuck:
            new = new._with(replace(entry, allocation=plan.slots))
            continue
        if not plan.changed or not plan.slots:
            continue  # unchanged, or a queued job (a running one is never queued: see above)
        if not entry.started:
            if plan.workers < entry.min_workers:
                continue  # never a partial gang
            commands.append(Start(entry.job_id, plan.slots))
            new = new._with(
                replace(entry, started=True, allocation=plan.slots, last_resize_s=now, note=None)
            )
        else:
            commands.append(Assign(entry.job_id, plan.slots))
            resizes += 1
            new = new._with(replace(entry, allocation=plan.slots, last_resize_s=now))
    decision = _shown(decision, state)
    view = view_of(
        state.nodes,
        shown,
        decision,
        round_no=state.round_no + 1,
        decided_s=now,
        resizes=resizes,
    )
    return replace(new, round_no=state.round_no + 1, resizes=resizes, view=view), tuple(commands)


def _decide(
    state: RoundState, decided: list[ClusterJob], now: float, knobs: ClusterKnobs
) -> tuple[ClusterDecision, set[str]]:
    """:func:`decide`, except for a running job the policy would queue. That happens only
    when a lost node left it below ``min_workers`` with no room for them anywhere: its driver
    still runs its surviving workers (and waits for its minimum), so it keeps those slots,
    nobody else is given them, and it is placed again once slots free."""
    nodes = {n.node_id: n for n in state.nodes}
    by_id = {j.job_id: j for j in decided}
    stuck: dict[str, tuple[tuple[str, int], ...]] = {}
    while True:
        left = [j for j in decided if j.job_id not in stuck]
        free = [
            replace(
                n,
                capacity=n.capacity
                - sum(
                    k * by_id[jid].size_on(n)
                    for jid, s in stuck.items()
                    for m, k in s
                    if m == n.node_id
                ),
            )
            for n in nodes.values()
        ]
        decision = decide(free, left, now, knobs)
        newly = [p.job_id for p in decision.plans if p.queued and state.job(p.job_id).started]
        if not newly:
            break
        for jid in newly:
            room = {n.node_id: n.capacity // by_id[jid].size_on(n) for n in free}
            stuck[jid] = tuple(
                (m, min(k, room[m])) for m, k in state.job(jid).allocation if room.get(m, 0) > 0
            )
    plans = list(decision.plans)
    for jid, slots in stuck.items():
        entry = state.job(jid)
        by_type: dict[str, int] = {}
        for m, k in slots:
            by_type[nodes[m].node_type] = by_type.get(nodes[m].node_type, 0) + k
        plans.append(
            JobPlan(
                jid,
                slots,
                tuple(sorted(by_type.items())),
                False,
                f"keeps {sum(k for _, k in slots)} workers, below its min_workers "
                f"{entry.min_workers} after a node was lost: grows back when slots free",
            )
        )
    plans.sort(key=lambda p: p.job_id)
    return replace(decision, plans=tuple(plans)), set(stuck)


def _shown(decision: ClusterDecision, state: RoundState) -> ClusterDecision:
    """A queued job whose last start failed says why beside its place in the queue."""
    plans = []
    for p in decision.plans:
        entry = state.job(p.job_id)
        if p.queued and entry is not None and entry.note:
            p = replace(p, reason=f"{p.reason}; the last start failed: {entry.note}")
        plans.append(p)
    return replace(decision, plans=tuple(plans))


def rebuild(
    nodes: Iterable[ClusterNode],
    running: Sequence[LiveJob],
    queued: Sequence[Registered],
    now: float,
    knobs: ClusterKnobs | None = None,
) -> RoundState:
    """The state of a new scheduler: the running jobs as they are (:class:`Running`), each
    holding its nodes from ``now``, and the queued ones waiting. No command: nothing is
    touched until the first round."""
    knobs = knobs or ClusterKnobs()
    state, _ = step(RoundState(), NodesSeen(tuple(nodes)), knobs)
    for job in running:
        state, _ = step(state, Running(job, now), knobs)
    for job in queued:
        state, _ = step(state, job, knobs)
    return state

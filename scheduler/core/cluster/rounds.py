"""The cluster scheduler's rounds: a pure state machine around :func:`decide`.

No Ray, no clock: the scheduler actor (:mod:`dynabatch.scheduler.runtime.cluster_scheduler`)
feeds it events and executes the commands it returns. Only a :class:`Tick` decides; an
owner's request (scale, drain) is answered at once, outside the hold. docs/cluster.md, "The
scheduler that runs", says what each event and command means.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dynabatch.scheduler.core.cluster.decision import decide
from dynabatch.scheduler.core.cluster.ray_nodes import node_label
from dynabatch.scheduler.core.cluster.throughput import ThroughputModel, bootstrap, prior
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


def _workers(slots: Slots) -> int:
    return sum(n for _, n in slots)


@dataclass(frozen=True, slots=True)
class Entry:
    """One job the scheduler knows: what it asks (as :class:`ClusterJob`, plus ``eligible``
    node types (None: all), its coordinator's ``generation`` and ``client``: its own run
    launches it once granted) and its place in the rounds. ``started``: granted (its driver
    is launched or being launched); ``launched``: its driver is up; ``seen_s``: a client's
    run last heard from; ``note``: why a start failed; ``members``: its workers per node as
    it last reported them (None: no report yet); ``refused``: an assignment it refused and
    why; ``waits``: what an owner's request still waits for; ``said``: the reason an owner's
    request gave, shown until the next round; ``sent``: an assignment sent to its driver and
    not yet taken (a send that timed out or found no driver is sent again by the next
    round, as the job otherwise never hears of it), with ``leaving``, the workers it named
    to leave (an owner's drain)."""

    job_id: str
    min_workers: int
    max_workers: int
    priority: int = 0
    submit_s: float = 0.0
    allocation: Slots = ()
    eligible: frozenset[str] | None = None
    worker_slots: int = 1
    gpu_units: int = GPU_UNITS
    generation: int = 0
    client: bool = False
    last_resize_s: float | None = None
    started: bool = False
    launched: bool = False
    seen_s: float | None = None
    model: ThroughputModel = ThroughputModel()  # noqa: RUF009 (a frozen value)
    note: str | None = None
    members: Slots | None = None
    refused: tuple[Slots, str] | None = None
    waits: str | None = None
    said: str | None = None
    sent: Slots | None = None
    leaving: tuple[str, ...] = ()

    @property
    def workers(self) -> int:
        return _workers(self.allocation)

    def size_on(self, node: ClusterNode) -> int:
        """Slots one of its workers takes on ``node``."""
        return self.gpu_units if node.gpu else self.worker_slots


@dataclass(frozen=True, slots=True)
class RoundState:
    """Everything the rounds keep: nodes, jobs (by id), the last round's decision and view,
    counters. ``synced``: rounds decide (a new scheduler waits for the service's list of
    live jobs first). ``ended``: (job, generation) of each job whose driver the rounds saw
    end or die, while the service still lists it: what follows is the service's to decide
    (a resume registers the next generation), so that generation is never queued again."""

    nodes: tuple[ClusterNode, ...] = ()
    jobs: tuple[Entry, ...] = ()
    round_no: int = 0
    resizes: int = 0
    view: ClusterView | None = None
    decision: ClusterDecision | None = None
    decided_s: float = 0.0
    synced: bool = True
    ended: tuple[tuple[str, int], ...] = ()

    def job(self, job_id: str) -> Entry | None:
        return next((j for j in self.jobs if j.job_id == job_id), None)

    def _with(self, entry: Entry) -> RoundState:
        others = tuple(j for j in self.jobs if j.job_id != entry.job_id)
        return replace(self, jobs=tuple(sorted((*others, entry), key=lambda j: j.job_id)))

    def _without(self, job_id: str) -> RoundState:
        return replace(self, jobs=tuple(j for j in self.jobs if j.job_id != job_id))

    def has_ended(self, job_id: str, generation: int) -> bool:
        """The job's driver of ``generation`` (or a later one) was seen to end or die."""
        return any(j == job_id and g >= generation for j, g in self.ended)


# --- events ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class FoundRunning:
    """A job found running (a new scheduler adopting it): ``job`` with the allocation its
    driver trains on holds it from ``now``, so nothing moves it before the hold, a lost
    node aside. No command follows."""

    job: Entry
    now: float


@dataclass(frozen=True, slots=True)
class JobGone:
    """The job ended, or its driver is gone: its nodes are free at the next round, and its
    generation is :attr:`RoundState.ended`."""

    job_id: str


@dataclass(frozen=True, slots=True)
class Listed:
    """The service's live jobs (its sync): a held job not among them, a client run's aside,
    is dropped, and what ``ended`` says of jobs not among them is forgotten."""

    job_ids: frozenset[str]


@dataclass(frozen=True, slots=True)
class ResizeRequested:
    """The job's owner asks for ``workers`` workers: refused (a :class:`RequestRefused`) below 1,
    above what the cluster's nodes of its types could ever hold of its workers, or for a
    job the scheduler does not hold; else its bounds become ``min(its minimum, workers)``
    to ``workers`` and it is resized now as far as free slots allow (see the module
    docstring)."""

    job_id: str
    workers: int
    now: float


@dataclass(frozen=True, slots=True)
class JobReported:
    """The job's own report (its snapshot): each worker's node and speed (samples per
    compute-second, 0 when not measured yet), and its global batch. Its members per node
    are recorded; the speeds, per node type (the median of its workers there), are
    :class:`Measured`."""

    job_id: str
    workers: tuple[tuple[str, float], ...]
    global_batch: float = 1.0


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
class Launched:
    """The driver of ``job_id``'s ``generation`` is up, launched on ``slots``: a
    :class:`Run` (its workers start; not for a client's job, whose run runs it), preceded
    by an :class:`Reassign` of its newest allocation when a round moved it meanwhile; an
    :class:`Abandon` when the job is no longer held (cancelled or resumed meanwhile)."""

    job_id: str
    generation: int
    slots: Slots


@dataclass(frozen=True, slots=True)
class AssignRefused:
    """The job refused the assignment ``slots`` (``why``, its one line): it keeps what it
    has (its members, when it reported them), and no round sends the same assignment
    again; the view says so."""

    job_id: str
    slots: Slots
    why: str


@dataclass(frozen=True, slots=True)
class AssignTaken:
    """The job's driver took the assignment ``slots`` (its ``assign`` answered): it is no
    longer sent again."""

    job_id: str
    slots: Slots


@dataclass(frozen=True, slots=True)
class Heard:
    """A client job's run was heard from at ``now`` (its registration or grant poll)."""

    job_id: str
    now: float


@dataclass(frozen=True, slots=True)
class Drained:
    """The job's owner drains one of its workers on ``node_id``: the job gives up that slot
    now (one ``Reassign``, not a round: the owner chose the node, not the policy), and its
    bounds drop to what it keeps, so no later round hands the slot back (a scale request
    raises them again). A :class:`RequestRefused` when it would keep fewer than ``floor`` workers
    (its own ``min_workers``) or holds no slot there."""

    job_id: str
    node_id: str
    now: float
    floor: int = 1
    worker: str | None = None  # the one the owner named: it leaves (Reassign.leaving)


@dataclass(frozen=True, slots=True)
class Tick:
    """Decide at ``now``."""

    now: float


Event = (
    Entry
    | FoundRunning
    | JobGone
    | Listed
    | ResizeRequested
    | JobReported
    | NodesSeen
    | StartFailed
    | Launched
    | AssignRefused
    | AssignTaken
    | Heard
    | Drained
    | Tick
)


# --- commands --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """Launch the queued job's driver to train on ``slots`` (node id, workers)."""

    job_id: str
    slots: Slots

    @property
    def workers(self) -> int:
        return _workers(self.slots)


@dataclass(frozen=True, slots=True)
class Reassign:
    """The running job trains on ``slots`` from its next step boundary (``leaving``: the
    workers its owner drained leave first). Its executor answers with :class:`AssignTaken` or
    :class:`AssignRefused`; without either, the next round sends it again."""

    job_id: str
    slots: Slots
    leaving: tuple[str, ...] = ()

    @property
    def workers(self) -> int:
        return _workers(self.slots)


@dataclass(frozen=True, slots=True)
class Run:
    """Start the launched driver's workers."""

    job_id: str


@dataclass(frozen=True, slots=True)
class Abandon:
    """Kill the driver just launched for a job no longer held, before any worker starts."""

    job_id: str
    why: str


@dataclass(frozen=True, slots=True)
class Dropped:
    """The rounds dropped the job (``why``): forget its driver."""

    job_id: str
    why: str


@dataclass(frozen=True, slots=True)
class RequestRefused:
    """An owner's request is not carried out: ``why``, one line, is the answer."""

    job_id: str
    why: str


Command = Start | Reassign | Run | Abandon | Dropped | RequestRefused


# --- the machine -----------------------------------------------------------------------------


def step(
    state: RoundState,
    event: Event,
    knobs: ClusterKnobs,
) -> tuple[RoundState, tuple[Command, ...]]:
    """The state after ``event``, and what to do now."""
    state, commands = _step(state, event, knobs)
    for c in commands:
        if isinstance(c, Reassign) and (entry := state.job(c.job_id)) is not None:
            state = state._with(replace(entry, sent=tuple(sorted(c.slots)), leaving=c.leaving))
    if not isinstance(event, Tick) and state.decision is not None:
        state = replace(state, view=_view(state))
    return state, commands


def _step(
    state: RoundState,
    event: Event,
    knobs: ClusterKnobs,
) -> tuple[RoundState, tuple[Command, ...]]:
    known = state.job(getattr(event, "job_id", ""))
    if known is None and isinstance(
        event, JobReported | StartFailed | AssignRefused | AssignTaken | Heard
    ):
        return state, ()  # about a job the rounds no longer hold
    match event:
        case Entry():  # a job registered: a known id's same or older generation changes
            if known is not None and known.generation >= event.generation:  # nothing; a
                return state, ()  # later one (a resume) replaces it
            if known is None and state.has_ended(event.job_id, event.generation):
                return state, ()  # its driver ended or died: the service decides what next
            state = replace(state, ended=tuple(e for e in state.ended if e[0] != event.job_id))
            fresh = replace(
                event,
                allocation=(),
                last_resize_s=None,
                started=False,
                launched=False,
                members=None,
                refused=None,
                waits=None,
                said=None,
                note=None,
                sent=None,
                model=known.model if known is not None else event.model,
            )
            return state._with(fresh), ()
        case FoundRunning(job, now):
            known = state.job(job.job_id)
            entry = replace(
                job,
                allocation=tuple(sorted(job.allocation)),
                last_resize_s=now,
                started=True,
                launched=True,
                sent=None,
                model=known.model if known is not None else job.model,
            )
            return state._with(entry), ()
        case JobGone(job_id):
            if known is None:
                return state, ()
            ended = (*(e for e in state.ended if e[0] != job_id), (job_id, known.generation))
            return replace(state._without(job_id), ended=tuple(sorted(ended))), ()
        case Listed(ids):
            return replace(
                state,
                jobs=tuple(j for j in state.jobs if j.job_id in ids or j.client),
                ended=tuple(e for e in state.ended if e[0] in ids),
            ), ()
        case ResizeRequested():
            return _scale(state, event)
        case JobReported(job_id, workers, batch):
            entry = replace(known, members=tuple(sorted(Counter(n for n, _ in workers).items())))
            model = _model_of(state, workers, batch)
            if model is not None:
                entry = replace(entry, model=_merged(entry.model, model))
            return state._with(entry), ()
        case NodesSeen(nodes):
            return replace(state, nodes=tuple(sorted(nodes, key=lambda n: n.node_id))), ()
        case StartFailed(job_id, why):
            return state._with(
                replace(
                    known,
                    started=False,
                    launched=False,
                    allocation=(),
                    last_resize_s=None,
                    note=why,
                    sent=None,
                )
            ), ()
        case Launched(job_id, generation, slots):
            if known is None or known.generation != generation or not known.started:
                return state, (Abandon(job_id, "it left the queue while it was granted"),)
            commands: list[Command] = []
            if tuple(sorted(slots)) != known.allocation:
                commands.append(Reassign(job_id, known.allocation))
            if not known.client:
                commands.append(Run(job_id))
            # Launched on ``slots``: what it was sent before is taken (or resent here).
            return state._with(replace(known, launched=True, sent=None)), tuple(commands)
        case AssignRefused(job_id, slots, why):
            has = known.members if known.members else known.allocation
            entry = replace(known, refused=(tuple(sorted(slots)), why), allocation=has, sent=None)
            return state._with(entry), ()
        case AssignTaken(job_id, slots):
            if known.sent != tuple(sorted(slots)):
                return state, ()  # an older one: a newer assignment is still on its way
            return state._with(replace(known, sent=None)), ()
        case Heard(job_id, now):
            return state._with(replace(known, seen_s=now)), ()
        case Drained(job_id, node_id, now, floor, worker):
            why = drain_refusal(state, job_id, node_id, floor)
            if why is not None:
                return state, (RequestRefused(job_id, why),)
            held = dict(known.allocation)
            held[node_id] -= 1
            slots = tuple(sorted((n, k) for n, k in held.items() if k > 0))
            keeps = _workers(slots)
            entry = replace(
                known,
                allocation=slots,
                min_workers=min(known.min_workers, keeps),
                max_workers=min(known.max_workers, keeps),
                last_resize_s=now,
                waits=None,
                refused=None,
                said=f"drained one worker on node {node_label(node_id)} by its owner, keeps "
                     f"{keeps}",
            )
            return (replace(state._with(entry), resizes=state.resizes + 1),
                    (Reassign(job_id, slots, (worker,) if worker else ()),))
        case Tick(now):
            if not state.synced:
                return state, ()
            state, dropped = _drop_silent_clients(state, now, knobs)
            state, commands = _round(state, now, knobs)
            return state, (*dropped, *commands)
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
        return f"job {job_id} holds no slot on node {node_label(node_id)}"
    keeps = sum(held.values()) - 1
    if keeps < max(1, floor):
        return f"refused: {keeps} workers would be below its min_workers {max(1, floor)}"
    return None


def _free(state: RoundState) -> dict[str, int]:
    """Slots per node that no job holds."""
    free = {n.node_id: n.capacity for n in state.nodes}
    nodes = {n.node_id: n for n in state.nodes}
    for j in state.jobs:
        for node_id, k in j.allocation:
            if node_id in free:
                free[node_id] -= k * j.size_on(nodes[node_id])
    return free


def _scale(state: RoundState, event: ResizeRequested) -> tuple[RoundState, tuple[Command, ...]]:
    """An owner's scale (see :class:`ResizeRequested`)."""
    n, job_id = event.workers, event.job_id
    entry = state.job(job_id)
    if entry is None:
        return state, (RequestRefused(job_id, f"the cluster scheduler does not hold job {job_id}"),)
    if n < 1:
        return state, (RequestRefused(job_id, f"scale to {n}: a job needs at least 1 worker"),)
    # The most of its workers the alive nodes of its types could ever hold (every other job
    # gone).
    most = sum(
        x.capacity // entry.size_on(x)
        for x in state.nodes
        if entry.eligible is None or x.node_type in entry.eligible
    )
    if n > most:
        return state, (
            RequestRefused(
                job_id,
                f"scale to {n}: above the cluster's capacity for this job: the nodes of its "
                f"types hold {most} of its workers",
            ),
        )
    entry = replace(entry, min_workers=min(entry.min_workers, n), max_workers=n, refused=None)
    if not entry.started:
        waits = f"scale to {n}: starts with up to {n} workers once its gang is free"
        return state._with(replace(entry, waits=waits)), ()
    have = entry.workers
    if n == have:
        return state._with(replace(entry, waits=None)), ()
    if n < have:
        slots = _shrunk(entry.allocation, n)
        said = f"shrinks from {have} to {n} workers at its owner's request"
    else:
        slots = _grown(state, entry, n)
        said = f"grows from {have} to {_workers(slots)} workers at its owner's request"
    got = _workers(slots)
    waits = (
        None
        if got >= n
        else f"scale to {n}: has {got}; {n - got} more wait for free slots on its node types"
    )
    if got == have:
        return state._with(replace(entry, waits=waits)), ()
    entry = replace(entry, allocation=slots, last_resize_s=event.now, waits=waits, said=said)
    return replace(state._with(entry), resizes=state.resizes + 1), (Reassign(job_id, slots),)


def _shrunk(allocation: Slots, n: int) -> Slots:
    """``allocation`` less workers down to ``n``: off the nodes where it has fewest first
    (it stays on few nodes, as a round's shrink does), ties the higher node id first."""
    held = dict(allocation)
    drop = _workers(allocation) - n
    by_id = sorted(allocation, key=lambda kv: kv[0], reverse=True)
    for node_id, _ in sorted(by_id, key=lambda kv: kv[1]):
        if drop <= 0:
            break
        take = min(drop, held[node_id])
        held[node_id] -= take
        drop -= take
    return tuple(sorted((k, v) for k, v in held.items() if v > 0))


def _grown(state: RoundState, entry: Entry, n: int) -> Slots:
    """``entry``'s allocation grown toward ``n`` workers in the free slots of its node
    types: its own nodes first, then the nodes with most room (ties by node id)."""
    free = _free(state)
    held = dict(entry.allocation)
    want = n - entry.workers
    nodes = [x for x in state.nodes if entry.eligible is None or x.node_type in entry.eligible]
    nodes.sort(key=lambda x: (x.node_id not in held, -free[x.node_id], x.node_id))
    for node in nodes:
        if want <= 0:
            break
        take = min(want, max(0, free[node.node_id]) // entry.size_on(node))
        if take:
            held[node.node_id] = held.get(node.node_id, 0) + take
            want -= take
    return tuple(sorted(held.items()))


def _model_of(
    state: RoundState, workers: Sequence[tuple[str, float]], batch: float
) -> ThroughputModel | None:
    """The job's speed per node type: the median of its workers' speeds there (a worker on
    a node the rounds do not list, or not measured yet, counts for none)."""
    types = {n.node_id: n.node_type for n in state.nodes}
    per: dict[str, list[float]] = {}
    for node, speed in workers:
        if node in types and speed > 0:
            per.setdefault(types[node], []).append(speed)
    if not per:
        return None
    rates = {t: sorted(v)[len(v) // 2] for t, v in per.items()}
    return ThroughputModel.of(rates, rates, 0.0, float(batch or 1.0))


def _merged(old: ThroughputModel, new: ThroughputModel) -> ThroughputModel:
    """The job's model after a new measurement: the types measured now take their new
    rates, a type measured before and not now keeps its measurement (a job that moved off
    a type still knows its speed there: a measurement beats any estimate), and the
    overhead and global batch are the newest."""
    rates = {t: r for t, r in old.rates if t in old.measured}
    rates.update({t: r for t, r in new.rates if t in new.measured})
    return ThroughputModel.of(rates, old.measured | new.measured, new.overhead_s, new.global_batch)


def _drop_silent_clients(
    state: RoundState, now: float, knobs: ClusterKnobs
) -> tuple[RoundState, tuple[Command, ...]]:
    """Client jobs with no driver up whose run has not been heard from for
    ``client_lease_s`` (the run was killed while it waited) leave the rounds."""
    dropped = []
    for j in state.jobs:
        if (
            j.client
            and not j.launched
            and j.seen_s is not None
            and now - j.seen_s > knobs.client_lease_s
        ):
            state = state._without(j.job_id)
            dropped.append(Dropped(j.job_id, "its run is not heard from"))
    return state, tuple(dropped)


def policy_jobs(state: RoundState) -> tuple[list[ClusterJob], list[ClusterJob]]:
    """The policy's view of the jobs: (as decided, as shown). Models are completed over the
    node types present (:func:`bootstrap`, unknown speeds from the types'
    :func:`~.throughput.prior`), and a type outside a job's ``eligible`` ones gets rate 0.
    Decided: every running job at the top priority, so the policy never queues it, and a
    job an owner's request left short of its size not held; shown: as they are."""
    types = sorted({n.node_type for n in state.nodes})
    # The prior covers the types present and those a job measured (its only measured type
    # may have no node left: the others are estimated from it), so jobs that measured
    # nothing yet still see which types are fast and span them.
    measured = {t for j in state.jobs for t in j.model.measured}
    models = bootstrap(
        {j.job_id: j.model for j in state.jobs}, types, prior({*types, *measured})
    )
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
        if j.started:
            job = replace(job, priority=top)
        if j.waits is not None:
            job = replace(job, last_resize_s=None)  # the owner's request is not held
        decided.append(job)
    return decided, shown


def _in_units(
    nodes: Sequence[ClusterNode], jobs: Sequence[ClusterJob]
) -> tuple[list[ClusterNode], list[ClusterJob]]:
    """CPU nodes' capacities and workers' sizes there divided by their common divisor, so
    the policy counts (and words) one slot per worker when every worker takes one CPU: the
    same fits in smaller numbers."""
    unit = math.gcd(*(n.capacity for n in nodes if not n.gpu), *(j.worker_slots for j in jobs))
    if unit <= 1:
        return list(nodes), list(jobs)
    return (
        [n if n.gpu else replace(n, capacity=n.capacity // unit) for n in nodes],
        [replace(j, worker_slots=j.worker_slots // unit) for j in jobs],
    )


def _round(
    state: RoundState, now: float, knobs: ClusterKnobs
) -> tuple[RoundState, tuple[Command, ...]]:
    decided, _ = policy_jobs(state)
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
            entry = replace(
                entry, started=True, allocation=plan.slots, last_resize_s=now, note=None
            )
        elif entry.refused is not None and entry.refused[0] == plan.slots:
            continue  # the job refused exactly this: it keeps what it has
        else:
            commands.append(Reassign(entry.job_id, plan.slots))
            resizes += 1
            entry = replace(entry, allocation=plan.slots, last_resize_s=now, refused=None)
        new = new._with(entry)
    # An assignment its driver never answered (the call timed out, or no driver was found)
    # is sent again: not a move (no resize, no hold), the same decision delivered.
    moved = {c.job_id for c in commands}
    commands += [
        Reassign(j.job_id, j.allocation, j.leaving)
        for j in new.jobs
        if j.launched and j.sent is not None and j.sent == j.allocation and j.job_id not in moved
    ]
    # An owner's request done (or no longer wanted) waits for nothing; reasons are the
    # round's again.
    new = replace(
        new,
        jobs=tuple(
            replace(
                j,
                said=None,
                waits=None if j.started and j.workers >= j.max_workers else j.waits,
            )
            for j in new.jobs
        ),
    )
    new = replace(
        new,
        round_no=state.round_no + 1,
        resizes=resizes,
        decision=_shown(decision, state),
        decided_s=now,
    )
    return replace(new, view=_view(new)), tuple(commands)


def _decide(
    state: RoundState, decided: list[ClusterJob], now: float, knobs: ClusterKnobs
) -> tuple[ClusterDecision, set[str]]:
    """:func:`decide`, except for a running job the policy would queue. That happens only
    when a lost node left it below ``min_workers`` with no room for them anywhere: its driver
    still runs its surviving workers (and waits for its minimum), so it keeps those slots,
    nobody else is given them, and it is placed again once slots free."""
    in_units, decided = _in_units(state.nodes, decided)
    nodes = {n.node_id: n for n in in_units}
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
        plans.append(
            JobPlan(
                jid,
                slots,
                _by_type(state, slots),
                False,
                f"keeps {_workers(slots)} workers, below its min_workers "
                f"{entry.min_workers} after a node was lost: grows back when slots free",
            )
        )
    plans.sort(key=lambda p: p.job_id)
    return replace(decision, plans=tuple(plans)), set(stuck)


def _by_type(state: RoundState, slots: Slots) -> Slots:
    types = {n.node_id: n.node_type for n in state.nodes}
    by_type: dict[str, int] = {}
    for m, k in slots:
        if m in types:
            by_type[types[m]] = by_type.get(types[m], 0) + k
    return tuple(sorted(by_type.items()))


def _shown(decision: ClusterDecision, state: RoundState) -> ClusterDecision:
    """A queued job whose last start failed says why beside its place in the queue."""
    plans = []
    for p in decision.plans:
        entry = state.job(p.job_id)
        if p.queued and entry is not None and entry.note:
            p = replace(p, reason=f"{p.reason}; the last start failed: {entry.note}")
        plans.append(p)
    return replace(decision, plans=tuple(plans))


def differs(entry: Entry) -> str | None:
    """Why the job's members (its own report) are not its allocation, or None when they
    are the same or it has not reported yet: an assignment it refused, else the workers
    still to start or to leave, per node."""
    if entry.refused is not None:
        slots, why = entry.refused
        shown = ", ".join(f"{m}: {k}" for m, k in slots) or "no node"
        return f"the job refused the assignment ({shown}): {why}"
    if entry.members is None or not entry.started or entry.members == entry.allocation:
        return None
    want, have = dict(entry.allocation), dict(entry.members)
    parts = []
    for node in sorted({*want, *have}):
        more = want.get(node, 0) - have.get(node, 0)
        if more:
            each = "worker" if abs(more) == 1 else "workers"
            verb = "starting" if more > 0 else "draining"
            parts.append(f"{verb} {abs(more)} {each} on node {node_label(node)}")
    return "; ".join(parts) or None


def _view(state: RoundState) -> ClusterView | None:
    """The last round's decision as the jobs stand now: each known job's allocation (a
    request answered since the round included, with the reason it gave), members,
    ``differs`` and ``waits``; jobs gone since the round are left out."""
    if state.decision is None:
        return None
    _, shown = policy_jobs(state)
    plans = []
    for p in state.decision.plans:
        entry = state.job(p.job_id)
        if entry is None:
            continue
        if entry.started:
            p = replace(
                p,
                slots=entry.allocation,
                by_type=_by_type(state, entry.allocation),
                position=None,
                reason=entry.said or p.reason,
            )
        plans.append(p)
    decision = replace(
        state.decision,
        plans=tuple(plans),
        queue=tuple(q for q in state.decision.queue if state.job(q) is not None),
    )
    known = {p.job_id for p in plans}
    return view_of(
        state.nodes,
        [j for j in shown if j.job_id in known],
        decision,
        round_no=state.round_no,
        decided_s=state.decided_s,
        resizes=state.resizes,
        facts={j.job_id: (j.members, differs(j), j.waits) for j in state.jobs if j.job_id in known},
    )

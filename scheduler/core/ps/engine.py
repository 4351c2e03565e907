"""The parameter-server driver's decisions as a pure reducer: ``step(state, event) ->
(state, commands)``; the driver (``dynabatch.scheduler.ps.driver``) feeds it events made from
what its runtime reports and carries out the commands, on Ray or in the simulator alike. The
learners ride in :class:`Crew`; the job's public state is :func:`job_state` of the engine's;
time comes in on the events.

The rules: the start waits up to ``worker_wait_timeout_s`` for a node, then places
``initial_workers`` (one per node when unset) round the nodes, or on the assignment's slots.
A learner that ended normally is gone (the job finished); one whose process or node died
*leaves* (its in-flight samples re-queued, nobody regroups); one whose own code raised fails
the job (every learner would raise it). ``Assign`` keeps the fastest on their slots; a
scale-down removes the slowest (by samples applied per second since each joined). Each epoch
the server finished is recorded once, in order; one not verified exactly-once fails the job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from dynabatch.scheduler.core.lifecycle import InvalidEvent, JobState
from dynabatch.scheduler.core.membership import NodeAssignment, placement_plan, slowest_first
from dynabatch.scheduler.core.ps.messages import (
    AssignRequested,
    Command,
    DataLoaded,
    DrainRequested,
    DriverFailed,
    Event,
    ExportModel,
    Kill,
    LearnerEnded,
    Leave,
    ListNodes,
    Log,
    NodeAdded,
    NodesListed,
    Note,
    Polled,
    RecordEpoch,
    ScaleRequested,
    Sleep,
    SpawnLearner,
    StartServer,
)

NODE_POLL_S = 0.5  # how often the start lists the nodes while none can host a learner


@dataclass(frozen=True, slots=True)
class LearnerRecord:
    """A learner of the job: where it runs, its ordinal, and when it joined."""

    node: str
    ordinal: int
    joined: float


@dataclass(frozen=True, slots=True)
class Crew:
    """A running job's learners and what the engine knows of them: ``members`` (worker id →
    record), the ``next`` ordinal, the ``nodes`` as last listed (where a scale-up goes
    round), the samples each learner had applied at the last snapshot, the epochs
    ``recorded`` and when the last of them ended (``last_t``). A value: each step makes a
    new one."""

    members: Mapping[str, LearnerRecord] = field(default_factory=dict)
    next: int = 0
    nodes: tuple[str, ...] = ()
    applied: Mapping[str, float] = field(default_factory=dict)
    recorded: int = 0
    last_t: float | None = None


# --- the engine's states ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Starting:
    """Waiting for the dataset."""


@dataclass(frozen=True, slots=True)
class WaitingForNode:
    """The server is up: waiting for a node to host the first learners. ``deadline``: when
    the wait is over (None until the first listing)."""

    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Running:
    """The learners train; the driver's steps bring their exits, requests and the
    server's snapshot."""

    crew: Crew


@dataclass(frozen=True, slots=True)
class Scaling:
    """A scale request to ``workers`` learners waits for the nodes to be listed."""

    workers: int
    crew: Crew


@dataclass(frozen=True, slots=True)
class Ended:
    """The job is terminal: ``outcome`` (SUCCEEDED, FAILED or CANCELLED) and why."""

    outcome: JobState
    reason: str | None = None


EngineState = Starting | WaitingForNode | Running | Scaling | Ended


def job_state(state: EngineState) -> JobState:
    """The job's public state, derived from the engine's: PENDING until the first learners
    are placed, RUNNING while they train, then the outcome."""
    match state:
        case Running() | Scaling():
            return JobState.RUNNING
        case Ended(outcome):
            return outcome
    return JobState.PENDING


def learners(state: EngineState) -> dict[str, str]:
    """The job's learners in ``state``: worker id → node id (none before the start and after
    the end)."""
    if isinstance(state, Running | Scaling):
        return {w: m.node for w, m in state.crew.members.items()}
    return {}


Step = tuple[EngineState, list[Command]]


@dataclass(frozen=True, slots=True)
class PSEngine:
    """The parameter-server job's rules. ``initial_workers``: the job's first learners
    (None: one per node); ``wait_s``: how long the start waits for a node. :meth:`step` is
    pure."""

    initial_workers: int | None
    wait_s: float

    def step(self, state: EngineState, event: Event) -> Step:
        """The state after ``event`` and the commands to carry out, in order."""
        out: list[Command] = []  # the helpers below append to it
        match state, event:
            case Ended(), DriverFailed():
                return state, []  # the job ended already: its outcome stands
            case _, DriverFailed(reason):
                return Ended(JobState.FAILED, reason), []
            case Starting(), DataLoaded(problem, data):
                if problem is not None:
                    return Ended(JobState.FAILED, problem), []
                return WaitingForNode(), [StartServer(self.initial_workers or 0, data),
                                          ListNodes()]
            case WaitingForNode(deadline), NodesListed(nodes, now, assignment):
                if nodes:
                    return self._first_learners(nodes, now, assignment, out), out
                deadline = now + self.wait_s if deadline is None else deadline
                if now >= deadline:
                    return Ended(JobState.FAILED, "no eligible node for a learner"), []
                return WaitingForNode(deadline), [Sleep(NODE_POLL_S), ListNodes()]
            case Scaling(workers, crew), NodesListed(nodes, now):
                return Running(_scale(crew, workers, nodes, now, out)), out
            case Running(crew), ScaleRequested(workers):
                return Scaling(workers, crew), [ListNodes()]
            case Running(crew), DrainRequested(worker) if worker in crew.members:
                return Running(_remove(crew, worker, "drained", out)), out
            case Running(), DrainRequested():
                return state, []
            case Running(crew), AssignRequested(nodes, now):
                return Running(_place(crew, nodes, now, out)), out
            case Running(crew), LearnerEnded(worker, error, lost):
                return _ended(crew, worker, error, lost)
            case Running(crew), NodeAdded(node, assigned, now):
                # An assigned job grows onto no other node.
                return (state if assigned else Running(_spawn(crew, node, now, out))), out
            case Running(crew), Polled() as snap:
                return self._polled(crew, snap)
        raise InvalidEvent(f"{type(event).__name__} while {type(state).__name__}")

    def _first_learners(self, nodes: tuple[str, ...], now: float,
                        assignment: NodeAssignment | None, out: list[Command]) -> Running:
        crew = Crew(nodes=nodes)
        if assignment is not None:  # granted by the cluster scheduler before the start (its
            return Running(_place(crew, assignment, now, out))  # queued Assign finds nothing)
        for i in range(self.initial_workers or len(nodes)):
            crew = _spawn(crew, nodes[i % len(nodes)], now, out)
        return Running(crew)

    def _polled(self, crew: Crew, snap: Polled) -> Step:
        recorded, last_t = crew.recorded, crew.last_t
        if last_t is None and snap.started_s is not None:
            last_t = snap.started_s  # the first epoch is timed from the start barrier
        out: list[Command] = []
        for e in snap.epochs[recorded:]:
            out.append(RecordEpoch(e, e.t - (last_t or 0.0)))
            recorded, last_t = recorded + 1, e.t
            if not e.verified:
                why = f"epoch {e.epoch} not exactly once: " + "; ".join(e.problems[:3])
                return Ended(JobState.FAILED, why), out
        if snap.finished:
            return Ended(JobState.SUCCEEDED), [*out, ExportModel("end")]
        if snap.cancel is not None:
            export = [ExportModel("cancel")] if recorded else []  # it trained
            return Ended(JobState.CANCELLED, snap.cancel), [*out, *export]
        if not crew.members:
            return Ended(JobState.FAILED, "every learner was lost"), out
        return Running(replace(crew, applied=dict(snap.applied), recorded=recorded,
                               last_t=last_t)), out


# ---------------------------------------------------------------------- the decisions
# Each takes the crew and returns the new one, appending its commands to ``out``.
def _ended(crew: Crew, worker: str, error: str | None, lost: bool) -> Step:
    if worker not in crew.members:  # not a learner now (removed already)
        return Running(crew), []
    if error is None:  # finished normally: the job is finished
        return Running(_without(crew, worker)), []
    if not lost:  # its code raised: every learner would; the job fails
        return Ended(JobState.FAILED, error), [Log("ERROR", f"learner {worker} failed: {error}")]
    node = crew.members[worker].node  # its actor or node died: no regroup
    return Running(_without(crew, worker)), [Leave(worker), Note("failure", worker, node, error)]


def _scale(crew: Crew, workers: int, nodes: tuple[str, ...], now: float,
           out: list[Command]) -> Crew:
    crew = replace(crew, nodes=nodes or crew.nodes)
    while len(crew.members) < workers:
        crew = _spawn(crew, crew.nodes[crew.next % len(crew.nodes)], now, out)
    extra = max(0, len(crew.members) - workers)
    order = slowest_first([(w, m.ordinal) for w, m in crew.members.items()], _speeds(crew, now))
    for w in order[:extra]:
        crew = _remove(crew, w, f"scaled down to {workers}", out)
    return crew


def _place(crew: Crew, a: NodeAssignment, now: float, out: list[Command]) -> Crew:
    """Learners on exactly the assignment's slots, by the synchronous jobs' rule
    (:func:`placement_plan`: those it names ``leaving``, an owner's drain, go first; then the
    fastest keep their slots); a leaving learner's in-flight samples are re-queued."""
    workers = [(w, m.ordinal, m.node) for w, m in crew.members.items()]
    plan = placement_plan(workers, a, _speeds(crew, now))
    for w in reversed(plan.drain):  # the fastest leaver first
        crew = _remove(crew, w, "drained" if w in a.leaving else "assigned elsewhere", out)
    for node, k in plan.spawn:
        for _ in range(k):
            crew = _spawn(crew, node, now, out)
    return crew


# ---------------------------------------------------------------------- learners
def _spawn(crew: Crew, node: str, now: float, out: list[Command]) -> Crew:
    ordinal, w = crew.next, f"w{crew.next}"
    out += [SpawnLearner(w, ordinal, node), Note("join", w, node, "joined")]
    members = {**crew.members, w: LearnerRecord(node, ordinal, now)}
    return replace(crew, members=members, next=ordinal + 1)


def _remove(crew: Crew, w: str, why: str, out: list[Command]) -> Crew:
    """Stop learner ``w``: it leaves, its in-flight samples are re-queued."""
    out += [Kill(w), Leave(w), Note("leave", w, crew.members[w].node, why)]
    return _without(crew, w)


def _without(crew: Crew, w: str) -> Crew:
    return replace(crew, members={k: m for k, m in crew.members.items() if k != w})


def _speeds(crew: Crew, now: float) -> dict[str, float]:
    """Each learner's samples applied per second since it joined (none: not measured)."""
    speeds = {}
    for w, m in crew.members.items():
        applied, age = crew.applied.get(w), now - m.joined
        if applied is not None and age > 0:
            speeds[w] = applied / age
    return speeds

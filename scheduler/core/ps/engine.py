"""The parameter-server driver's decisions as a pure engine: events in, commands out.

The driver (``dynabatch.scheduler.ps.driver``) does not decide what a learner's exit, a
request or an epoch means; it feeds :class:`PSEngine` events made from what its runtime
reports and carries out the commands it gets back, on Ray or in the simulator alike. The
engine owns the job's learners (their nodes, ordinals and join times), the next ordinal
and the epochs recorded; time comes in on the events.

* **Starting** (:class:`DataLoaded`): a dataset the server cannot train fails the job;
  else the server starts, with a start barrier of ``initial_workers``, and the nodes are
  listed.
* **Waiting for a node** (:class:`NodesListed`): none yet, and the wait
  (``worker_wait_timeout_s``, from the first listing) not over: sleep and list again; over:
  the job fails. With nodes: learners on the assignment's slots when the job is assigned,
  else ``initial_workers`` (one per node when unset) round the nodes; the job is RUNNING.
* **Running**, between the driver's steps:

  - a learner that ended normally is gone (the job finished); one whose process or node
    died *leaves* (its in-flight samples re-queued; nobody regroups); one whose own code
    raised fails the job with that error (every learner would raise it);
  - a node added for the job gets a learner, unless the job trains on assigned nodes;
  - ``Assign``: learners on exactly the slots, the fastest keeping theirs; ``Drain``: the
    learner leaves; ``Scale``: the nodes are listed (*scaling*), then new learners go
    round them, or the slowest leave (by samples applied per second since each joined,
    one not measured yet first);
  - the server's snapshot: each epoch it finished is recorded once, in order (one not
    verified exactly-once fails the job); then the job ends: SUCCEEDED when the server
    says finished (its final training loss measured when wanted, the model exported),
    else CANCELLED at a pending cancel (the model exported once an epoch was recorded),
    else FAILED when every learner was lost.
* **Ended**: no event is expected (:class:`InvalidEvent`); the job's learners are gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.membership import NodeAssignment, slowest_first
from dynabatch.scheduler.core.ps.messages import (
    AssignRequested,
    Command,
    DataLoaded,
    DrainRequested,
    Event,
    ExportModel,
    Finish,
    Kill,
    LearnerEnded,
    Leave,
    ListNodes,
    Log,
    MarkRunning,
    MeasureFinalLoss,
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
from dynabatch.scheduler.core.sync.engine import InvalidEvent

NODE_POLL_S = 0.5  # how often the start lists the nodes while none can host a learner

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


@dataclass(frozen=True, slots=True)
class Scaling:
    """A scale request waits for the nodes to be listed."""

    workers: int


@dataclass(frozen=True, slots=True)
class Ended:
    """The job is terminal."""


EngineState = Starting | WaitingForNode | Running | Scaling | Ended


@dataclass(frozen=True, slots=True)
class LearnerRecord:
    """A learner of the job: where it runs, its ordinal, and when it joined."""

    node: str
    ordinal: int
    joined: float


class PSEngine:
    """The parameter-server job's decisions. :meth:`on` takes an event and returns the
    commands to carry out in order. ``initial_workers``: the job's first learners (None:
    one per node); ``wait_s``: how long the start waits for a node; ``final_loss``: measure
    the final weights' training loss at the end."""

    def __init__(self, initial_workers: int | None, wait_s: float, final_loss: bool = False):
        self.initial_workers = initial_workers
        self.wait_s = wait_s
        self.final_loss = final_loss
        self.state: EngineState = Starting()
        self._members: dict[str, LearnerRecord] = {}
        self._next = 0  # the next learner's ordinal
        self._nodes: tuple[str, ...] = ()  # as last listed: where a scale-up goes round
        self._applied: dict[str, float] = {}  # samples applied per learner, last snapshot
        self.epochs_recorded = 0
        self._last_t: float | None = None  # when the last recorded epoch ended

    @property
    def learners(self) -> dict[str, str]:
        """The job's learners now: worker id → node id."""
        return {w: m.node for w, m in self._members.items()}

    def on(self, event: Event) -> list[Command]:
        match self.state, event:
            case Starting(), DataLoaded(problem):
                if problem is not None:
                    return self._end(Finish(JobState.FAILED, problem))
                self.state = WaitingForNode()
                return [StartServer(self.initial_workers or 0), ListNodes()]
            case WaitingForNode(deadline), NodesListed(nodes, now, assignment):
                if nodes:
                    return self._first_learners(nodes, now, assignment)
                deadline = now + self.wait_s if deadline is None else deadline
                if now >= deadline:
                    return self._end(Finish(JobState.FAILED, "no eligible node for a learner"))
                self.state = WaitingForNode(deadline)
                return [Sleep(NODE_POLL_S), ListNodes()]
            case Scaling(workers), NodesListed(nodes, now):
                self.state = Running()
                return self._scale(workers, nodes, now)
            case Running(), ScaleRequested(workers):
                self.state = Scaling(workers)
                return [ListNodes()]
            case Running(), DrainRequested(worker):
                return self._remove(worker, "drained") if worker in self._members else []
            case Running(), AssignRequested(nodes, now):
                return self._place(nodes, now)
            case Running(), LearnerEnded(worker, error, lost):
                return self._ended(worker, error, lost)
            case Running(), NodeAdded(node, assigned, now):
                # An assigned job grows onto no other node.
                return [] if assigned else self._spawn(node, now)
            case Running(), Polled() as snap:
                return self._polled(snap)
        raise InvalidEvent(f"{type(event).__name__} while {type(self.state).__name__}")

    def stop(self) -> None:
        """The job ended outside the engine (the driver failed it on an error, or shut it
        down): its learners are gone and it takes no more events."""
        self.state = Ended()
        self._members.clear()

    # ------------------------------------------------------------------ the decisions
    def _first_learners(
        self, nodes: tuple[str, ...], now: float, assignment: NodeAssignment | None
    ) -> list[Command]:
        self._nodes = nodes
        self.state = Running()
        if assignment is not None:  # granted by the cluster scheduler before the start (its
            out = self._place(assignment, now)  # queued Assign then finds nothing to do)
        else:
            out = []
            for i in range(self.initial_workers or len(nodes)):
                out += self._spawn(nodes[i % len(nodes)], now)
        return [*out, MarkRunning()]

    def _ended(self, worker: str, error: str | None, lost: bool) -> list[Command]:
        if worker not in self._members:  # not a learner now (removed already)
            return []
        if error is None:  # finished normally: the job is finished
            del self._members[worker]
            return []
        if not lost:  # its code raised: every learner would; the job fails
            return self._end(
                Log("ERROR", f"learner {worker} failed: {error}"), Finish(JobState.FAILED, error)
            )
        node = self._members.pop(worker).node  # its actor or node died: no regroup
        return [Leave(worker), Note("failure", worker, node, error)]

    def _scale(self, workers: int, nodes: tuple[str, ...], now: float) -> list[Command]:
        self._nodes = nodes or self._nodes
        out: list[Command] = []
        while len(self._members) < workers:
            out += self._spawn(self._nodes[self._next % len(self._nodes)], now)
        extra = max(0, len(self._members) - workers)
        for w in self._slowest_first(now)[:extra]:
            out += self._remove(w, f"scaled down to {workers}")
        return out

    def _place(self, a: NodeAssignment, now: float) -> list[Command]:
        """Learners on exactly the assignment's slots: on each node the slowest beyond its
        slots leave (all of them on a node no longer assigned), then empty slots get new
        learners. A leaving learner's in-flight samples are re-queued, as on a drain."""
        keep: dict[str, int] = {}
        out: list[Command] = []
        for w in reversed(self._slowest_first(now)):  # the fastest first keep their slots
            node = self._members[w].node
            if keep.get(node, 0) < a.get(node):
                keep[node] = keep.get(node, 0) + 1
            else:
                out += self._remove(w, "assigned elsewhere")
        for node, k in a.slots:
            for _ in range(k - keep.get(node, 0)):
                out += self._spawn(node, now)
        return out

    def _polled(self, snap: Polled) -> list[Command]:
        self._applied = dict(snap.applied)
        if self._last_t is None and snap.started_s is not None:
            self._last_t = snap.started_s  # the first epoch is timed from the start barrier
        out: list[Command] = []
        for e in snap.epochs[self.epochs_recorded :]:
            out.append(RecordEpoch(self.epochs_recorded, e.t - (self._last_t or 0.0)))
            self.epochs_recorded += 1
            self._last_t = e.t
            if not e.verified:
                why = f"epoch {e.epoch} not exactly once: " + "; ".join(e.problems[:3])
                return self._end(*out, Finish(JobState.FAILED, why))
        if snap.finished:
            loss = [MeasureFinalLoss()] if self.final_loss else []
            return self._end(*out, *loss, ExportModel("end"), Finish(JobState.SUCCEEDED))
        if snap.cancel is not None:
            export = [ExportModel("cancel")] if self.epochs_recorded else []  # it trained
            return self._end(*out, *export, Finish(JobState.CANCELLED, snap.cancel))
        if not self._members:
            return self._end(*out, Finish(JobState.FAILED, "every learner was lost"))
        return out

    # ------------------------------------------------------------------ learners
    def _spawn(self, node: str, now: float) -> list[Command]:
        ordinal = self._next
        self._next += 1
        w = f"w{ordinal}"
        self._members[w] = LearnerRecord(node, ordinal, now)
        return [SpawnLearner(w, ordinal, node), Note("join", w, node, "joined")]

    def _remove(self, w: str, why: str) -> list[Command]:
        """Stop learner ``w``: it leaves, its in-flight samples are re-queued."""
        node = self._members.pop(w).node
        return [Kill(w), Leave(w), Note("leave", w, node, why)]

    def _slowest_first(self, now: float) -> list[str]:
        """Learners in the order a scale-down removes them: by samples applied per second
        since each joined, the slowest first (one with none applied yet first of all)."""
        speeds = {}
        for w, m in self._members.items():
            applied, age = self._applied.get(w), now - m.joined
            if applied is not None and age > 0:
                speeds[w] = applied / age
        return slowest_first([(w, m.ordinal) for w, m in self._members.items()], speeds)

    def _end(self, *commands: Command) -> list[Command]:
        self.stop()
        return list(commands)

"""Membership: who is in, who holds the current model state, what to spawn or evict.

Pure: no ray, no torch, no clock. The driver reports what happened (nodes seen, a worker
started or was lost, a segment's progress, a regroup done) and asks what to do next. A
member *holds the current state* when its version (the (epoch, step) its weights reached)
is the job's committed one; a regroup broadcasts from a holder, and with none left the
driver must load a checkpoint or fail, never continue from fresh weights. Placement,
spares, assignments and bounds: docs/elasticity.md ("Scale up", "Train on these nodes",
"Spares", "Bounds").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dynabatch.scheduler.core.cluster.ray_nodes import node_label
from dynabatch.scheduler.core.sync.protocol import Position

ORIGIN = Position(0, 0)


def worker_bounds(smallest_batch: int, largest_batch: int, max_batch: int | None
                 ) -> tuple[int, int]:
    """The fewest and the most workers that can train at every global batch from
    ``smallest_batch`` to ``largest_batch``: ``max_batch`` samples each must hold the
    largest, and each worker needs at least one sample of the smallest (the one rule:
    the membership's bounds and the service's scale check use it)."""
    return (math.ceil(largest_batch / max_batch) if max_batch else 1), smallest_batch


def scale_error(workers: int, smallest_batch: int, largest_batch: int,
                max_batch: int | None) -> str | None:
    """Why ``workers`` workers cannot train at every global batch from ``smallest_batch``
    to ``largest_batch`` (:func:`worker_bounds`), or None when they can."""
    lo, hi = worker_bounds(smallest_batch, largest_batch, max_batch)
    if workers > hi:
        return (f"workers ({workers}) is above the job's global_batch ({smallest_batch}): "
                "every worker needs at least one sample per step")
    if workers < lo:
        return (f"{workers} workers with max_batch {max_batch} cannot hold the job's "
                f"global_batch ({largest_batch})")
    return None


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    cpus: float = 1.0
    gpus: float = 0.0
    # Room for one more of this job's workers now (unreserved CPUs and GPUs). A spawn on a
    # node with none of the job's workers goes there even when it is full (it waits for the
    # resources); a second worker shares a node only where there is room now.
    free: bool = True
    # How many more of this job's workers fit now (None: one if ``free``, else none).
    room: int | None = None

    @property
    def slots(self) -> int:
        return max(0, self.room) if self.room is not None else int(self.free)

    @property
    def capacity(self) -> float:
        """A first guess at relative speed for a worker with no telemetry yet."""
        return self.gpus * 10.0 if self.gpus else max(self.cpus, 1.0)


@dataclass
class Member:
    worker_id: str
    ordinal: int
    node: str
    capacity: float
    gpus: float = 0.0
    version: Position = ORIGIN


@dataclass(frozen=True, slots=True)
class Spawn:
    """Start a worker on a node (its actor may take a while to come up). ``adopt``: the
    node holds this job's spare, which becomes the worker."""

    worker_id: str
    ordinal: int
    node_id: str
    capacity: float
    gpus: float
    adopt: bool = False


@dataclass(frozen=True, slots=True)
class SparePlan:
    """Nodes to start a spare on, and nodes whose spare to stop (kill)."""

    start: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Change:
    """A membership event: join, leave (drained or scaled down), failure, evict."""

    kind: str
    worker: str
    node: str
    reason: str


@dataclass(frozen=True, slots=True)
class NodeAssignment:
    """Train on exactly these nodes: ``slots`` pairs each node id (in order) with how many of
    the job's workers it runs. Built from a mapping with :meth:`of`; an entry that is not a
    node id with at least one slot is refused with a one-line reason naming it."""

    slots: tuple[tuple[str, int], ...]
    leaving: tuple[str, ...] = ()  # workers its owner drained: they, not the slowest, leave

    def __post_init__(self) -> None:
        if not self.slots:
            raise ValueError("assignment: names no node (give at least one node with a slot)")
        seen: set[str] = set()
        for entry in self.slots:
            node, k = entry if isinstance(entry, tuple) and len(entry) == 2 else (entry, None)
            if not isinstance(node, str) or not node:
                raise ValueError(f"assignment: node {node!r}: must be a non-empty node id")
            if node in seen:
                raise ValueError(f"assignment: node {node!r}: named twice")
            seen.add(node)
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ValueError(f"assignment: node {node!r}: slots must be an integer of at "
                                 f"least 1, got {k!r}")

    @classmethod
    def of(cls, nodes: Mapping[str, int]) -> NodeAssignment:
        if not isinstance(nodes, Mapping):
            raise ValueError(f"assignment: must map node ids to worker slots, got "
                             f"{type(nodes).__name__}")
        return cls(tuple(sorted(nodes.items(), key=lambda kv: str(kv[0]))))

    @property
    def total(self) -> int:
        return sum(k for _, k in self.slots)

    def __contains__(self, node: object) -> bool:
        return any(n == node for n, _ in self.slots)

    def get(self, node: str) -> int:
        """``node``'s slots (0: not assigned)."""
        return next((k for n, k in self.slots if n == node), 0)

    def __str__(self) -> str:
        return ", ".join(f"{node_label(n)}: {k}" for n, k in self.slots)


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """What takes a job's workers to an assignment: ``drain`` (worker ids, the order to
    drain them in) and ``spawn`` ((node, workers to start there), in node order)."""

    drain: tuple[str, ...]
    spawn: tuple[tuple[str, int], ...]


def placement_plan(workers: Sequence[tuple[str, int, str]], assignment: NodeAssignment,
                   speeds: dict[str, float] | None = None) -> PlacementPlan:
    """The changes that take ``workers`` ((id, ordinal, node), starting ones included) to
    ``assignment``: on each assigned node its fastest workers not ``leaving`` keep its slots;
    the others drain, the leaving then the slowest first; each node gets its empty slots."""
    order = sorted(slowest_first([(w, o) for w, o, _ in workers], speeds),
                   key=lambda w: w not in assignment.leaving)  # stable
    node_of = {w: n for w, _, n in workers}
    on: dict[str, list[str]] = {}
    for w in reversed(order):  # the fastest first
        if w not in assignment.leaving:
            on.setdefault(node_of[w], []).append(w)
    keep: set[str] = set()
    spawn = []
    for node, k in assignment.slots:
        here = on.get(node, [])
        keep.update(here[:k])
        if len(here) < k:
            spawn.append((node, k - len(here)))
    return PlacementPlan(tuple(w for w in order if w not in keep), tuple(spawn))


def slowest_first(workers: Sequence[tuple[str, int]], speeds: dict[str, float] | None
                  ) -> list[str]:
    """Worker ids (with their ordinals) in the order a scale-down removes them: those not
    measured yet (no entry in ``speeds``, or 0) first, the newest of them first, then the
    slowest measured (``speeds``: samples per second)."""
    speeds = speeds or {}

    def key(w: tuple[str, int]) -> tuple[bool, float, int]:
        v = speeds.get(w[0], 0.0)
        return (v > 0, v, -w[1])

    return [w for w, _ in sorted(workers, key=key)]


class Membership:
    def __init__(
        self,
        *,
        workers: int | None,
        min_workers: int | None,
        max_workers: int | None,
        smallest_batch: int,
        max_batch: int | None,
        largest_batch: int | None = None,
        max_possible: int = 4096,
    ):
        # The smallest and the largest global batch the job's schedule trains (a stage-wise
        # or goodput schedule trains several; None: only the smallest).
        self.smallest_batch = smallest_batch
        self.largest_batch = smallest_batch if largest_batch is None else largest_batch
        self.max_batch = max_batch
        self.target = workers  # None: one per eligible node
        need, most = worker_bounds(smallest_batch, self.largest_batch, max_batch)
        self.max_size = min(max_workers or workers or max_possible, most, max_possible)
        self.min_size = max(min_workers or 1, need)
        self.members: list[Member] = []
        self.pending: dict[str, Member] = {}
        self.committed: Position = ORIGIN
        self.generation = 0
        self.dirty = True
        self.next_ordinal = 0
        self.excluded_nodes: dict[str, str] = {}
        self._drain: set[str] = set()
        self.spares: set[str] = set()  # nodes holding this job's spare (starting or warm)
        self.no_spare: dict[str, str] = {}  # nodes whose spare was lost: why
        # After :meth:`spawns`: (workers that could not be placed now, workers wanted).
        self.unplaced: tuple[int, int] | None = None
        # The job's floor as declared (an assignment lowers min_size below it only to its
        # own total).
        self.floor = self.min_size
        # "Train on exactly these nodes", once requested (:meth:`request_assignment`).
        self.assignment: NodeAssignment | None = None

    # --- queries ----------------------------------------------------------------------
    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(m.worker_id for m in self.members)

    def get(self, worker: str) -> Member | None:
        return next((m for m in self.members if m.worker_id == worker), None)

    def holders(self) -> list[Member]:
        return [m for m in self.members if m.version == self.committed]

    def shortfall(self) -> str | None:
        """Why the job cannot train with its members now, or None."""
        n = len(self.members)
        if n >= self.min_size:
            return None
        why = f"{n} workers, below the minimum of {self.min_size}"
        if self.max_batch and math.ceil(self.largest_batch / self.max_batch) == self.min_size > 1:
            why += (f" (max_batch {self.max_batch} x workers must hold global_batch "
                    f"{self.largest_batch})")
        else:
            why += " (min_workers)"
        return why

    def batch_error(self, workers: int) -> str | None:
        """Why the job's batch cannot be split over ``workers`` workers (:func:`scale_error`,
        over the schedule's smallest and largest batch), or None."""
        return scale_error(workers, self.smallest_batch, self.largest_batch, self.max_batch)

    def moving(self) -> list[str]:
        """The workers an assignment in force still moves off their nodes (sorted): the
        driver needs a boundary with nothing in flight to drain them."""
        if self.assignment is None:
            return []
        return sorted(placement_plan(self._placed(), self.assignment).drain)

    def _placed(self) -> list[tuple[str, int, str]]:
        """Every worker of the job, starting ones too: (id, ordinal, node)."""
        return [(m.worker_id, m.ordinal, m.node)
                for m in [*self.members, *self.pending.values()]]

    # --- spawning and starting ----------------------------------------------------------
    def spawns(self, nodes: Sequence[NodeInfo], starting: bool, gpus_on) -> list[Spawn]:
        """Workers to start on ``nodes`` (docs/elasticity.md, "Scale up"): one per node with
        none of the job's workers, spares first; then, at the first start, nodes shared
        round-robin, later only nodes with room now. What cannot be placed: :attr:`unplaced`."""
        nodes = [n for n in nodes if n.node_id not in self.excluded_nodes]
        self.unplaced = None
        if self.assignment is not None:
            return self._assigned_spawns(nodes, gpus_on)
        if not nodes:
            return []
        # The requested number at the start, then also one per free eligible node (a node
        # that joined), up to max_size.
        goal = self.target if self.target is not None and starting else max(
            self.target or 0, len(nodes))
        want = max(1, min(goal, self.max_size))
        have = len(self.members) + len(self.pending)
        if have >= want:
            return []
        used = self._used()
        free = [n for n in nodes if n.node_id not in used]
        # A free node with a spare first: its worker is up in a fraction of a second.
        free.sort(key=lambda n: (not n.free, not (n.free and n.node_id in self.spares)))
        choices = [n for n in free if n.free]
        if starting:
            choices += [n for n in free if not n.free]
            if len(free) < want - have:
                choices += [nodes[i % len(nodes)] for i in range(want - have - len(free))]
        else:
            choices += self._shared(nodes, used, want - have - len(choices))
            choices += [n for n in free if not n.free]
            if len(choices) < want - have:
                self.unplaced = (want - have - len(choices), want)
        return [self._spawn_on(node, gpus_on) for node in choices[: want - have]]

    def _assigned_spawns(self, nodes: Sequence[NodeInfo], gpus_on) -> list[Spawn]:
        """Workers for the assignment's empty slots, on the assigned nodes only, full ones too
        (the scheduler that assigned them frees them); one not alive now: :attr:`unplaced`."""
        by_id = {n.node_id: n for n in nodes}
        out: list[Spawn] = []
        short = 0
        for node_id, k in placement_plan(self._placed(), self.assignment).spawn:
            node = by_id.get(node_id)
            if node is None:
                short += k
            else:
                out += [self._spawn_on(node, gpus_on) for _ in range(k)]
        self.unplaced = (short, self.assignment.total) if short else None
        return out

    def _spawn_on(self, node: NodeInfo, gpus_on) -> Spawn:
        ordinal = self.next_ordinal
        self.next_ordinal += 1
        m = Member(f"w{ordinal}", ordinal, node.node_id, node.capacity, gpus_on(node.gpus))
        self.pending[m.worker_id] = m
        adopt = node.node_id in self.spares
        self.spares.discard(node.node_id)  # adopted: from now on it is this worker
        return Spawn(m.worker_id, ordinal, node.node_id, m.capacity, m.gpus, adopt)

    def _used(self) -> set[str]:
        return {m.node for m in self.members} | {m.node for m in self.pending.values()}

    def _shared(self, nodes: Sequence[NodeInfo], used: set[str], n: int) -> list[NodeInfo]:
        """Up to ``n`` more placements on nodes that host this job's workers, each within
        the room the node has now (less the job's workers still starting there, which may
        not hold their CPUs yet): the roomiest node first, so workers spread."""
        starting_on: dict[str, int] = {}
        for p in self.pending.values():
            starting_on[p.node] = starting_on.get(p.node, 0) + 1
        room = {x.node_id: x.slots - starting_on.get(x.node_id, 0)
                for x in nodes if x.node_id in used}
        by_id = {x.node_id: x for x in nodes}
        out: list[NodeInfo] = []
        while len(out) < n:
            best = max(room, key=lambda k: room[k], default=None)  # first of equals
            if best is None or room[best] <= 0:
                break
            room[best] -= 1
            out.append(by_id[best])
        return out

    def unplaceable(self, nodes: Sequence[NodeInfo], workers: int) -> int:
        """How many of ``workers`` requested workers could not be placed now (by the
        nodes' room as listed now; a full node, another job's CPUs, may free up later):
        said at once to whoever asked."""
        nodes = [x for x in nodes if x.node_id not in self.excluded_nodes]
        have = len(self.members) + len(self.pending)
        return max(0, workers - have - sum(x.slots for x in nodes))

    # --- spares -----------------------------------------------------------------------
    def spare_plan(self, nodes: Sequence[NodeInfo], limit: int) -> SparePlan:
        """Where this job's spares should be now (docs/elasticity.md, "Spares"), up to
        ``limit``: first the spares on free nodes, then free nodes without one, then the
        spares on nodes another job has filled meanwhile; in node order within each."""
        used = self._used()
        candidates = [n for n in nodes
                      if n.node_id not in used and n.node_id not in self.excluded_nodes
                      and n.node_id not in self.no_spare
                      and (self.assignment is None or n.node_id in self.assignment)
                      and (n.free or n.node_id in self.spares)]
        candidates.sort(key=lambda n: (not n.free, n.node_id not in self.spares))  # stable
        want = {n.node_id for n in candidates[:max(0, limit)]}
        start, stop = sorted(want - self.spares), sorted(self.spares - want)
        self.spares = want
        return SparePlan(tuple(start), tuple(stop))

    def spare_lost(self, node: str, reason: str) -> None:
        """The spare on ``node`` died (or never came up) before it was adopted."""
        self.spares.discard(node)
        self.no_spare[node] = reason

    def drop_spares(self) -> tuple[str, ...]:
        """The job ends: every spare is to be stopped."""
        out, self.spares = tuple(sorted(self.spares)), set()
        return out

    def started(self, worker: str) -> Change | None:
        """A pending worker's actor is up: it joins at the next regroup (None: not wanted,
        the job is at its maximum, and the driver kills it)."""
        m = self.pending.pop(worker, None)
        if m is None or not self._room_for(m):
            return None
        m.version = ORIGIN
        self.members.append(m)
        self.dirty = True
        return Change("join", m.worker_id, m.node, "node available")

    def _room_for(self, m: Member) -> bool:
        """Whether a started worker may join: below the size limit; with an assignment,
        a free slot on its node (workers that are leaving for the assignment may still be
        members then, so the limit is the global batch: a sample for every worker)."""
        if self.assignment is None:
            return len(self.members) < self.max_size
        here = sum(1 for x in self.members if x.node == m.node)
        return here < self.assignment.get(m.node) and len(self.members) < self.smallest_batch

    def start_failed(self, worker: str) -> None:
        self.pending.pop(worker, None)

    # --- leaving ------------------------------------------------------------------------
    def remove(self, worker: str, kind: str, reason: str) -> Change | None:
        m = self.get(worker) or self.pending.pop(worker, None)
        if m is None:
            return None
        if m in self.members:
            self.members.remove(m)
        self._drain.discard(worker)
        self.dirty = True
        if kind == "evict":
            # A straggler's node would get a new worker at the next poll: keep it out.
            self.excluded_nodes[m.node] = reason
        return Change(kind, m.worker_id, m.node, reason)

    def request_drain(self, worker: str) -> None:
        if self.get(worker) is None:
            raise KeyError(worker)
        if len(self.members) - len(self._drain) <= 1:
            raise ValueError("cannot drain the last worker")
        self._drain.add(worker)
        self.target = max(1, len(self.members) - len(self._drain))
        self.max_size = min(self.max_size, self.target)

    def request_scale(self, workers: int, speeds: dict[str, float] | None = None) -> None:
        """Run with exactly ``workers``. Scaling down drains the slowest first, by
        ``speeds`` (measured samples per compute-second): a worker not measured yet (it just
        joined) goes first, the newest of those first, then the slowest measured."""
        if workers < 1:
            raise ValueError("workers: must be at least 1")
        # An explicit size: neither more (growth onto free nodes) nor fewer.
        self.target = min(workers, self.smallest_batch)
        self.max_size = self.target
        self.min_size = min(self.min_size, self.target)
        order = slowest_first([(m.worker_id, m.ordinal) for m in self.members], speeds)
        self._drain.update(order[: max(0, len(self.members) - self.target)])

    def request_assignment(self, assignment: NodeAssignment) -> None:
        """Train on exactly ``assignment`` from now on: its total becomes the job's size (the
        minimum too when below the job's floor), since the cluster scheduler owns the job's
        bounds. ``ValueError`` only when the batch cannot be split over that many."""
        err = self.batch_error(assignment.total)
        if err is not None:
            raise ValueError(err)
        self.assignment = assignment
        self.target = self.max_size = assignment.total
        self.min_size = min(self.floor, assignment.total)

    def withdraw(self) -> list[str]:
        """The workers still starting that the assignment in force leaves out (a newer one
        withdrew their slots before they came up): out of the job now, as a start given up
        (the group is unchanged); the driver stops them."""
        if self.assignment is None:
            return []
        out = [w for w in placement_plan(self._placed(), self.assignment).drain
               if w in self.pending]
        for w in out:
            del self.pending[w]
        return out

    def handover(self, speeds: dict[str, float] | None = None) -> list[str]:
        """The workers to drain now for the assignment: those :func:`placement_plan` says
        leave, except that the members left must include a holder of the committed state
        and number at least ``min_size`` (the rest leave at a later boundary, once the new
        workers hold the state). Those without the state go first, then the slowest."""
        if self.assignment is None:
            return []
        plan = placement_plan(self._placed(), self.assignment, speeds)
        holders = {m.worker_id for m in self.holders()}
        left = set(self.worker_ids) - self._drain
        out = []
        for w in sorted(plan.drain, key=lambda w: w in holders):  # stable: slowest first
            if w in self.pending:
                out.append(w)
            elif w in left and len(left) > self.min_size and holders & (left - {w}):
                left.discard(w)
                out.append(w)
        return out

    def draining(self, speeds: dict[str, float] | None = None) -> list[str]:
        """Who :meth:`apply_drains` would remove now: the workers asked to leave and those
        the assignment moves now (sorted)."""
        return sorted(self._drain | set(self.handover(speeds)))

    def apply_drains(self, speeds: dict[str, float] | None = None) -> list[Change]:
        """Remove the workers requested to leave, and those the assignment moves now."""
        self._drain.update(self.handover(speeds))
        return [c for w in list(self._drain) if (c := self.remove(w, "leave", "drained"))]

    # --- state ----------------------------------------------------------------------------
    def progressed(self, progress: dict[str, Position]) -> Position:
        """Survivors of a segment report the position their weights reached; the committed
        version becomes the furthest of them (a member absent from ``progress`` keeps its
        version). Returns the committed version."""
        for m in self.members:
            if m.worker_id in progress:
                m.version = progress[m.worker_id]
        if progress:
            self.committed = max(progress.values())
        return self.committed

    def rank_order(self) -> tuple[str, ...]:
        """The members in the next generation's rank order: holders of the committed state
        first, so rank 0 is the source of the state when any member holds it."""
        order = sorted(self.members, key=lambda m: m.version != self.committed)  # stable
        return tuple(m.worker_id for m in order)

    def regrouped(self, members: Sequence[str]) -> None:
        """A generation formed with ``members``: they all hold the committed state now."""
        self.generation += 1
        self.dirty = False
        for m in self.members:
            if m.worker_id in members:
                m.version = self.committed

    def restored(self, position: Position, next_ordinal: int = 0) -> None:
        """The committed state was rolled back to a checkpoint taken at ``position``; worker
        ids go on from ``next_ordinal`` (the checkpoint's), never reused."""
        self.committed = position
        self.next_ordinal = max(self.next_ordinal, next_ordinal)
        self.dirty = True

    def broke(self) -> None:
        """The group broke off a collective (a segment failed): it is formed again."""
        self.dirty = True

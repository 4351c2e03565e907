"""Membership: who is in, who holds the current model state, what to spawn or evict.

Pure: no ray, no torch, no clock. The driver reports what happened (nodes seen, a worker
started or was lost, a segment's progress, a regroup done) and asks what to do next.

State versions. Every worker starts from the seeded initial weights, version
``Position(0, 0)``. A member's version is the (epoch, step) its weights have reached; the
job's committed version is the furthest one a surviving member reported. A member *holds
the current state* when its version equals the committed one, and a regroup broadcasts
from such a member. When none is left (every holder lost at once, or a resume whose
weights are only in a checkpoint), :meth:`Membership.regroup_plan` says so and the driver
must load a checkpoint into the group, or fail: it never continues from fresh weights.

Bounds. The job keeps between ``min_size`` and ``max_size`` workers:
``min_size = max(min_workers, ceil(B / max_batch))`` (fewer could not hold the global
batch) and ``max_size = min(max_workers or workers or B, B)`` (a worker needs at least one
sample per step), so ``workers: auto`` is bounded too. Below ``min_size`` the job waits
with a reason.

Placement and scale. A new worker goes first to a node with none of the job's workers.
At the first start a small cluster shares nodes round-robin; later (a scale-up, a
replacement) a node that hosts the job's workers takes more only while it has room now
(:attr:`NodeInfo.slots`: its unreserved CPUs and GPUs), and what cannot be placed is
reported (:attr:`Membership.unplaced`, :meth:`Membership.unplaceable`) for the driver to
say. A scale-down drains the slowest first (:func:`slowest_first`, by measured speed).

Spares. A worker's start-up (a process, the torch import, the model, the data) takes
seconds; a pre-warmed *spare* on an idle node pays it ahead, so a worker that later starts
there (a scale-up, a replacement after a loss) adopts the spare and only takes its identity.
:meth:`Membership.spare_plan` says where spares should be: at most ``limit``, at most one
per node, only on eligible nodes that host none of this job's workers and would run a CPU
worker (a GPU is visible only to the process it was reserved for). A spare is started only
on a node with room for a worker (``NodeInfo.free``); once there it stays while the node is
eligible (it holds no CPU, so it keeps nobody out), unless the limit is better spent on a
free node. :meth:`Membership.spawns` takes free nodes with a spare first and marks those
spawns ``adopt``. A node whose spare was lost before adoption gets no other spare.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from dynabatch.scheduler.core.sync.protocol import Position

ORIGIN = Position(0, 0)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    address: str = ""
    cpus: float = 1.0
    gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
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
class RegroupPlan:
    """Form the group with ``members`` (rank order); rank 0 is the source of the state.
    ``needs_state``: no member holds the committed state, so the driver must load it
    into rank 0 first (from the resume checkpoint, or by rolling back to one)."""

    members: tuple[str, ...]
    needs_state: bool


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
        global_batch: int,
        max_batch: int | None,
        max_possible: int = 4096,
    ):
        self.global_batch = global_batch
        self.max_batch = max_batch
        self.target = workers  # None: one per eligible node
        self.max_size = min(max_workers or workers or max_possible, global_batch, max_possible)
        need = math.ceil(global_batch / max_batch) if max_batch else 1
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
        if self.max_batch and math.ceil(self.global_batch / self.max_batch) == self.min_size > 1:
            why += (f" (max_batch {self.max_batch} x workers must hold global_batch "
                    f"{self.global_batch})")
        else:
            why += " (min_workers)"
        return why

    def want(self, eligible: int, starting: bool) -> int:
        """How many workers to have: the requested number at the start, then also one per
        free eligible node (a node that joined), up to ``max_size``."""
        if self.target is None:
            return max(1, min(eligible, self.max_size))
        if starting:
            return max(1, min(self.target, self.max_size))
        return max(1, min(max(self.target, eligible), self.max_size))

    # --- spawning and starting ----------------------------------------------------------
    def spawns(self, nodes: Sequence[NodeInfo], starting: bool, gpus_on) -> list[Spawn]:
        """Workers to start on ``nodes``: first one per node with none of the job's workers
        (a free one with a spare first, then free ones, then full ones, where the worker
        waits for the resources). At the first start a small cluster then shares nodes
        round-robin (a laptop running every worker on one node); later (a scale-up, a
        replacement) a node takes more workers only while it has room for them now
        (:attr:`NodeInfo.slots`). What cannot be placed is in :attr:`unplaced`."""
        nodes = [n for n in nodes if n.node_id not in self.excluded_nodes]
        self.unplaced = None
        if not nodes:
            return []
        want = self.want(len(nodes), starting)
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
        out = []
        for node in choices[: want - have]:
            ordinal = self.next_ordinal
            self.next_ordinal += 1
            m = Member(f"w{ordinal}", ordinal, node.node_id, node.capacity, gpus_on(node.gpus))
            self.pending[m.worker_id] = m
            adopt = node.node_id in self.spares
            self.spares.discard(node.node_id)  # adopted: from now on it is this worker
            out.append(Spawn(m.worker_id, ordinal, node.node_id, m.capacity, m.gpus, adopt))
        return out

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
    def spare_plan(self, nodes: Sequence[NodeInfo], limit: int, gpus_on) -> SparePlan:
        """Where this job's spares should be now (see the module docstring), up to
        ``limit``: first the spares on free nodes, then free nodes without one, then the
        spares on nodes another job has filled meanwhile; in node order within each."""
        used = self._used()
        candidates = [n for n in nodes
                      if n.node_id not in used and n.node_id not in self.excluded_nodes
                      and n.node_id not in self.no_spare and not gpus_on(n.gpus)
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
        if m is None or len(self.members) >= self.max_size:
            return None
        m.version = ORIGIN
        self.members.append(m)
        self.dirty = True
        return Change("join", m.worker_id, m.node, "node available")

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
        self.target = min(workers, self.global_batch)
        self.max_size = self.target
        self.min_size = min(self.min_size, self.target)
        for m in self.drain_order(speeds)[: max(0, len(self.members) - self.target)]:
            self._drain.add(m.worker_id)

    def drain_order(self, speeds: dict[str, float] | None = None) -> list[Member]:
        """Members in the order a scale-down removes them (see :meth:`request_scale`)."""
        order = slowest_first([(m.worker_id, m.ordinal) for m in self.members], speeds)
        by_id = {m.worker_id: m for m in self.members}
        return [by_id[w] for w in order]

    def apply_drains(self) -> list[Change]:
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

    def regroup_plan(self) -> RegroupPlan:
        """Rank order for the next generation: a holder of the committed state first."""
        order = sorted(self.members, key=lambda m: m.version != self.committed)  # stable
        needs_state = not order or order[0].version != self.committed
        return RegroupPlan(tuple(m.worker_id for m in order), needs_state=needs_state)

    def regrouped(self, members: Sequence[str]) -> None:
        """A generation formed with ``members``: they all hold the committed state now."""
        self.generation += 1
        self.dirty = False
        for m in self.members:
            if m.worker_id in members:
                m.version = self.committed

    def restored(self, position: Position) -> None:
        """The committed state was rolled back to a checkpoint taken at ``position``."""
        self.committed = position
        self.dirty = True

"""The cluster policy's inputs and its one output, :class:`ClusterDecision` (pure values).

Times are plain numbers (seconds on whatever clock the caller keeps): the core has no
clock, so "now" and each job's last resize come in with the inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynabatch.scheduler.core.cluster.throughput import ThroughputModel

POLICIES = ("fifo", "fair", "goodput", "single_type")

# A GPU node's capacity in units of 1/GPU_UNITS of a GPU, so that workers of fractional
# ``worker_gpus`` share one by an integer sum. lcm(1..16): a worker taking 1/k of a GPU is
# exact for every k up to 16 (see ``nodes.gpu_units``).
GPU_UNITS = 720720


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """A node: its type (a Ray label or resource, or derived from its resources) and its
    worker slots (``capacity``): ``GPU_UNITS`` per GPU on a GPU node (``gpu``), else
    ``cpu_units`` per CPU (Ray's fixed point, ``RAY_UNITS``, for a node listed from Ray, so
    fractional CPUs pack as Ray packs them; 1 by default). A worker takes its job's
    ``gpu_units`` on a GPU node and its ``worker_slots`` on the others."""

    node_id: str
    node_type: str
    capacity: int
    gpu: bool = False
    cpu_units: int = 1

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("node_id: empty")
        if not self.node_type:
            raise ValueError(f"node {self.node_id}: node_type is empty")
        if self.capacity < 0:
            raise ValueError(f"node {self.node_id}: capacity {self.capacity} is below 0")
        if self.cpu_units < 1:
            raise ValueError(f"node {self.node_id}: cpu_units {self.cpu_units} is below 1")

    def shown(self, units: int) -> float:
        """``units`` of this node's capacity as people read them: GPUs on a GPU node (its
        slots are fractions of a GPU), CPUs on the others."""
        return round(units / (GPU_UNITS if self.gpu else self.cpu_units), 4)


@dataclass(frozen=True, slots=True)
class ClusterJob:
    """A job as the cluster sees it. ``allocation``: (node_id, workers) it holds now (empty:
    waiting); ``last_resize_s``: when its nodes last changed (None: never ran); ``model``:
    completed by :func:`~.throughput.bootstrap`; ``worker_slots`` / ``gpu_units``: the slots
    one worker takes on a CPU / GPU node (:func:`~.ray_nodes.gpu_units`)."""

    job_id: str
    min_workers: int
    max_workers: int
    model: ThroughputModel
    priority: int = 0
    submit_s: float = 0.0
    allocation: tuple[tuple[str, int], ...] = ()
    last_resize_s: float | None = None
    worker_slots: int = 1
    gpu_units: int = GPU_UNITS

    def __post_init__(self) -> None:
        if not self.job_id:
            raise ValueError("job_id: empty")
        if self.worker_slots < 1:
            raise ValueError(f"job {self.job_id}: worker_slots {self.worker_slots} is below 1")
        if not 1 <= self.gpu_units <= GPU_UNITS:
            raise ValueError(
                f"job {self.job_id}: gpu_units {self.gpu_units} is not in 1..{GPU_UNITS}"
            )
        if self.min_workers < 1:
            raise ValueError(f"job {self.job_id}: min_workers {self.min_workers} is below 1")
        if self.max_workers < self.min_workers:
            raise ValueError(
                f"job {self.job_id}: max_workers {self.max_workers} is below "
                f"min_workers {self.min_workers}"
            )
        if not math.isfinite(self.submit_s):
            raise ValueError(f"job {self.job_id}: submit_s {self.submit_s} is not finite")
        for node_id, n in self.allocation:
            if n < 1:
                raise ValueError(f"job {self.job_id}: allocation on {node_id}: {n} workers")

    @property
    def workers(self) -> int:
        return sum(n for _, n in self.allocation)

    def size_on(self, node: ClusterNode) -> int:
        """Slots one of its workers takes on ``node``."""
        return self.gpu_units if node.gpu else self.worker_slots


@dataclass(frozen=True, slots=True)
class ClusterKnobs:
    """The policy and its settings (docs/cluster.md, "Knobs"). ``node_limit``: a node count,
    not a time, so a decision does not depend on the clock. ``client_lease_s``: a job whose
    own run launches it (``dynabatch run``) and whose run is not heard from for this long
    before its driver is up leaves the rounds."""

    policy: str = "goodput"
    hold_s: float = 120.0
    resize_penalty: float = 0.05
    move_cost: float = 1e-3
    hysteresis: float = 0.01
    tangents: int = 6
    node_limit: int = 2000
    mip_gap: float = 0.01
    fair_weight: float = 10.0
    client_lease_s: float = 60.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in (
            "hold_s",
            "resize_penalty",
            "move_cost",
            "hysteresis",
            "mip_gap",
            "fair_weight",
            "client_lease_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name}: {value} is not a number >= 0")
        if self.tangents < 1:
            raise ValueError(f"tangents: {self.tangents} is below 1")
        if self.node_limit < 1:
            raise ValueError(f"node_limit: {self.node_limit} is below 1")


@dataclass(frozen=True, slots=True)
class JobPlan:
    """One job's part of a decision. ``slots``: (node_id, workers), sorted by node;
    empty when queued. ``by_type``: workers per node type. ``changed``: its nodes differ from
    its current allocation (the caller records ``now`` as its last resize). ``position``:
    1-based place in the queue, None when running. ``normalised``: its throughput over its
    throughput on ``max_workers`` of its fastest type."""

    job_id: str
    slots: tuple[tuple[str, int], ...]
    by_type: tuple[tuple[str, int], ...]
    changed: bool
    reason: str
    position: int | None = None
    normalised: float = 0.0

    @property
    def workers(self) -> int:
        return sum(n for _, n in self.slots)

    @property
    def queued(self) -> bool:
        return self.position is not None


@dataclass(frozen=True, slots=True)
class ClusterDecision:
    """Every job's plan (sorted by job id) and the queue, in order."""

    policy: str
    plans: tuple[JobPlan, ...]
    queue: tuple[str, ...]

    def plan(self, job_id: str) -> JobPlan:
        for p in self.plans:
            if p.job_id == job_id:
                return p
        raise KeyError(job_id)

"""What people see of the cluster scheduler: one read model of its last round (pure values).

The scheduler builds a :class:`ClusterView` after each round from the nodes and jobs it
decided over and the :class:`~dynabatch.scheduler.core.cluster.values.ClusterDecision`;
REST (``GET /v1/cluster``), the CLI (``dynabatch cluster``), the job page and the metrics
all render this one value, so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dynabatch.scheduler.core.cluster.values import ClusterDecision, ClusterJob, ClusterNode


@dataclass(frozen=True, slots=True)
class NodeView:
    """A node, its type, and which jobs hold how many workers there. ``capacity`` and
    ``used``: in GPUs on a GPU node (fractions where jobs share one), else in CPUs."""

    node_id: str
    node_type: str
    capacity: float
    used: float
    holders: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class JobView:
    """A job as the scheduler sees it after the round: its plan (:class:`~.values.JobPlan`),
    its ``rates`` per node type (``measured``: those from its own telemetry, the others
    estimates), and facts beside the decision: ``members`` as the job last reported them
    (None: no report yet), why they ``differs`` from its allocation (None: they agree), and
    what an owner's request still ``waits`` for."""

    job_id: str
    priority: int
    min_workers: int
    max_workers: int
    allocation: tuple[tuple[str, int], ...]
    by_type: tuple[tuple[str, int], ...]
    reason: str
    position: int | None
    rates: tuple[tuple[str, float], ...]
    measured: tuple[str, ...]
    normalised: float
    members: tuple[tuple[str, int], ...] | None = None
    differs: str | None = None
    waits: str | None = None

    @property
    def queued(self) -> bool:
        return self.position is not None

    @property
    def workers(self) -> int:
        return sum(n for _, n in self.allocation)


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The cluster after round ``round_no`` (decided at ``decided_s`` on the scheduler's
    clock): its nodes, every job, the queue in order, and resizes made so far."""

    policy: str
    round_no: int
    decided_s: float
    nodes: tuple[NodeView, ...]
    jobs: tuple[JobView, ...]
    queue: tuple[str, ...]
    resizes: int = 0

    def job(self, job_id: str) -> JobView:
        for j in self.jobs:
            if j.job_id == job_id:
                return j
        raise KeyError(job_id)

    @property
    def capacity(self) -> float:
        """GPUs of the GPU nodes and CPU slots of the others."""
        return sum(n.capacity for n in self.nodes)

    @property
    def used(self) -> float:
        return round(sum(n.used for n in self.nodes), 4)

    @property
    def utilization(self) -> float:
        """Capacity held over capacity offered (0 on an empty cluster)."""
        return self.used / self.capacity if self.capacity else 0.0


def view_of(
    nodes: Sequence[ClusterNode],
    jobs: Sequence[ClusterJob],
    decision: ClusterDecision,
    *,
    round_no: int = 0,
    decided_s: float = 0.0,
    resizes: int = 0,
    facts: Mapping[str, tuple[tuple[tuple[str, int], ...] | None, str | None, str | None]]
    | None = None,
) -> ClusterView:
    """The read model of one round: ``decision`` taken over ``nodes`` and ``jobs``;
    ``facts``: per job, (``members``, ``differs``, ``waits``) as :class:`JobView` has them."""
    facts = facts or {}
    by_job = {j.job_id: j for j in jobs}
    holders: dict[str, list[tuple[str, int]]] = {n.node_id: [] for n in nodes}
    for plan in decision.plans:
        for node_id, n in plan.slots:
            holders.setdefault(node_id, []).append((plan.job_id, n))
    node_views = tuple(
        NodeView(
            n.node_id,
            n.node_type,
            n.shown(n.capacity),
            used=n.shown(sum(k * by_job[j].size_on(n) for j, k in holders[n.node_id])),
            holders=tuple(sorted(holders[n.node_id])),
        )
        for n in sorted(nodes, key=lambda n: n.node_id)
    )
    job_views = []
    for plan in decision.plans:
        job = by_job[plan.job_id]
        members, differs, waits = facts.get(plan.job_id, (None, None, None))
        job_views.append(
            JobView(
                job_id=plan.job_id,
                priority=job.priority,
                min_workers=job.min_workers,
                max_workers=job.max_workers,
                allocation=plan.slots,
                by_type=plan.by_type,
                reason=plan.reason,
                position=plan.position,
                rates=job.model.rates,
                measured=tuple(sorted(job.model.measured)),
                normalised=plan.normalised,
                members=members,
                differs=differs,
                waits=waits,
            )
        )
    return ClusterView(
        policy=decision.policy,
        round_no=round_no,
        decided_s=decided_s,
        nodes=node_views,
        jobs=tuple(job_views),
        queue=decision.queue,
        resizes=resizes,
    )

"""``GET /v1/cluster``'s answer: the cluster scheduler's last round, as JSON.

Built from the one read model of a round
(:class:`~dynabatch.scheduler.core.cluster.view.ClusterView`), which the job status and the
metrics read too, so they cannot disagree. With no round (no cluster scheduler) the answer
has ``scheduler: null`` and empty lists: "nothing decides", not an error.
"""

from __future__ import annotations

from dynabatch.scheduler.core.cluster.view import ClusterView, JobView
from pydantic import BaseModel, ConfigDict, Field

NO_SCHEDULER = "no cluster scheduler runs: jobs wait for Ray's resources in no set order"


class NodeHolder(BaseModel):
    job_id: str
    workers: int = Field(description="This job's workers on the node.")


class ClusterNodeState(BaseModel):
    node_id: str
    node_type: str = Field(
        description="A Ray label or resource, or derived from the node's "
        "resources (GPU model, CPU count)."
    )
    capacity: float = Field(description="GPUs on a GPU node, else CPUs: what it offers.")
    used: float = Field(
        description="What jobs' workers hold of it (GPUs, fractions where they share one; "
        "else CPUs)."
    )
    jobs: list[NodeHolder] = Field(description="The jobs holding its slots.")


class Slot(BaseModel):
    node_id: str
    workers: int


class TypeSpeed(BaseModel):
    node_type: str
    samples_per_s: float = Field(
        description="Samples per second of one worker of the job on this node type."
    )
    measured: bool = Field(
        description="True: from the job's own telemetry; false: estimated "
        "from other jobs' speed ratios between types."
    )


class ClusterJobState(BaseModel):
    job_id: str
    priority: int
    min_workers: int
    max_workers: int
    workers: int = Field(description="Workers allocated (0 while queued).")
    allocation: list[Slot] = Field(
        description="The cluster scheduler's decision: the nodes it is to train on, and how "
        "many workers on each."
    )
    members: list[Slot] | None = Field(
        default=None,
        description="The fact: its workers per node as the job itself last reported them to "
        "the cluster scheduler (each round); null before its first report or while queued.",
    )
    differs: str | None = Field(
        default=None,
        description="Why its members are not its allocation (workers starting or draining "
        "per node, or an assignment the job refused, with its reason); null when they agree.",
    )
    waits: str | None = Field(
        default=None,
        description="What an owner's request (a scale) still waits for; null when nothing.",
    )
    by_type: dict[str, int] = Field(description="Workers per node type.")
    speed: list[TypeSpeed] = Field(description="Its speed per node type, measured or estimated.")
    normalised: float = Field(
        description="Its throughput over its throughput on max_workers of its fastest type."
    )
    position: int | None = Field(description="Place in the queue from 1; null when running.")
    reason: str = Field(description="Why it has these nodes, or why it waits.")

    @classmethod
    def of(cls, job: JobView) -> ClusterJobState:
        measured = set(job.measured)
        return cls(
            job_id=job.job_id,
            priority=job.priority,
            min_workers=job.min_workers,
            max_workers=job.max_workers,
            workers=job.workers,
            allocation=[Slot(node_id=n, workers=w) for n, w in job.allocation],
            members=None if job.members is None else [
                Slot(node_id=n, workers=w) for n, w in job.members
            ],
            differs=job.differs,
            waits=job.waits,
            by_type=dict(job.by_type),
            speed=[
                TypeSpeed(node_type=t, samples_per_s=r, measured=t in measured)
                for t, r in job.rates
            ],
            normalised=job.normalised,
            position=job.position,
            reason=job.reason,
        )


class QueueEntry(BaseModel):
    position: int
    job_id: str
    priority: int
    reason: str


class SchedulerState(BaseModel):
    policy: str = Field(description="fifo, fair or goodput (DYNABATCH_CLUSTER_POLICY).")
    round: int = Field(description="The round these allocations come from.")
    decided_s: float = Field(description="When it was decided, on the cluster scheduler's clock.")
    capacity: float = Field(description="GPUs of the GPU nodes plus CPUs of the others.")
    used: float = Field(description="What jobs hold of it.")
    utilization: float = Field(description="used / capacity (0 on an empty cluster).")
    resizes: int = Field(description="Job resizes the cluster scheduler made so far.")


class ClusterState(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "example": {
                "scheduler": {
                    "policy": "goodput",
                    "round": 12,
                    "decided_s": 1767225600.0,
                    "capacity": 4,
                    "used": 4,
                    "utilization": 1.0,
                    "resizes": 1,
                },
                "message": None,
                "nodes": [
                    {
                        "node_id": "a1",
                        "node_type": "H100",
                        "capacity": 2,
                        "used": 2,
                        "jobs": [{"job_id": "3f9c1a7b2e04", "workers": 2}],
                    }
                ],
                "queue": [
                    {
                        "position": 1,
                        "job_id": "7d01c2aa9e13",
                        "priority": 0,
                        "reason": "queued: position 1 of 1 (min_workers 2 not free: 0 of 4 slots "
                        "on its node types are not held or kept for jobs ahead)",
                    }
                ],
                "jobs": [],
            }
        }
    )

    scheduler: SchedulerState | None = Field(
        description="The last round; null when no cluster scheduler runs."
    )
    message: str | None = Field(default=None, description="Why the rest is empty, if it is.")
    nodes: list[ClusterNodeState]
    queue: list[QueueEntry] = Field(description="Waiting jobs, in order.")
    jobs: list[ClusterJobState] = Field(description="Every job the cluster scheduler decided over.")

    @classmethod
    def of(cls, view: ClusterView | None) -> ClusterState:
        if view is None:
            return cls(scheduler=None, message=NO_SCHEDULER, nodes=[], queue=[], jobs=[])
        by_id = {j.job_id: j for j in view.jobs}
        return cls(
            scheduler=SchedulerState(
                policy=view.policy,
                round=view.round_no,
                decided_s=view.decided_s,
                capacity=view.capacity,
                used=view.used,
                utilization=view.utilization,
                resizes=view.resizes,
            ),
            nodes=[
                ClusterNodeState(
                    node_id=n.node_id,
                    node_type=n.node_type,
                    capacity=n.capacity,
                    used=n.used,
                    jobs=[NodeHolder(job_id=j, workers=w) for j, w in n.holders],
                )
                for n in view.nodes
            ],
            queue=[
                QueueEntry(position=i, job_id=j, priority=by_id[j].priority, reason=by_id[j].reason)
                for i, j in enumerate(view.queue, 1)
            ],
            jobs=[ClusterJobState.of(j) for j in view.jobs],
        )


GRANTED = "granted {n} workers by the cluster scheduler; the coordinator is starting"


def scheduler_note(view: ClusterView | None, job_id: str) -> str | None:
    """What the scheduler's last round says of ``job_id`` beside the job's own state (why
    it is queued, what a scale waits for, that its coordinator is starting), or None."""
    if view is None:
        return None
    for j in view.jobs:
        if j.job_id == job_id:
            if j.queued:
                return j.reason
            if j.waits:
                return j.waits
            return GRANTED.format(n=j.workers) if j.members is None else None
    return None

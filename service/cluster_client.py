"""The seam between the service and Ray: :class:`ClusterClient` (every Ray call the service
makes) and the cluster view it returns (:class:`NodeStatus`, :class:`NodeJob`).

Implementations: :class:`dynabatch.service.ray_client.RayClusterClient` (Ray) and
``tests.fakes.FakeCluster`` (in memory, for route and service tests). They raise the errors
of :mod:`dynabatch.service.service_errors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from dynabatch.service.scheduling import Scheduling
    from dynabatch.service.settings import Settings


class NodeJob(BaseModel):
    model_config = ConfigDict(frozen=True)

    job_id: str
    name: str
    workers: list[str] = Field(description="Names of this job's workers on the node.")


class NodeStatus(BaseModel):
    """A Ray node, its resources, and the live jobs whose workers it hosts."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    address: str
    hostname: str = ""
    alive: bool = True
    head: bool = False
    resources: dict[str, float] = Field(default_factory=dict, description="Total resources.")
    available: dict[str, float] | None = Field(
        default=None, description="Resources free now, when Ray reports them."
    )
    jobs: list[NodeJob] = Field(default_factory=list)

    def matches(self, node: str) -> bool:
        """Whether a worker's ``node`` field names this node (id, address or hostname)."""
        return bool(node) and node in (self.node_id, self.address, self.hostname)


class ClusterClient(Protocol):
    """Every Ray call the service makes. Implementations raise :class:`RayCallError`s."""

    @property
    def embedded(self) -> bool:
        """True when Ray lives in this process and ends with it."""
        ...

    @property
    def address(self) -> str:
        """The cluster's address, for the record of where a job ran."""
        ...

    def connect(self) -> None: ...

    def close(self) -> None: ...

    def ping(self) -> bool: ...

    def launch(self, job_id: str, spec: JobSpec, generation: int = 0) -> None:
        """Start the job's coordinator of ``generation`` (the job's count of resumes, as
        the store keeps it): each generation's actor has a name of its own."""
        ...

    def find(self, job_id: str, generation: int = 0) -> bool:
        """Whether the job's coordinator of ``generation`` is there; later calls for the job
        go to it."""
        ...

    def snapshot(self, job_id: str) -> JobSnapshot: ...

    def history(self, job_id: str, since: int = 0) -> list[EpochRecord]: ...

    def logs(self, job_id: str, since: int = 0) -> list[LogLine]: ...

    def cancel(self, job_id: str, reason: str) -> JobSnapshot: ...

    def scale(self, job_id: str, workers: int) -> JobSnapshot:
        """Ask for exactly ``workers`` workers. Raises ``InvalidTransition`` if terminal."""
        ...

    def drain(self, job_id: str, worker: str) -> JobSnapshot:
        """Remove ``worker`` at the next step boundary. Raises :class:`WorkerNotFound`,
        :class:`JobConflict` (its last worker) or ``InvalidTransition`` (terminal)."""
        ...

    def release(self, job_id: str) -> None: ...

    def model_files(self, job_id: str) -> dict[str, bytes] | None:
        """The trained model's files the job's coordinator keeps (safetensors and
        manifest), None when it has none (yet)."""
        ...

    def nodes(self) -> list[NodeStatus]: ...

    def scheduling(self, settings: Settings) -> Scheduling | None:
        """The cluster's scheduler (``settings``' policy, round and hold), reached the way
        this client reaches the cluster; None when the cluster has none, and each job then
        starts at once."""
        ...

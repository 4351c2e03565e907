"""The cluster view the service's cluster client returns (:class:`NodeStatus`,
:class:`NodeJob`): :class:`dynabatch.service.ray_client.RayClusterClient`, or
``tests.fakes.FakeCluster`` (in memory, for route and service tests)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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

"""The cluster view the service's cluster client returns (:class:`NodeStatus`,
:class:`NodeJob`): :class:`dynabatch.service.ray_client.RayClusterClient`, or
``tests.fakes.FakeCluster`` (in memory, for route and service tests); and the short name a
Ray node is shown by (:func:`node_label`)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

# A Ray node id is 56 hex digits; its first NODE_CHARS name it wherever we show it (the CLI's
# tables, the job page, the Prometheus labels), as ``git`` names a commit.
NODE_CHARS = 8
_RAY_NODE_ID = re.compile(r"^[0-9a-f]{40,}$")


def node_label(node: str) -> str:
    """A Ray node id cut to its first 8 hex digits; any other name (an address, a host, a
    simulator's node) as it is."""
    return node[:NODE_CHARS] if _RAY_NODE_ID.match(node) else node


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

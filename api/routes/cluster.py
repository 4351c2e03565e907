"""/v1/cluster: the cluster scheduler's last round: nodes and the jobs holding them, the
queue with reasons, and each job's allocation and speed per node type. /v1/nodes: Ray's
nodes, their resources and the jobs whose workers they host."""

from __future__ import annotations

from dynabatch.api.deps import ERRORS, ServiceDep, require_token
from dynabatch.service.cluster_schemas import ClusterState
from dynabatch.service.schemas import ErrorResponse, NodeList
from fastapi import APIRouter, Depends

router = APIRouter(
    tags=["cluster"],
    dependencies=[Depends(require_token)],
    responses=ERRORS,
)


@router.get("/v1/cluster", response_model=ClusterState,
            summary="The cluster scheduler's allocations")
def cluster_state(service: ServiceDep) -> ClusterState:
    """Each node's type, worker slots and the jobs holding them; the queue in order, each
    waiting job with its reason; each job's allocation, workers per node type and its speed
    per type (`measured`: from its own telemetry, else estimated). With no cluster
    scheduler running, `scheduler` is null, the lists are empty and `message` says so."""
    return ClusterState.of(service.cluster_view())


@router.get(
    "/v1/nodes",
    response_model=NodeList,
    summary="Ray nodes",
    responses={503: {"model": ErrorResponse, "description": "Ray is not reachable."}},
)
def list_nodes(service: ServiceDep) -> NodeList:
    return NodeList(nodes=service.nodes())

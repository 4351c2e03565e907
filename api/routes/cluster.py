"""/v1/cluster: the cluster scheduler's last round: nodes and the jobs holding them, the
queue with reasons, and each job's allocation and speed per node type."""

from __future__ import annotations

from dynabatch.api.deps import ERRORS, ServiceDep, require_token
from dynabatch.service.cluster_schemas import ClusterState
from fastapi import APIRouter, Depends

router = APIRouter(
    prefix="/v1/cluster",
    tags=["cluster"],
    dependencies=[Depends(require_token)],
    responses=ERRORS,
)


@router.get("", response_model=ClusterState, summary="The cluster scheduler's allocations")
def cluster_state(service: ServiceDep) -> ClusterState:
    """Each node's type, worker slots and the jobs holding them; the queue in order, each
    waiting job with its reason; each job's allocation, workers per node type and its speed
    per type (`measured`: from its own telemetry, else estimated). With no cluster
    scheduler running, `scheduler` is null, the lists are empty and `message` says so."""
    return ClusterState.of(service.cluster_view())

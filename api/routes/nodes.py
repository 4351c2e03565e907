"""/v1/nodes: Ray's nodes, their resources and the jobs whose workers they host."""

from __future__ import annotations

from dynabatch.api.deps import ERRORS, ServiceDep, require_token
from dynabatch.service.schemas import ErrorResponse, NodeList
from fastapi import APIRouter, Depends

router = APIRouter(
    prefix="/v1/nodes",
    tags=["cluster"],
    dependencies=[Depends(require_token)],
    responses=ERRORS,
)


@router.get(
    "",
    response_model=NodeList,
    summary="Ray nodes",
    responses={503: {"model": ErrorResponse, "description": "Ray is not reachable."}},
)
def list_nodes(service: ServiceDep) -> NodeList:
    return NodeList(nodes=service.nodes())

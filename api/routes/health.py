"""Liveness, readiness (Ray reachable) and the Prometheus exposition."""

from __future__ import annotations

from dynabatch.api.deps import (
    ERRORS,
    ServiceDep,
    require_token_for_health,
    require_token_for_metrics,
)
from dynabatch.service.schemas import Health, Readiness
from fastapi import APIRouter, Depends, Request, Response, status
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

health = APIRouter(
    tags=["health"], dependencies=[Depends(require_token_for_health)], responses=ERRORS
)
metrics = APIRouter(
    tags=["health"], dependencies=[Depends(require_token_for_metrics)], responses=ERRORS
)


@health.get("/healthz", response_model=Health, summary="The API process is up")
def healthz() -> Health:
    return Health(status="ok")


@health.get(
    "/readyz",
    response_model=Readiness,
    summary="Ray is reachable",
    responses={503: {"model": Readiness, "description": "Ray is not reachable."}},
)
def readyz(service: ServiceDep) -> Response:
    cluster = service.cluster
    ready = cluster.ping()
    body = Readiness(
        status="ready" if ready else "unavailable",
        ray=cluster.address,
        embedded=cluster.embedded,
    )
    code = status.HTTP_200_OK if ready else status.HTTP_503_SERVICE_UNAVAILABLE
    return JSONResponse(body.model_dump(), status_code=code)


@metrics.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def prometheus_metrics(request: Request) -> Response:
    # The last render while it is current (api/metrics.py: Exposition) on the event loop;
    # a new one in a worker thread.
    exposition = request.app.state.exposition
    data = exposition.kept()
    if data is None:
        data = await run_in_threadpool(exposition.render)
    return Response(content=data, media_type=CONTENT_TYPE_LATEST)

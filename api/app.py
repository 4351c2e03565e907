"""The FastAPI application: ``create_app(settings, cluster=None, service=None)``, run by
``dynabatch serve`` or ``uvicorn --factory dynabatch.api.app:create_app`` (settings from the
environment). Nothing happens at import time; the lifespan connects to Ray, re-attaches live
jobs and runs the sync loop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

from dynabatch.actors.spec import spec_warnings_caught
from dynabatch.actors.spec.validation import CombinationError
from dynabatch.api.cached import JobViews
from dynabatch.api.metrics import (
    Exposition,
    JobCollector,
    RequestMetricsMiddleware,
    RequestStats,
)
from dynabatch.api.routes import health, jobs, pages
from dynabatch.api.routes.cluster import router as cluster_router
from dynabatch.api.routes.code import code_router
from dynabatch.scheduler.core.lifecycle import InvalidTransition
from dynabatch.service.code_store import CodeRejected
from dynabatch.service.install_check import check_own_install_once
from dynabatch.service.job_service import JobService, build_service
from dynabatch.service.ray_client import RayClusterClient
from dynabatch.service.service_errors import (
    ClusterUnavailable,
    InvalidRequest,
    JobConflict,
    JobNotFound,
    RayCallError,
    WorkerNotFound,
)
from dynabatch.service.settings import Settings
from dynabatch.service.submit_policy import SpecNotAllowed
from fastapi import FastAPI, Request, status
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("dynabatch.api")

DESCRIPTION = """\
Submit, watch, scale and cancel heterogeneity-aware elastic data-parallel training jobs on
Ray. A job with `checkpoint.dir` whose coordinator is lost is resumed from its checkpoint.

When the service runs with `DYNABATCH_API_TOKEN`, job data and every mutation need
`Authorization: Bearer <token>`. Bad input gets 422 with one message per field, and so does a
spec naming user code (`pkg.mod:function`), a `dataset.path` or a `checkpoint.dir` that the
service's settings do not allow.
"""

BODY_PARSE_ERROR = "There was an error parsing the body"
_LOC_PREFIXES = ("body", "query", "path", "header", "cookie")


def _field_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per problem, naming the field (``rebalance.mode``) and what is wrong (a
    spec's invalid combinations, one model-level error, are split into one entry each)."""
    out: list[dict[str, Any]] = []
    for e in errors:
        loc: list[str | int] = [p if isinstance(p, int) else str(p) for p in e.get("loc", ())]
        kind = str(e.get("type", ""))
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, CombinationError):
            for field, problem in cause.problems:
                out.append(
                    {
                        "loc": [*loc, *str(field).split(".")],
                        "field": str(field),
                        "msg": str(problem),
                        "type": kind,
                    }
                )
            continue
        rest = loc[1:] if loc and loc[0] in _LOC_PREFIXES else loc
        field = ".".join(str(p) for p in rest) or ("spec" if loc[:1] == ["body"] else "request")
        msg = str(e.get("msg", "invalid"))
        if kind == "extra_forbidden":
            msg = "unknown field"
        elif kind == "json_invalid":
            loc, field = ["body"], "body"
            msg = f"not valid JSON ({cause})" if cause else "not valid JSON"
        elif loc == ["body"] and kind == "missing":
            msg = "a JSON body is required"
        elif loc == ["body"] and kind in ("model_attributes_type", "dict_type", "model_type"):
            msg = "expected a JSON object of job spec fields"
        msg = msg.removeprefix("Value error, ")
        out.append({"loc": loc, "field": field, "msg": msg, "type": kind})
    return out


# The service's errors answered as ``{"detail": PREFIX + str(err)}`` with their status.
_PLAIN_ERRORS: tuple[tuple[type[Exception], int, str], ...] = (
    (JobNotFound, status.HTTP_404_NOT_FOUND, ""),
    (WorkerNotFound, status.HTTP_404_NOT_FOUND, ""),
    (InvalidTransition, status.HTTP_409_CONFLICT, ""),
    (JobConflict, status.HTTP_409_CONFLICT, ""),
    (ClusterUnavailable, status.HTTP_503_SERVICE_UNAVAILABLE, "Ray is not reachable: "),
    (RayCallError, status.HTTP_502_BAD_GATEWAY, "Ray call failed: "),
)


def _plain_error(code: int, prefix: str) -> Callable[[Request, Exception], Awaitable[Response]]:
    async def handle(_: Request, err: Exception) -> Response:
        return JSONResponse({"detail": f"{prefix}{err}"}, status_code=code)

    return handle


def _field_problems(problems: Iterable[tuple[str, str]], kind: str) -> JSONResponse:
    """A 422 naming each body field (``body``: the body as a whole) and its problem, as the
    spec's validation errors do."""
    detail = [
        {"loc": ["body", *([] if field == "body" else field.split("."))], "field": field,
         "msg": msg, "type": kind}
        for field, msg in problems
    ]
    return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            {"detail": _field_errors(list(err.errors()))},
            status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        # FastAPI answers 400 for a body it cannot decode (not UTF-8, say); that is bad
        # input like any other, so it gets the same 422 shape.
        if err.status_code == status.HTTP_400_BAD_REQUEST and err.detail == BODY_PARSE_ERROR:
            why = "not valid JSON (cannot decode the body)"
            return _field_problems([("body", why)], "body_decode")
        return await http_exception_handler(request, err)

    for exc, code, prefix in _PLAIN_ERRORS:
        app.add_exception_handler(exc, _plain_error(code, prefix))

    @app.exception_handler(CodeRejected)
    async def code_rejected(_: Request, err: CodeRejected) -> JSONResponse:
        return _field_problems([("body", str(err))], "invalid_archive")

    @app.exception_handler(InvalidRequest)
    async def invalid_request(_: Request, err: InvalidRequest) -> JSONResponse:
        return _field_problems([(err.field, err.message)], "value_error")

    @app.exception_handler(SpecNotAllowed)
    async def not_allowed(_: Request, err: SpecNotAllowed) -> JSONResponse:
        # The same shape as the spec's validation errors: one entry per field.
        return _field_problems(err.problems, "not_allowed")

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(
            {"detail": f"internal error ({type(err).__name__})"},
            status_code=status.HTTP_500_INTERNAL_SERVER_ERROR,
        )


class JsonTooLarge:
    """413 as the API's JSON error, naming the limit the request met (Starlette keeps it in
    the request's scope). FastAPI's body limit is Starlette's ``RequestBodyLimitMiddleware``:
    a body over it is answered from inside that middleware, in plain text, outside every
    exception handler, and a declared ``Content-Length`` over it replaces whatever the app
    answered. So the only place to give that answer the API's shape is around the whole
    middleware stack: this rewrites any 413 on its way out."""

    def __init__(self, app: ASGIApp, default_limit: int | None):
        self.app = app
        self.default_limit = default_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        replaced = False

        async def send_json(message: Message) -> None:
            nonlocal replaced
            if replaced:
                return  # the plain-text body that went with the replaced start
            if message["type"] == "http.response.start" and message["status"] == 413:
                replaced = True
                limit = scope.get(MAX_BODY_SIZE_SCOPE_KEY, self.default_limit)
                detail = "request body too large" + (
                    "" if limit is None else f": this endpoint takes at most {limit} bytes")
                body = json.dumps({"detail": detail}).encode()
                await send({"type": "http.response.start", "status": 413, "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ]})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, send_json)


class _SpecWarningsSilenced:
    """Requests are answered without issuing a spec's :class:`SpecWarning`\\ s in the
    service's process (FastAPI's reading of a body, its re-validation of an answer that
    holds a stored spec): the submitter gets them in the reply's ``warnings``
    (``api/routes/jobs.py``), and the service's log never shows them."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        with spec_warnings_caught():  # this request's task only (a context variable)
            await self.app(scope, receive, send)


class _App(FastAPI):
    def build_middleware_stack(self) -> ASGIApp:
        # Around everything, FastAPI's body limit included: see JsonTooLarge.
        return _SpecWarningsSilenced(
            JsonTooLarge(super().build_middleware_stack(), self.max_body_size))


def create_app(
    settings: Settings | None = None,
    cluster: RayClusterClient | None = None,
    service: JobService | None = None,
) -> FastAPI:
    # Also under a plain `uvicorn --factory dynabatch.api.app:create_app`: the packages must be ours
    # (service/install_check.py); a clash fails here with one line.
    check_own_install_once()
    settings = settings if settings is not None else Settings()
    owns_service = service is None
    svc = service if service is not None else build_service(settings, cluster)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Blocking on purpose: no request is served yet (or any more), and under uvicorn
        # this keeps ray.init on the main thread.
        svc.cluster.connect()
        svc.reconciler.start()
        try:
            yield
        finally:
            svc.reconciler.stop()
            if owns_service:
                svc.cluster.close()
                svc.store.close()

    app = _App(
        title="dynabatch",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        # FastAPI's own request body limit: a declared Content-Length over it is refused
        # before the body is read, a chunked body once it passes the limit (413, JSON).
        # Code uploads (POST /v1/code) have their own, DYNABATCH_MAX_CODE_BYTES.
        max_body_size=settings.max_body_bytes,
        openapi_tags=[
            {"name": "jobs", "description": "Training jobs."},
            {"name": "cluster", "description": "The Ray cluster."},
            {"name": "health", "description": "Liveness, readiness and metrics."},
        ],
    )
    registry = CollectorRegistry()
    requests = RequestStats()
    registry.register(JobCollector(svc, requests))
    app.state.settings = settings
    app.state.service = svc
    app.state.registry = registry
    app.state.exposition = Exposition(registry, svc)
    app.state.views = JobViews(svc)

    _install_error_handlers(app)
    app.include_router(jobs.router)
    app.include_router(code_router(settings.max_code_bytes))
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=pages.STATIC_DIR), name="static")
    app.include_router(cluster_router)
    app.include_router(health.health)
    app.include_router(health.metrics)
    # Outside the app's body limit: metrics see every response, 413s included.
    app.add_middleware(RequestMetricsMiddleware, stats=requests)
    return app

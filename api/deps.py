"""Shared route dependencies: the app's JobService and settings, and the bearer-token check.

They are ``async def`` on purpose: they do no I/O, and FastAPI runs a plain ``def``
dependency in a worker thread: a hand-off to the thread pool and back for each of them on
every request (under load, most of a cheap request's CPU).
"""

from __future__ import annotations

import secrets
from typing import Annotated

from dynabatch.service.job_service import JOB_ID_PATTERN, WORKER_ID_PATTERN, JobService
from dynabatch.service.schemas import JOB_ID_EXAMPLE, ErrorResponse
from dynabatch.service.settings import Settings
from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

_bearer = HTTPBearer(
    auto_error=False,
    description="Needed when the service runs with DYNABATCH_API_TOKEN set.",
)


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_service(request: Request) -> JobService:
    return request.app.state.service


def token_ok(settings: Settings, creds: HTTPAuthorizationCredentials | None) -> bool:
    """Whether the request may read job data: no token is configured, or it sent that one."""
    token = settings.token
    if token is None:
        return True
    given = creds.credentials if creds is not None else ""
    return secrets.compare_digest(given.encode(), token.encode())


def _check(settings: Settings, creds: HTTPAuthorizationCredentials | None) -> None:
    if not token_ok(settings, creds):
        given = creds.credentials if creds is not None else ""
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="missing or invalid bearer token" if given else "missing bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )


SettingsDep = Annotated[Settings, Depends(get_settings)]
ServiceDep = Annotated[JobService, Depends(get_service)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


async def require_token(settings: SettingsDep, creds: Credentials) -> None:
    """Job data and every mutation need the token, when one is configured."""
    _check(settings, creds)


async def require_token_for_health(settings: SettingsDep, creds: Credentials) -> None:
    if settings.auth_health:
        _check(settings, creds)


async def require_token_for_metrics(settings: SettingsDep, creds: Credentials) -> None:
    if settings.auth_metrics:
        _check(settings, creds)


JobId = Annotated[
    str,
    Path(
        pattern=JOB_ID_PATTERN,
        description="12 lowercase hex digits, as returned by POST /v1/jobs.",
        examples=[JOB_ID_EXAMPLE],
    ),
]

WorkerId = Annotated[
    str,
    Path(
        pattern=WORKER_ID_PATTERN,
        description="A worker of the job, as listed in its `workers` (e.g. w0, w12).",
        examples=["w1"],
    ),
]

ERRORS = {
    401: {"model": ErrorResponse, "description": "Missing or invalid bearer token."},
    413: {"model": ErrorResponse, "description": "Request body too large (the detail names "
          "the limit)."},
}
NOT_FOUND = {404: {"model": ErrorResponse, "description": "No job with this id."}}

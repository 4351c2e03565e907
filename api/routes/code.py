"""POST /v1/code: upload the code a job ships (``dynabatch submit --working-dir``).

The zip has its own body limit (``DYNABATCH_MAX_CODE_BYTES``). Uploading needs what running
shipped code needs (``DYNABATCH_USER_CODE_MODULES='*'`` and a ``DYNABATCH_CODE_ROOT``);
without them the answer is 403 and nothing is read.
"""

from __future__ import annotations

from dynabatch.api.deps import ERRORS, SettingsDep, require_token
from dynabatch.service.code_store import store_code
from dynabatch.service.schemas import CodeUploaded, ErrorResponse, ValidationErrorResponse
from dynabatch.service.submit_policy import shipping_refusal
from fastapi import APIRouter, Depends, HTTPException, Request, status
from starlette.concurrency import run_in_threadpool

_BODY = {
    "required": True,
    "content": {"application/zip": {"schema": {"type": "string", "format": "binary"}}},
}


def _allowed(settings: SettingsDep) -> None:
    refusal = shipping_refusal(settings.submit_policy)
    if refusal:
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail=refusal)


def code_router(max_bytes: int) -> APIRouter:
    """The upload route, with ``max_bytes`` as its own body limit (a setting)."""
    router = APIRouter(prefix="/v1/code", tags=["jobs"], responses=ERRORS,
                       dependencies=[Depends(require_token), Depends(_allowed)])

    @router.post(
        "",
        status_code=status.HTTP_201_CREATED,
        response_model=CodeUploaded,
        summary="Upload code to ship with jobs",
        max_body_size=max_bytes,
        openapi_extra={"requestBody": _BODY},
        responses={
            403: {"model": ErrorResponse, "description": "The service takes no shipped code."},
            413: {"model": ErrorResponse, "description": "Larger than DYNABATCH_MAX_CODE_BYTES."},
            422: {"model": ValidationErrorResponse, "description": "Not a usable zip."},
        },
    )
    async def upload_code(request: Request, settings: SettingsDep) -> CodeUploaded:
        """A zip of the job's code; Ray unpacks it on every node, removing a single top-level
        directory. Name the answer's `working_dir` in the job spec. The same zip gives the
        same URI."""
        data = await request.body()  # a bad zip: CodeRejected, a 422 (dynabatch.api.app)
        return await run_in_threadpool(store_code, data, settings.code_root)

    return router

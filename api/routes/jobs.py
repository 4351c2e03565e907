"""/v1/jobs: submit, list, inspect, history, logs, cancel, scale, drain, resume, the trained
model (a zip: ``dynabatch.service.artifacts`` finds the files) and the job's events.

Thin: JobService does the work.

``GET /v1/jobs/{id}/events`` streams the job as server-sent events, as they happen: ``job``
(:class:`~dynabatch.service.schemas.JobDetail`) whenever it changed, ``epoch`` (each
finished epoch's record), ``log`` (each log line, the workers' own output included, with its
sequence number as the event id, so a reconnecting client sends ``Last-Event-ID`` or
``?since=`` and misses nothing) and ``end`` (the final job, once it is terminal and
everything before it was sent). It polls the store every ``interval_s``, so it shows exactly
what ``GET /v1/jobs/{id}``, ``/history`` and ``/logs`` show.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from dynabatch.actors.export import ExportError, hf_files
from dynabatch.actors.spec import JobSpec, spec_warnings_caught
from dynabatch.api.cached import JobViews
from dynabatch.api.deps import ERRORS, NOT_FOUND, JobId, ServiceDep, WorkerId, require_token
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.service.artifacts import job_model, zip_model
from dynabatch.service.schemas import (
    CancelRequest,
    ErrorResponse,
    JobDetail,
    JobHistory,
    JobList,
    JobLogs,
    JobSubmitted,
    ScaleRequest,
)
from dynabatch.service.service_errors import JobConflict
from fastapi import APIRouter, Body, Depends, Header, Query, Request, Response, status
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

router = APIRouter(
    prefix="/v1/jobs",
    tags=["jobs"],
    dependencies=[Depends(require_token)],
    responses=ERRORS,
)

_SPEC_EXAMPLES = {
    "digits": {
        "summary": "Digits, two workers, one twice as slow",
        "value": {
            "name": "digits-hetero",
            "dataset": {"name": "digits"},
            "workers": 2,
            "global_batch": 64,
            "epochs": 3,
            "policy": "affine",
            "emulation": {"slowdowns": [1, 2]},
        },
    },
    "minimal": {"summary": "All defaults", "value": {}},
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobSubmitted,
    summary="Submit a job",
    responses={503: {"model": ErrorResponse, "description": "Ray is not reachable."}},
)
def submit_job(
    spec: Annotated[JobSpec, Body(openapi_examples=_SPEC_EXAMPLES)],
    service: ServiceDep,
    response: Response,
) -> JobSubmitted:
    """Start a training job. The body is the same job spec as the CLI's YAML config.

    422 also for a spec naming user code (`pkg.mod:function`) outside the modules the service
    allows (`DYNABATCH_USER_CODE_MODULES`), a `dataset.path` outside `DYNABATCH_DATA_ROOTS` or
    a `checkpoint.dir` outside `DYNABATCH_CHECKPOINT_ROOT`; such a job is not stored."""
    rec = service.submit(spec)
    response.headers["Location"] = f"/v1/jobs/{rec.id}"
    with spec_warnings_caught() as warnings:  # accepted settings that have no effect
        JobSpec.model_validate(spec.model_dump())
    return JobSubmitted(
        job_id=rec.id,
        name=rec.name,
        state=rec.state,
        reason=rec.reason,
        warnings=warnings,
    )


# The reads that clients poll are async and answered from JobViews (api/cached.py): the
# serialized answer kept while the store's version of it is unchanged, so a poll costs no
# query, no model and no thread hand-off; a stale one is rebuilt in a worker thread. They
# carry an ETag and answer 304 to a matching If-None-Match.
_CACHED = {304: {"description": "Not modified: the `If-None-Match` ETag is current."}}


def _views(request: Request) -> JobViews:
    return request.app.state.views


@router.get("", response_model=JobList, summary="List jobs, newest first", responses=_CACHED)
async def list_jobs(
    request: Request,
    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> Response:
    return await _views(request).answer(request, ("list", state, offset, limit))


@router.get("/{job_id}", response_model=JobDetail, summary="A job's state",
            responses={**NOT_FOUND, **_CACHED})
async def get_job(job_id: JobId, request: Request) -> Response:
    """State, epoch, step, the latest per-worker allocation and telemetry, loss, accuracy."""
    return await _views(request).answer(request, ("job", job_id))


@router.get(
    "/{job_id}/history",
    response_model=JobHistory,
    summary="Per-epoch records",
    responses={**NOT_FOUND, **_CACHED},
)
async def get_history(
    job_id: JobId,
    request: Request,
    since: Annotated[int, Query(ge=0, le=2**31 - 1, description="First epoch.")] = 0,
) -> Response:
    return await _views(request).answer(request, ("history", job_id, since))


@router.get("/{job_id}/logs", response_model=JobLogs, summary="Log lines", responses=NOT_FOUND)
def get_logs(
    job_id: JobId,
    service: ServiceDep,
    since: Annotated[int, Query(ge=0, le=2**62, description="First sequence number.")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> JobLogs:
    lines = service.logs(job_id, since, limit)
    return JobLogs(job_id=job_id, lines=lines, next_since=lines[-1].seq + 1 if lines else since)


@router.post(
    "/{job_id}/cancel",
    response_model=JobDetail,
    summary="Cancel a job",
    responses={
        **NOT_FOUND,
        409: {"model": ErrorResponse, "description": "The job already finished."},
        503: {"model": ErrorResponse, "description": "Ray is not reachable."},
    },
)
def cancel_job(
    job_id: JobId,
    service: ServiceDep,
    body: Annotated[CancelRequest | None, Body()] = None,
) -> JobDetail:
    reason = body.reason if body is not None else CancelRequest().reason
    return JobDetail.of(service.cancel(job_id, reason))


_UNAVAILABLE = {503: {"model": ErrorResponse, "description": "Ray is not reachable."}}
_SCALE_EXAMPLES = {
    "down": {"summary": "Shrink to two workers", "value": {"workers": 2}},
    "up": {"summary": "Grow to four workers (needs free eligible nodes)", "value": {"workers": 4}},
}


@router.post(
    "/{job_id}/scale",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobDetail,
    summary="Change a job's number of workers",
    responses={
        **NOT_FOUND,
        409: {"model": ErrorResponse, "description": "The job already finished."},
        **_UNAVAILABLE,
    },
)
def scale_job(
    job_id: JobId,
    body: Annotated[ScaleRequest, Body(openapi_examples=_SCALE_EXAMPLES)],
    service: ServiceDep,
) -> JobDetail:
    """Run the job with exactly `workers` workers from its next step boundary on: the slowest
    workers (by measured throughput) leave gracefully (their share of the epoch goes to the
    others), or new ones start on eligible nodes with room (several on one node when its
    CPUs hold them). The answer is the job as it is now; watch `workers` and `generation`
    change. When the nodes have no room for all of them, its `reason` says so at once (and
    keeps saying it while so). A job resumed from its checkpoint later keeps this size.

    422 when the job's `global_batch` cannot be split that many ways."""
    return JobDetail.of(service.scale(job_id, body.workers))


@router.delete(
    "/{job_id}/workers/{worker}",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobDetail,
    summary="Drain one worker",
    responses={
        404: {"model": ErrorResponse, "description": "No such job, or no such worker in it."},
        409: {
            "model": ErrorResponse,
            "description": "The worker is the job's last one, or the job already finished.",
        },
        **_UNAVAILABLE,
    },
)
def drain_worker(job_id: JobId, worker: WorkerId, service: ServiceDep) -> JobDetail:
    """Remove the worker gracefully at the job's next step boundary (its node can then be
    taken down); the job goes on with one worker fewer. Worker ids are those listed in the
    job's `workers`."""
    return JobDetail.of(service.drain(job_id, worker))


@router.post(
    "/{job_id}/resume",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobDetail,
    summary="Resume a job from its checkpoint",
    responses={
        **NOT_FOUND,
        409: {
            "model": ErrorResponse,
            "description": "The job SUCCEEDED or was CANCELLED, has no checkpoint, its "
            "coordinator is alive, or its spec is not allowed by the service's settings.",
        },
        **_UNAVAILABLE,
    },
)
def resume_job(job_id: JobId, service: ServiceDep) -> JobDetail:
    """Start a new coordinator for a FAILED job (or a live one whose coordinator is gone)
    from the checkpoint in its `checkpoint.dir`. The job becomes PENDING, then RUNNING from
    the checkpointed epoch and step. The service does this by itself when it finds a
    coordinator dead (up to `DYNABATCH_AUTO_RESUME_LIMIT` times without the job finishing an
    epoch in between)."""
    return JobDetail.of(service.resume(job_id))


@router.get(
    "/{job_id}/model",
    summary="Download the job's trained model",
    response_class=Response,
    responses={
        200: {
            "content": {"application/zip": {}},
            "description": "A zip of model.safetensors (the final weights), "
            "best.safetensors (when kept) and manifest.json.",
        },
        **NOT_FOUND,
        409: {"model": ErrorResponse, "description": "The job has no trained weights yet."},
    },
)
def get_model(job_id: JobId, service: ServiceDep,
              format: Literal["dynabatch", "hf"] = "dynabatch") -> Response:
    """The job's trained model, written at its end: `model.safetensors`, `best.safetensors`
    when the job kept the best by metric, and `manifest.json` (the spec, the model builder,
    input shape, epoch, metrics, dtypes). `dynabatch.load_model(DIR)` rebuilds the module
    from the unpacked directory; any safetensors reader takes the weights. `format=hf`: a
    Hugging Face folder instead (`config.json` with `id2label` when the spec names
    `dataset.labels`, `model.safetensors`, the job's tokenizer), which
    `transformers.AutoModelFor...from_pretrained(DIR)` loads (409 for a model that is not
    `model.name: hf`)."""
    files = job_model(service, job_id)
    if format == "hf":
        try:
            files = hf_files(files)
        except ExportError as err:
            raise JobConflict(str(err)) from None
    return Response(
        zip_model(files),
        media_type="application/zip",
        headers={"Content-Disposition": f'attachment; filename="dynabatch-{job_id}-model.zip"'},
    )


def _existing(job_id: JobId, service: ServiceDep) -> str:
    # A dependency, so an unknown job is a 404 before the stream starts.
    service.get(job_id)
    return job_id


def _first_log(since: int, last_event_id: str | None) -> int:
    if last_event_id and last_event_id.isdigit():
        return max(since, int(last_event_id) + 1)
    return since


@router.get("/{job_id}/events", response_class=EventSourceResponse, responses=NOT_FOUND,
            summary="Live job, epochs and logs (server-sent events)")
async def job_events(
    request: Request,
    job_id: Annotated[str, Depends(_existing)],
    service: ServiceDep,
    since: Annotated[int, Query(ge=0, le=2**62, description="First log sequence number.")] = 0,
    epochs_since: Annotated[int, Query(ge=0, le=2**31 - 1, description="First epoch.")] = 0,
    interval_s: Annotated[float, Query(ge=0.02, le=10.0)] = 0.5,
    last_event_id: Annotated[str | None, Header()] = None,
) -> AsyncIterator[ServerSentEvent]:
    """`job`, `epoch`, `log` and a final `end` event; see the module docstring."""
    next_log = _first_log(since, last_event_id)
    next_epoch = epochs_since
    last_job = None
    while True:
        # Read the state first: when it is terminal, the history and logs read after it
        # are complete, and `end` is the last event.
        job = JobDetail.of(await run_in_threadpool(service.get, job_id))
        for rec in await run_in_threadpool(service.history, job_id, next_epoch):
            yield ServerSentEvent(event="epoch", data=rec.model_dump(mode="json"))
            next_epoch = rec.epoch + 1
        while True:
            lines = await run_in_threadpool(service.logs, job_id, next_log, 1000)
            for line in lines:
                yield ServerSentEvent(event="log", id=str(line.seq),
                                      data=line.model_dump(mode="json"))
                next_log = line.seq + 1
            if len(lines) < 1000:
                break
        dumped = job.model_dump(mode="json")
        if dumped != last_job:
            yield ServerSentEvent(event="job", data=dumped)
            last_job = dumped
        if job.state.is_terminal:
            yield ServerSentEvent(event="end", data=dumped)
            return
        if await request.is_disconnected():
            return
        await asyncio.sleep(interval_s)

"""GET /v1/jobs/{id}/events: the job as server-sent events (FastAPI's EventSourceResponse).

A client (``dynabatch submit``, the job page, ``curl -N``) gets, as they happen:

* ``job``: the job (:class:`dynabatch.service.schemas.JobDetail`) whenever it changed;
* ``epoch``: each finished epoch's record (:class:`dynabatch.scheduler.telemetry.EpochRecord`);
* ``log``: each log line (:class:`dynabatch.scheduler.telemetry.LogLine`, the workers' own output
  included), with the line's sequence number as the event id, so a reconnecting client
  sends ``Last-Event-ID`` (or ``?since=``) and misses nothing;
* ``end``: the final job, once it is terminal and everything before it was sent; the
  stream then closes.

The stream reads what the service stores (it polls the store every ``interval_s``), so it
shows exactly what ``GET /v1/jobs/{id}``, ``/history`` and ``/logs`` show.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated

from dynabatch.api.deps import ERRORS, NOT_FOUND, JobId, ServiceDep, require_token
from dynabatch.service.schemas import JobDetail
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(require_token)],
                   responses=ERRORS)


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

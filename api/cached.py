"""The job reads that clients poll (a job's status, its history, the job list) as serialized
JSON kept between requests, with an ``ETag``.

Each answer is built once from the store and kept with the store version it was read at
(:meth:`dynabatch.service.store.JobStore.row_version` and friends); while that version is
unchanged, a request is answered with the kept bytes: no query, no model, no thread hand-off.
A request whose ``If-None-Match`` names the body's ``ETag`` gets ``304 Not Modified``.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from dynabatch.service.cluster_schemas import scheduler_note
from dynabatch.service.job_service import JobService
from dynabatch.service.schemas import JobDetail, JobHistory, JobList, JobSummary
from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool

JSON = "application/json"
KEPT = 256  # answers kept (each job's status and history, a few list pages)


@dataclass(frozen=True, slots=True)
class Body:
    """One serialized answer and the version of the store it was read at."""

    version: object
    data: bytes
    etag: str

    def response(self, request: Request) -> Response:
        headers = {"ETag": self.etag, "Cache-Control": "no-cache"}
        # A weak comparison (RFC 9110 13.1.2): ``W/`` prefixes are ignored; ``*`` matches any.
        tags = [t.strip().removeprefix("W/") for t in request.headers.get("if-none-match", "")
                .split(",")]
        if "*" in tags or self.etag in tags:
            return Response(status_code=304, headers=headers)
        return Response(self.data, media_type=JSON, headers=headers)


def etag_of(data: bytes) -> str:
    return '"' + hashlib.blake2b(data, digest_size=12).hexdigest() + '"'


class JobViews:
    """Serialized status, history and list answers. :meth:`kept` never does I/O (an async
    route calls it on the event loop); the others read the store in a worker thread."""

    def __init__(self, service: JobService):
        self.service = service
        self._items: OrderedDict[Hashable, Body] = OrderedDict()
        self._lock = threading.Lock()  # the dict
        self._build = threading.Lock()  # one build at a time: concurrent misses share it

    # Versions: read without I/O ---------------------------------------------------------
    def _version(self, key: tuple) -> object:
        store = self.service.store
        kind = key[0]
        if kind == "job":
            # A live job's reason may come from the cluster scheduler's round, not the store.
            return store.row_version(key[1]), scheduler_note(self.service.cluster_view(), key[1])
        if kind == "history":
            return store.history_version(key[1])
        # What of the cluster scheduler's round a job list shows: each job's note (the
        # queue's reason, what a scale waits for, a grant).
        view = self.service.cluster_view()
        notes = () if view is None else tuple(
            (j.job_id, scheduler_note(view, j.job_id)) for j in view.jobs)
        return store.rows_version, notes

    def kept(self, key: tuple) -> Body | None:
        """The kept answer for ``key`` when it is current, else None. No I/O."""
        version = self._version(key)
        with self._lock:
            body = self._items.get(key)
            if body is None or body.version != version:
                return None
            self._items.move_to_end(key)
            return body

    def _make(self, key: tuple) -> bytes:
        """The serialized answer for ``key``, read from the store. Raises JobNotFound."""
        kind, *args = key
        if kind == "job":
            return JobDetail.of(self.service.get(args[0])).model_dump_json().encode()
        if kind == "history":
            records = self.service.history(*args)
            return JobHistory(job_id=args[0], records=records).model_dump_json().encode()
        state, offset, limit = args
        records, total = self.service.list(state, offset=offset, limit=limit)
        return JobList(items=[JobSummary.of(r) for r in records], total=total,
                       offset=offset, limit=limit).model_dump_json().encode()

    def _get(self, key: tuple) -> Body:
        body = self.kept(key)
        if body is not None:
            return body
        with self._build:
            body = self.kept(key)  # another request built it while this one waited
            if body is not None:
                return body
            version = self._version(key)  # before the read: a write during it is news
            data = self._make(key)
            body = Body(version, data, etag_of(data))
        with self._lock:
            self._items[key] = body
            self._items.move_to_end(key)
            while len(self._items) > KEPT:
                self._items.popitem(last=False)
        return body

    async def answer(self, request: Request, key: tuple) -> Response:
        """The answer for ``key``: ``("job", id)``, ``("history", id, since)`` or ``("list",
        state, offset, limit)``; kept, else built in a worker thread. Raises JobNotFound."""
        body = self.kept(key)
        if body is None:
            body = await run_in_threadpool(self._get, key)
        return body.response(request)

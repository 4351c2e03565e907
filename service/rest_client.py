"""A Python client for the dynabatch REST API, on httpx.

Connection errors are retried (tenacity) where it is safe: a connect failure never reached
the server, so any request is retried; read failures are retried for GETs only. Every
failure surfaces as :class:`ApiError` with a one-line message.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx
from dynabatch.actors.errors import first_line
from dynabatch.actors.spec import JobSpec, spec_warnings_caught
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.telemetry import LogLine
from dynabatch.service.cluster_schemas import ClusterState
from dynabatch.service.code_store import local_working_dir, zip_directory
from dynabatch.service.schemas import (
    CodeUploaded,
    JobDetail,
    JobHistory,
    JobList,
    JobLogs,
    JobSubmitted,
    NodeList,
)
from pydantic import BaseModel, ValidationError
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

DEFAULT_URL = "http://127.0.0.1:8000"

M = TypeVar("M", bound=BaseModel)

_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
_READ_ERRORS = (httpx.ReadError, httpx.ReadTimeout, httpx.RemoteProtocolError)


class ApiError(Exception):
    """A request that failed: ``status`` is the HTTP status, or None when nothing answered."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message

    def _render_traceback_(self) -> list[str]:
        """What IPython (a notebook) shows when this is not caught: the one line, as the CLI
        prints it; the frames are all the client's own, never the cause."""
        return [f"{type(self).__name__}: {self.message}"]


class ConnectionFailed(ApiError):
    pass


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        text = " ".join(response.text.split())[:200]
        return text or response.reason_phrase or f"HTTP {response.status_code}"
    detail = body.get("detail") if isinstance(body, dict) else body
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict):
                field = item.get("field") or ".".join(str(p) for p in item.get("loc", []))
                parts.append(f"{field}: {item.get('msg', 'invalid')}")
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return " ".join(str(detail).split())


class DynabatchClient:
    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        retries: int = 4,
        retry_wait_s: float = 0.25,
        transport: httpx.BaseTransport | None = None,
        token_hint: str = "",
    ):
        """``transport`` carries the requests instead of the network (httpx's own
        ``MockTransport``, or a test's transport to an app in the same process);
        ``token_hint`` ends a 401's message (how the caller's user gives a token)."""
        self.url = url.rstrip("/")
        self.token_hint = token_hint
        self.retries = max(1, retries)
        self.retry_wait_s = retry_wait_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> DynabatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Plumbing ---------------------------------------------------------------------------
    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self._headers, **kwargs.pop("headers", {})}
        retryable = _CONNECT_ERRORS + (_READ_ERRORS if method == "GET" else ())
        retrying = Retrying(
            retry=retry_if_exception_type(retryable),
            stop=stop_after_attempt(self.retries),
            wait=wait_exponential(multiplier=self.retry_wait_s, max=4.0),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    return self._http.request(method, path, headers=headers, **kwargs)
        except httpx.TimeoutException as err:
            raise ConnectionFailed(
                f"the dynabatch API at {self.url} did not answer in time ({type(err).__name__})"
            ) from None
        except httpx.TransportError as err:
            why = str(err) or type(err).__name__
            raise ConnectionFailed(f"cannot reach the dynabatch API at {self.url}: {why}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _failed(self, response: httpx.Response) -> ApiError:
        hint = self.token_hint if response.status_code == 401 else ""
        return ApiError(_error_message(response) + hint, response.status_code)

    def _call(self, model: type[M], method: str, path: str, **kwargs: Any) -> M:
        response = self._send(method, path, **kwargs)
        if response.status_code >= 400:
            raise self._failed(response)
        try:
            # A job's spec in an answer was warned about when it was submitted: reading
            # the job (status, polling, scale) never warns again.
            with spec_warnings_caught():
                return model.model_validate(response.json())
        except (ValueError, ValidationError) as err:
            first = first_line(err, typed=False, limit=None)
            raise ApiError(f"unexpected response from {method} {path}: {first}") from None

    # API --------------------------------------------------------------------------------
    def submit(self, spec: Mapping[str, Any] | JobSpec) -> JobSubmitted:
        body = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else dict(spec)
        return self._call(JobSubmitted, "POST", "/v1/jobs", json=body)

    def submit_with_code(self, spec: dict[str, Any], *, what: str = "working_dir"
                         ) -> JobSubmitted:
        """Submit ``spec``, first uploading its ``working_dir`` when that names a directory on
        this machine (the service may run anywhere); a refused upload's :class:`ApiError`
        starts with ``what``, the option or field the directory came from."""
        named = spec.get("working_dir")
        if local_working_dir(named):
            try:
                shipped = self.upload_code(zip_directory(Path(named)))
            except ApiError as err:
                raise type(err)(f"{what}: {err}", err.status) from None
            spec = {**spec, "working_dir": shipped.working_dir}
        return self.submit(spec)

    def upload_code(self, archive: bytes) -> CodeUploaded:
        """Upload a zip of code to ship with jobs (``dynabatch.service.code_store.zip_directory``);
        the answer's ``working_dir`` goes into the job spec."""
        # Uploading may take longer than an API call: a generous write and read timeout.
        timeout = httpx.Timeout(10.0, write=300.0, read=120.0)
        return self._call(CodeUploaded, "POST", "/v1/code", content=archive, timeout=timeout,
                          headers={"Content-Type": "application/zip"})

    def list(
        self, state: JobState | str | None = None, *, offset: int = 0, limit: int = 50
    ) -> JobList:
        params: dict[str, Any] = {"offset": offset, "limit": limit}
        if state is not None:
            try:
                params["state"] = JobState(str(state).upper()).value
            except ValueError:
                names = ", ".join(s.value for s in JobState)
                raise ValueError(f"state: {state!r} is not one of {names}") from None
        return self._call(JobList, "GET", "/v1/jobs", params=params)

    def get(self, job_id: str) -> JobDetail:
        return self._call(JobDetail, "GET", f"/v1/jobs/{job_id}")

    def history(self, job_id: str, since: int = 0) -> JobHistory:
        return self._call(JobHistory, "GET", f"/v1/jobs/{job_id}/history", params={"since": since})

    def logs(self, job_id: str, since: int = 0, limit: int = 1000) -> JobLogs:
        return self._call(
            JobLogs, "GET", f"/v1/jobs/{job_id}/logs", params={"since": since, "limit": limit}
        )

    def read_logs(self, job_id: str, since: int, each: Callable[[LogLine], None]) -> int:
        """Every log line of the job from ``since`` on, page after page (the API serves at
        most a page a request), to ``each``; returns the sequence number after the last."""
        while True:
            page = self.logs(job_id, since)
            for line in page.lines:
                each(line)
            if not page.lines:
                return since
            since = page.next_since

    def events(self, job_id: str, *, since: int = 0, interval_s: float = 0.5
               ) -> Iterator[tuple[str, dict[str, Any]]]:
        """The job's server-sent events (``job``, ``epoch``, ``log``, ``end``) as
        ``(event, data)`` until ``end``. A dropped connection is resumed from the last log
        line and epoch received (up to ``retries`` times in a row)."""
        next_log, next_epoch, drops = since, 0, 0
        # The server sends a keep-alive comment every 15 s: a longer silence is a dead link.
        timeout = httpx.Timeout(10.0, read=45.0)
        while True:
            params = {"since": next_log, "epochs_since": next_epoch, "interval_s": interval_s}
            try:
                with self._http.stream("GET", f"/v1/jobs/{job_id}/events", params=params,
                                       headers=self._headers, timeout=timeout) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise self._failed(response)
                    for event, data in _parse_sse(response.iter_lines()):
                        drops = 0
                        if event == "log":
                            next_log = int(data["seq"]) + 1
                        elif event == "epoch":
                            next_epoch = int(data["epoch"]) + 1
                        yield event, data
                        if event == "end":
                            return
            except (*_CONNECT_ERRORS, *_READ_ERRORS) as err:
                drops += 1
                if drops >= self.retries:
                    raise ConnectionFailed(
                        f"lost the event stream of job {job_id} at {self.url}: "
                        f"{str(err) or type(err).__name__}"
                    ) from None
                time.sleep(self.retry_wait_s)
            else:
                drops += 1  # closed without `end` (a restart of the service): resume
                if drops >= self.retries:
                    raise ConnectionFailed(f"the event stream of job {job_id} keeps closing")

    def cancel(self, job_id: str, reason: str | None = None) -> JobDetail:
        body = {"reason": reason} if reason else None
        return self._call(JobDetail, "POST", f"/v1/jobs/{job_id}/cancel", json=body)

    def scale(self, job_id: str, workers: int) -> JobDetail:
        return self._call(
            JobDetail, "POST", f"/v1/jobs/{job_id}/scale", json={"workers": workers}
        )

    def drain(self, job_id: str, worker: str) -> JobDetail:
        return self._call(JobDetail, "DELETE", f"/v1/jobs/{job_id}/workers/{worker}")

    def resume(self, job_id: str) -> JobDetail:
        return self._call(JobDetail, "POST", f"/v1/jobs/{job_id}/resume")

    def model(self, job_id: str) -> bytes:
        """The job's trained model as a zip (``GET /v1/jobs/{id}/model``): safetensors and
        manifest; ``dynabatch.service.artifacts.unzip_model`` unpacks it."""
        response = self._send("GET", f"/v1/jobs/{job_id}/model")
        if response.status_code >= 400:
            raise self._failed(response)
        return response.content

    def nodes(self) -> NodeList:
        return self._call(NodeList, "GET", "/v1/nodes")

    def cluster(self) -> ClusterState:
        """The cluster scheduler's last round (``GET /v1/cluster``)."""
        return self._call(ClusterState, "GET", "/v1/cluster")

    def wait(self, job_id: str, *, timeout_s: float = 600.0, interval_s: float = 1.0) -> JobDetail:
        """Poll until the job is terminal; raises ApiError on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.get(job_id)
            if job.state.is_terminal:
                return job
            if time.monotonic() >= deadline:
                raise ApiError(f"job {job_id} is still {job.state.value} after {timeout_s:.0f}s")
            time.sleep(interval_s)


def _parse_sse(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(event, JSON data)`` from text/event-stream lines (comments skipped)."""
    event, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)

"""The Python client of a dynabatch service: ``Client(url, token)`` and its :class:`Job` handles.

It is what the ``dynabatch submit``/``status``/``logs``/``scale``/``export`` commands do, from
Python, on :class:`dynabatch.service.rest_client.DynabatchClient`. Failures are the CLI's, as
exceptions with the same one-line messages: :class:`SpecError` for a bad spec (raised before
anything is sent), :class:`ApiError` for what the service refused (``.status`` is the HTTP
status) and :class:`ConnectionFailed` when it cannot be reached.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import httpx
from dynabatch.actors.export import EXPORT_FORMATS
from dynabatch.actors.spec import SpecError, SpecWarning
from dynabatch.api.cli.common import CliError, check_job_id, check_worker
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.telemetry import EpochRecord, LogLine
from dynabatch.service.artifacts import unzip_model, write_hf_export
from dynabatch.service.rest_client import DEFAULT_URL, ApiError, ConnectionFailed, DynabatchClient
from dynabatch.service.schemas import JobDetail, JobSummary
from dynabatch.specs import SpecLike, resolve_spec

__all__ = ["ApiError", "Client", "ConnectionFailed", "Job", "SpecError"]


# The CLI says "pass --token"; from Python the token is Client's argument.
_TOKEN_HINT = " (pass Client(url, token=...) or set DYNABATCH_API_TOKEN to the service's token)"


class Client:
    """A client of the dynabatch REST API at ``url`` (default ``DYNABATCH_URL``, else
    ``http://127.0.0.1:8000``) with the bearer ``token`` (default ``DYNABATCH_API_TOKEN``).

    ``transport`` carries the requests instead of the network (an ``httpx.BaseTransport``:
    httpx's ``MockTransport``, or a test's transport to an app in the same process).
    Use it as a context manager, or call :meth:`close`, to release its connections.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ):
        url = url or os.environ.get("DYNABATCH_URL") or DEFAULT_URL
        if token is None:
            token = os.environ.get("DYNABATCH_API_TOKEN") or None
        self.api = DynabatchClient(url, token=token, timeout=timeout_s,
                                    transport=transport, token_hint=_TOKEN_HINT)

    @property
    def url(self) -> str:
        """The API's base URL."""
        return self.api.url

    def close(self) -> None:
        self.api.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    def submit(self, spec: SpecLike, *, working_dir: str | os.PathLike[str] | None = None) -> Job:
        """Submit a job and return its handle.

        ``spec`` is a :class:`JobSpec`, a dict of its fields or a config file's path (YAML
        or JSON, as ``dynabatch submit`` reads). ``working_dir``, a local directory, ships
        with the job: it is zipped and uploaded (the service must allow user code and keep
        uploads), and the spec's import paths may name its modules; a spec's own local
        ``working_dir`` is shipped the same way. The service's warnings about the spec are
        issued as Python warnings and kept in :attr:`Job.warnings`. Raises
        :class:`SpecError` before anything is sent when the spec is not valid."""
        data, _, what = resolve_spec(spec, working_dir=working_dir, warn_at=None)
        submitted = self.api.submit_with_code(data, what=what)
        for w in submitted.warnings:
            warnings.warn(f"job {submitted.job_id}: {w}", SpecWarning, stacklevel=2)
        return Job(self, submitted.job_id, warnings=list(submitted.warnings))

    def job(self, job_id: str) -> Job:
        """The handle of the job ``job_id`` (checked to exist)."""
        job = Job(self, job_id)
        job.status()
        return job

    def jobs(
        self, state: JobState | str | None = None, *, limit: int = 50, offset: int = 0
    ) -> list[JobSummary]:
        """The jobs, newest first (``dynabatch list``): only those in ``state`` when given."""
        return self.api.list(state, offset=offset, limit=limit).items


class Job:
    """A handle on one job of a service (``Client.submit``, ``Client.job``): ``id`` and
    the calls that the CLI's job commands make."""

    def __init__(self, client: Client, job_id: str, *, warnings: list[str] | None = None):
        _checked(check_job_id, job_id)
        self.client = client
        self.id = job_id
        self.warnings: list[str] = warnings or []

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def status(self) -> JobDetail:
        """The job's state, progress, per-worker allocation and spec (``dynabatch status``)."""
        return self.client.api.get(self.id)

    def wait(self, timeout_s: float | None = None, *, interval_s: float = 1.0) -> JobDetail:
        """Block until the job ends (SUCCEEDED, FAILED or CANCELLED) and return its last
        status; raises :class:`ApiError` when ``timeout_s`` passes first (None: no limit)."""
        limit = math.inf if timeout_s is None else timeout_s
        return self.client.api.wait(self.id, timeout_s=limit, interval_s=interval_s)

    def history(self) -> list[EpochRecord]:
        """One record per finished epoch: loss, held-out metrics, utilization, the workers."""
        return self.client.api.history(self.id).records

    def logs(self, since: int = 0) -> list[LogLine]:
        """The job's log lines from sequence number ``since`` on (all pages)."""
        lines: list[LogLine] = []
        self.client.api.read_logs(self.id, since, lines.append)
        return lines

    def scale(self, workers: int) -> JobDetail:
        """Run the job with exactly ``workers`` workers from its next step boundary."""
        return self.client.api.scale(self.id, workers)

    def drain(self, worker: str) -> JobDetail:
        """Remove the worker ``worker`` (``w0``, ``w1``, ...) at the next step boundary."""
        _checked(check_worker, worker)
        return self.client.api.drain(self.id, worker)

    def resume(self) -> JobDetail:
        """Resume a FAILED job (or one whose coordinator is gone) from its checkpoint."""
        return self.client.api.resume(self.id)

    def cancel(self, reason: str | None = None) -> JobDetail:
        """Cancel the job at its next step boundary (an :class:`ApiError`, 409, if it ended)."""
        return self.client.api.cancel(self.id, reason)

    def model(self, directory: str | os.PathLike[str], format: str = "dynabatch") -> str:
        """Download the job's trained model (``model.safetensors``, ``best.safetensors`` when
        kept, ``manifest.json``) into ``directory`` (created), as ``dynabatch export`` does,
        and return its path, which ``dynabatch.load_model`` takes to rebuild the module.
        ``format="hf"``: a Hugging Face folder instead (``config.json``, the weights, the
        job's tokenizer), which ``transformers.AutoModelFor...from_pretrained`` loads, as
        ``dynabatch export --format hf`` writes. An :class:`ApiError` (409) while the job
        has no trained weights yet; an OSError naming ``directory`` for a model that is not
        a Hugging Face one."""
        if format not in EXPORT_FORMATS:
            raise ValueError(f"format: must be {' or '.join(EXPORT_FORMATS)}, got {format!r}")
        out = Path(directory)
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"directory: {out} is a file, not a directory")
        data = self.client.api.model(self.id)
        try:
            write_hf_export(data, out) if format == "hf" else unzip_model(data, out)
        except (ValueError, OSError) as err:
            raise OSError(f"directory: {out}: {err}") from None
        return str(out)


def _checked(check: Callable[[str], None], value: str) -> None:
    """The CLI's check of a job or worker id, as a ValueError with its message."""
    try:
        check(value)
    except CliError as err:
        raise ValueError(str(err)) from None

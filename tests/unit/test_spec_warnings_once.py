"""A spec's warning (:class:`SpecWarning`) is shown once, where it was submitted, in every
front end: reading the job back (``status``, polling, ``scale``, the Python API's
``Job.status()``) never issues it again, nor does the service while it answers."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import typer
from dynabatch import Client, SpecWarning
from dynabatch.actors.spec import parse_spec, spec_warnings_caught
from dynabatch.api.cli import job_commands as jobs_cli
from dynabatch.service.rest_client import DynabatchClient
from typer.testing import CliRunner

from tests.asgi import AppTransport
from tests.unit import test_client_cli

server = test_client_cli.server  # the fixture: the app with a fake cluster

# Accepted with a warning: the third slowdown applies only to a worker a scale request adds.
WARNED = {"name": "warned", "dataset": {"name": "digits"}, "workers": 2, "global_batch": 64,
          "epochs": 2, "emulation": {"slowdowns": [1, 2, 3]}}
WARNING = ("emulation.slowdowns has 3 entries; entries past 2 apply only to workers that a "
           "scale request adds beyond workers (2)")


@contextmanager
def spec_warnings_issued() -> Iterator[list[warnings.WarningMessage]]:
    """Every SpecWarning issued in the block (in any thread: the in-process service's too),
    each time, as Python would show it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out: list[warnings.WarningMessage] = []
        yield out
    out.extend(w for w in caught if issubclass(w.category, SpecWarning))


def _submitted(http: Any) -> str:
    with spec_warnings_caught():  # the submission's own warning: tested elsewhere
        return DynabatchClient(transport=AppTransport(http)).submit(WARNED).job_id


def test_reading_a_warned_job_back_never_warns_again_in_python(
    server: Callable[..., Any],
) -> None:
    http = server(sync_interval_s=0)  # the job stays RUNNING: it can be scaled
    job_id = _submitted(http)
    client = Client(transport=AppTransport(http))
    with spec_warnings_issued() as issued:
        job = client.job(job_id)
        job.status()
        for _ in range(7):
            client.api.get(job_id)
        job.scale(3)
        client.jobs()
    assert [str(w.message) for w in issued] == []


def test_cli_status_polling_and_scale_never_warn_again(
    server: Callable[..., Any], tmp_path: Path
) -> None:
    http = server(sync_interval_s=0)
    job_id = _submitted(http)
    cli = typer.Typer(pretty_exceptions_enable=False)
    jobs_cli.register(cli)
    factory = lambda url, tok: DynabatchClient(url, token=tok, transport=AppTransport(http))  # noqa: E731
    with spec_warnings_issued() as issued:
        results = [CliRunner().invoke(cli, ["status", job_id, "--json"],
                                      obj={"client_factory": factory}) for _ in range(7)]
        results.append(CliRunner().invoke(cli, ["scale", job_id, "3"],
                                          obj={"client_factory": factory}))
        results.append(CliRunner().invoke(cli, ["status", job_id],
                                          obj={"client_factory": factory}))
    for r in results:
        assert r.exit_code == 0, r.output
        assert "warning" not in r.output.lower() and "pydantic" not in r.output
    assert [str(w.message) for w in issued] == []


def test_cli_submit_and_follow_show_the_warning_once_naming_the_file(
    server: Callable[..., Any], tmp_path: Path
) -> None:
    """``submit`` (which then follows the job, reading it back) prints the config's warning
    as its own line once, and Python shows nothing of it."""
    config = tmp_path / "job.yaml"
    config.write_text(test_client_cli.CONFIG + "emulation: {slowdowns: [1, 2, 3]}\n")
    http = server()
    cli = typer.Typer(pretty_exceptions_enable=False)
    jobs_cli.register(cli)
    factory = lambda url, tok: DynabatchClient(url, token=tok, transport=AppTransport(http))  # noqa: E731
    with spec_warnings_issued() as issued:
        result = CliRunner().invoke(cli, ["submit", str(config), "--interval", "0.05"],
                                    obj={"client_factory": factory})
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
    assert warned == [f"warning: {config}: {WARNING}"], result.stderr
    assert [str(w.message) for w in issued] == []


def test_silenced_and_caught_are_per_thread() -> None:
    """Collecting one request's warnings must not change what another thread sees (the
    service answers requests on several threads: a process-wide filter let one through
    to ``serve``'s log)."""
    inside, outside = threading.Event(), threading.Event()
    other: list[list[str]] = []

    def elsewhere() -> None:
        inside.wait(5)
        with spec_warnings_issued() as issued:
            parse_spec(WARNED)
        other.append([str(w.message) for w in issued])
        outside.set()

    t = threading.Thread(target=elsewhere)
    t.start()
    with spec_warnings_caught():
        inside.set()
        outside.wait(5)
        parse_spec(WARNED)  # silenced here
    t.join(5)
    assert other == [[WARNING]]  # the other thread, not silenced, warned as Python does
    with spec_warnings_caught() as messages:
        parse_spec(WARNED)
        parse_spec(WARNED)
    assert messages == [WARNING]  # once, however often the same spec is validated


def test_the_service_answers_without_warning_in_its_own_process(
    server: Callable[..., Any],
) -> None:
    """The app re-reads a stored spec (and FastAPI re-validates its answers): none of that
    reaches the service's log, and the submitter still gets the warning in the reply."""
    http = server(sync_interval_s=0)
    with spec_warnings_issued() as issued:
        r = http.post("/v1/jobs", json=WARNED)
        job_id = r.json()["job_id"]
        for _ in range(3):
            assert http.get(f"/v1/jobs/{job_id}").status_code == 200
        assert http.post(f"/v1/jobs/{job_id}/scale", json={"workers": 3}).status_code < 300
    assert r.status_code == 201 and r.json()["warnings"] == [WARNING]
    assert [str(w.message) for w in issued] == []


@pytest.mark.parametrize("front", ["python"])
def test_python_submit_warns_once_at_the_callers_line(
    server: Callable[..., Any], front: str
) -> None:
    client = Client(transport=AppTransport(server()))
    with spec_warnings_issued() as issued:
        job = client.submit(WARNED)
        job.status()
        job.wait(timeout_s=10, interval_s=0.02)
    assert [(str(w.message), w.filename) for w in issued] == [
        (f"job {job.id}: {WARNING}", __file__)]

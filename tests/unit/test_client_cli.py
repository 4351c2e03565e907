"""The httpx client and the CLI subcommands, against the app with a fake cluster."""

from __future__ import annotations

import re
import socket
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from dynabatch.api.app import create_app
from dynabatch.api.cli import job_commands as client_cli
from dynabatch.service.rest_client import ApiError, ConnectionFailed, DynabatchClient
from dynabatch.service.settings import Settings
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from tests.asgi import AppTransport
from tests.fakes import FakeCluster

CONFIG = """\
name: cli-job
dataset: {name: digits}
workers: 2
global_batch: 64
epochs: 2
"""


@pytest.fixture
def cli() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)
    client_cli.register(app)
    return app


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def start(cluster: FakeCluster | None = None, **settings: Any) -> TestClient:
        options = {
            "db_path": str(tmp_path / "cli.db"),
            "sync_interval_s": 0.01,
            "checkpoint_root": str(tmp_path),
            **settings,
        }
        cluster = cluster if cluster is not None else FakeCluster()
        client = TestClient(create_app(Settings(**options), cluster=cluster))
        client.__enter__()
        clients.append(client)
        return client

    yield start
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(CONFIG)
    return p


def _invoke(cli: typer.Typer, http: TestClient | None, *args: str) -> Any:
    factory = None
    if http is not None:

        def factory(url: str, token: str | None) -> DynabatchClient:
            return DynabatchClient(url, token=token, transport=AppTransport(http))

    result = CliRunner().invoke(cli, list(args), obj={"client_factory": factory})
    assert "Traceback" not in result.output, result.output
    return result


def _one_error_line(result: Any) -> str:
    assert result.exit_code == 1, result.output
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The client ---------------------------------------------------------------------------
def test_client_roundtrip(server: Callable[..., TestClient]) -> None:
    http = server()
    client = DynabatchClient(transport=AppTransport(http))
    job = client.submit({"name": "py", "epochs": 1})
    assert job.state.value == "PENDING"
    done = client.wait(job.job_id, timeout_s=10, interval_s=0.02)
    assert done.state.value == "SUCCEEDED" and done.spec.name == "py"
    assert [r.epoch for r in client.history(job.job_id).records] == [0]
    assert client.logs(job.job_id).lines
    assert client.list(state="succeeded").total == 1
    assert client.nodes().nodes
    assert http.get("/readyz").json()["status"] == "ready"
    assert "dynabatch_jobs" in http.get("/metrics").text
    with pytest.raises(ApiError) as err:
        client.cancel(job.job_id)
    assert err.value.status == 409


def test_client_retries_connection_errors() -> None:
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] < 3:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"items": [], "total": 0, "offset": 0, "limit": 50})

    client = DynabatchClient("http://api", transport=httpx.MockTransport(handler), retries=3,
                             retry_wait_s=0.001)
    assert client.list().total == 0
    assert calls["n"] == 3


def test_client_gives_up_with_one_clear_error() -> None:
    port = _free_port()
    client = DynabatchClient(f"http://127.0.0.1:{port}", retries=2, retry_wait_s=0.001)
    with pytest.raises(ConnectionFailed, match=f"cannot reach the dynabatch API at .*:{port}"):
        client.list()
    client.close()


def test_client_does_not_retry_a_post_that_may_have_arrived() -> None:
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        raise httpx.ReadError("connection reset", request=request)

    client = DynabatchClient("http://api", transport=httpx.MockTransport(handler), retries=4,
                             retry_wait_s=0.001)
    with pytest.raises(ConnectionFailed):
        client.submit({"name": "x"})
    assert calls["n"] == 1
    with pytest.raises(ConnectionFailed):
        client.list()
    assert calls["n"] == 5


# The CLI ------------------------------------------------------------------------------
def test_submit_prints_the_id(
    cli: typer.Typer, server: Callable[..., TestClient], config: Path
) -> None:
    http = server()
    result = _invoke(cli, http, "submit", str(config), "--no-wait")
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"[0-9a-f]{12}", result.stdout.strip())


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("name: [unclosed", "not valid YAML"),
        ("global_batch: 0\n", "global_batch: Input should be greater than or equal to 1"),
        ("workers: 4\nglobal_batch: 2\n", "global_batch: global_batch (2) is smaller"),
        ("- a list\n", "expected a mapping"),
    ],
)
def test_submit_bad_config_is_one_line(
    cli: typer.Typer, server: Callable[..., TestClient], tmp_path: Path, text: str, needle: str
) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    line = _one_error_line(_invoke(cli, server(), "submit", str(p)))
    assert needle in line and str(p) in line


def test_submit_missing_file(cli: typer.Typer, server: Callable[..., TestClient]) -> None:
    line = _one_error_line(_invoke(cli, server(), "submit", "/nonexistent/job.yaml"))
    assert "cannot read config" in line


def test_list_status_logs(
    cli: typer.Typer, server: Callable[..., TestClient], config: Path
) -> None:
    http = server()
    job = _invoke(cli, http, "submit", str(config), "--no-wait").stdout.strip()
    DynabatchClient(transport=AppTransport(http)).wait(job, timeout_s=10, interval_s=0.02)
    result = _invoke(cli, http, "list")
    assert result.exit_code == 0 and job in result.stdout and "SUCCEEDED" in result.stdout
    result = _invoke(cli, http, "list", "--state", "RUNNING", "--json")
    assert result.exit_code == 0 and '"total":0' in result.stdout
    result = _invoke(cli, http, "status", job)
    assert result.exit_code == 0
    assert "SUCCEEDED" in result.stdout and "w0" in result.stdout and "w1" in result.stdout
    result = _invoke(cli, http, "status", job, "--json")
    assert f'"job_id":"{job}"' in result.stdout
    result = _invoke(cli, http, "logs", job)
    assert result.exit_code == 0 and "state SUCCEEDED" in result.stdout
    result = _invoke(cli, http, "logs", job, "--follow", "--interval", "0.05")
    assert result.exit_code == 0 and "state SUCCEEDED" in result.stdout


def test_watch_until_succeeded(
    cli: typer.Typer, server: Callable[..., TestClient], config: Path
) -> None:
    http = server(sync_interval_s=0.05)
    job = _invoke(cli, http, "submit", str(config), "--no-wait").stdout.strip()
    result = _invoke(cli, http, "watch", job, "--interval", "0.05")
    assert result.exit_code == 0, result.output
    # The live table showed the workers; the outcome is a line of its own after it.
    assert "w0" in result.stdout
    assert result.stdout.splitlines()[-1].startswith(f"job {job} SUCCEEDED"), result.stdout


def test_cancel_then_conflict(
    cli: typer.Typer, server: Callable[..., TestClient], config: Path
) -> None:
    http = server(sync_interval_s=0)  # the job stays put
    job = _invoke(cli, http, "submit", str(config), "--no-wait").stdout.strip()
    result = _invoke(cli, http, "cancel", job, "--reason", "not needed")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"job {job} CANCELLED: not needed"
    line = _one_error_line(_invoke(cli, http, "cancel", job))
    assert line == f"error: job {job} is already CANCELLED"
    result = _invoke(cli, http, "watch", job)
    assert result.exit_code == 1 and "CANCELLED" in result.stdout


@pytest.mark.parametrize("command", ["status", "watch", "cancel", "logs"])
def test_unknown_and_malformed_ids(
    cli: typer.Typer, server: Callable[..., TestClient], command: str
) -> None:
    http = server()
    line = _one_error_line(_invoke(cli, http, command, "0" * 12))
    assert line == f"error: job '{'0' * 12}' not found"
    line = _one_error_line(_invoke(cli, http, command, "nope"))
    assert "'nope' is not a job id" in line


def test_token(cli: typer.Typer, server: Callable[..., TestClient], config: Path) -> None:
    http = server(api_token="s3cret")
    line = _one_error_line(_invoke(cli, http, "list"))
    assert line.startswith("error: missing bearer token (pass --token or set DYNABATCH_API")
    line = _one_error_line(_invoke(cli, http, "list", "--token", "wrong"))
    assert "invalid bearer token" in line
    result = _invoke(cli, http, "submit", str(config), "--token", "s3cret", "--no-wait")
    assert result.exit_code == 0


def test_unreachable_api_is_one_line(cli: typer.Typer, monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    result = CliRunner().invoke(
        cli,
        ["list", "--url", f"http://127.0.0.1:{port}"],
        obj={"client_factory": lambda url, token: DynabatchClient(url, retry_wait_s=0.001)},
    )
    line = _one_error_line(result)
    assert f"cannot reach the dynabatch API at http://127.0.0.1:{port}" in line


def test_serve_rejects_bad_settings_in_one_line(cli: typer.Typer) -> None:
    result = CliRunner().invoke(cli, ["serve", "--port", "99999"])
    assert "Traceback" not in result.output
    line = _one_error_line(result)
    assert "port" in line


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "api.example.org"])
def test_serve_refuses_a_public_address_without_a_token(
    cli: typer.Typer, monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    monkeypatch.delenv("DYNABATCH_API_TOKEN", raising=False)
    result = CliRunner().invoke(cli, ["serve", "--host", host])
    assert "Traceback" not in result.output
    assert result.exit_code == 2, result.output
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: refusing to listen on {host} without DYNABATCH_API_TOKEN")
    assert "--insecure" in lines[0]


@pytest.mark.parametrize(
    ("args", "token"),
    [
        (["--host", "127.0.0.1"], None),
        (["--host", "127.8.9.10"], None),
        (["--host", "::1"], None),
        (["--host", "localhost"], None),
        (["--host", "0.0.0.0", "--insecure"], None),
        (["--host", "0.0.0.0"], "s3cret"),
    ],
)
def test_serve_listens_on_loopback_with_a_token_or_when_told(
    cli: typer.Typer, monkeypatch: pytest.MonkeyPatch, args: list[str], token: str | None
) -> None:
    import dynabatch.service.job_service

    def build_service(*_: Any, **__: Any) -> None:
        raise RuntimeError("past the address check")  # instead of starting Ray

    monkeypatch.setattr(dynabatch.service.job_service, "build_service", build_service)
    if token is None:
        monkeypatch.delenv("DYNABATCH_API_TOKEN", raising=False)
    else:
        monkeypatch.setenv("DYNABATCH_API_TOKEN", token)
    line = _one_error_line(CliRunner().invoke(cli, ["serve", *args]))
    assert line == "error: RuntimeError: past the address check"


def test_scale_drain_resume(
    cli: typer.Typer, server: Callable[..., TestClient], tmp_path: Path
) -> None:
    from dynabatch.scheduler.checkpoint import checkpoint_path

    http = server(sync_interval_s=0, auto_resume_limit=0)  # the job stays put
    service = http.app.state.service
    cluster = service.cluster
    spec = {"name": "elastic", "workers": 3, "global_batch": 60, "epochs": 4,
            "checkpoint": {"dir": str(tmp_path / "ckpt")}}
    job = DynabatchClient(transport=AppTransport(http)).submit(spec).job_id
    service.reconciler.sync_once()

    result = _invoke(cli, http, "scale", job, "2")
    assert result.exit_code == 0, result.output
    # Requested: the coordinator applies it at its next step boundary.
    assert result.stdout.strip() == (
        f"job {job} RUNNING: scale to 2 workers requested (workers now: w0, w1, w2)"
    )
    service.reconciler.sync_once()  # applied: the slowest (w1, alone on the slower node) left
    result = _invoke(cli, http, "drain", job, "w2")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        f"job {job} RUNNING: drain of w2 requested (workers now: w0, w2)"
    )
    assert _one_error_line(_invoke(cli, http, "drain", job, "w0")) == (
        "error: cannot drain the last worker"
    )
    assert "'w7' is not a member" in _one_error_line(_invoke(cli, http, "drain", job, "w7"))
    assert "'x7' is not a worker id" in _one_error_line(_invoke(cli, http, "drain", job, "x7"))
    result = _invoke(cli, http, "scale", job, "0")
    assert result.exit_code == 2  # typer's own usage error
    assert "global_batch" in _one_error_line(_invoke(cli, http, "scale", job, "61"))

    assert "coordinator is alive" in _one_error_line(_invoke(cli, http, "resume", job))
    assert checkpoint_path(tmp_path / "ckpt", job).is_file()  # the coordinator wrote it
    cluster.kill(job)
    service.reconciler.sync_once()  # auto resume is off: FAILED
    result = _invoke(cli, http, "resume", job)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"job {job} PENDING: resume requested; job was FAILED")


@pytest.mark.parametrize("args", [["scale", "{}", "2"], ["drain", "{}", "w0"], ["resume", "{}"]])
def test_new_commands_check_ids(
    cli: typer.Typer, server: Callable[..., TestClient], args: list[str]
) -> None:
    http = server()
    line = _one_error_line(_invoke(cli, http, *[a.format("0" * 12) for a in args]))
    assert line == f"error: job '{'0' * 12}' not found"
    line = _one_error_line(_invoke(cli, http, *[a.format("nope") for a in args]))
    assert "'nope' is not a job id" in line


def test_submit_waits_streams_logs_and_exits_with_the_outcome(
    cli: typer.Typer, server: Callable[..., TestClient], tmp_path: Path
) -> None:
    # The job trains its model (real losses and scores): the outcome names its accuracy.
    config = tmp_path / "small.yaml"
    config.write_text(CONFIG.replace("{name: digits}", "{name: digits, limit: 256}"))
    http = server(FakeCluster(real_gradients=True), sync_interval_s=0.02)
    result = _invoke(cli, http, "submit", str(config), "--interval", "0.02")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    job = lines[0].strip()
    assert re.fullmatch(r"[0-9a-f]{12}", job)
    # The log lines (as `logs` prints them), the live table, then the outcome.
    assert any(line.endswith("INFO    state RUNNING") for line in lines)
    assert any("state SUCCEEDED" in line for line in lines)
    assert "w0" in result.stdout and lines[-1].startswith(f"job {job} SUCCEEDED; test accuracy ")


def test_following_a_job_that_did_not_succeed_exits_1(
    cli: typer.Typer, server: Callable[..., TestClient], config: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    http = server(sync_interval_s=0)  # the job stays put until cancelled
    job = _invoke(cli, http, "submit", str(config), "--no-wait").stdout.strip()
    client = DynabatchClient(transport=AppTransport(http))
    client.cancel(job, "changed my mind")
    assert client_cli._follow(client, job, 0.02) == 1
    assert capsys.readouterr().out.splitlines()[-1] == f"job {job} CANCELLED: changed my mind"


def test_event_stream_resumes_after_the_last_event_id(server: Callable[..., TestClient],
                                                      config: Path) -> None:
    http = server(sync_interval_s=0.02)
    job = DynabatchClient(transport=AppTransport(http)).submit({"workers": 2, "epochs": 2}).job_id
    events = list(DynabatchClient(transport=AppTransport(http)).events(job, interval_s=0.02))
    kinds = [e for e, _ in events]
    assert kinds[-1] == "end" and kinds.count("epoch") == 2
    seqs = [d["seq"] for e, d in events if e == "log"]
    assert seqs == list(range(len(seqs))) and len(seqs) >= 3
    # A reconnecting browser sends Last-Event-ID: it gets only the later lines.
    text = http.get(f"/v1/jobs/{job}/events", headers={"Last-Event-ID": str(seqs[1])}).text
    assert "id: 0\n" not in text and "id: 1\n" not in text and f"id: {seqs[2]}\n" in text
    assert http.get("/v1/jobs/000000000000/events").status_code == 404


def test_working_dir_is_zipped_and_uploaded_and_the_job_names_the_upload(
        cli: typer.Typer, server: Callable[..., TestClient], config: Path,
        tmp_path: Path) -> None:
    code = tmp_path / "code"
    (code / "pkg" / "__pycache__").mkdir(parents=True)
    (code / "pkg" / "__init__.py").write_text("")
    (code / "pkg" / "losses.py").write_text("def loss(o, t):\n    return o.sum(1)\n")
    (code / "pkg" / "__pycache__" / "losses.cpython-311.pyc").write_bytes(b"\0")
    # The service decides: no user code from any module, or nowhere to keep it, is refused.
    line = _one_error_line(_invoke(cli, server(), "submit", str(config), "--no-wait",
                                   "--working-dir", str(code)))
    assert line.startswith("error: --working-dir: shipping code is not allowed")
    assert "DYNABATCH_USER_CODE_MODULES='*'" in line
    line = _one_error_line(_invoke(cli, server(user_code_modules="*"), "submit", str(config),
                                   "--no-wait", "--working-dir", str(code)))
    assert "DYNABATCH_CODE_ROOT" in line
    line = _one_error_line(_invoke(cli, server(user_code_modules="*"), "submit", str(config),
                                   "--no-wait", "--working-dir", str(tmp_path / "nope")))
    assert line == f"error: --working-dir: {tmp_path / 'nope'} is not a directory"

    root = tmp_path / "uploads"
    http = server(user_code_modules="*", code_root=str(root))
    result = _invoke(cli, http, "submit", str(config), "--no-wait", "--working-dir", str(code))
    assert result.exit_code == 0, result.output
    job = result.stdout.strip()
    (stored,) = root.glob("*.zip")  # the code travelled in the request, not as a path
    assert http.get(f"/v1/jobs/{job}").json()["spec"]["working_dir"] == stored.as_uri()
    with zipfile.ZipFile(stored) as z:  # one top-level directory, which Ray removes
        assert sorted(z.namelist()) == ["working_dir/pkg/__init__.py",
                                        "working_dir/pkg/losses.py"]
    # A config's own working_dir (a directory, as `dynabatch run` takes it) is uploaded too;
    # the same code gives the same zip, kept once.
    with_dir = tmp_path / "with_dir.yaml"
    with_dir.write_text(CONFIG + f"working_dir: {code}\n")
    result = _invoke(cli, http, "submit", str(with_dir), "--no-wait")
    assert result.exit_code == 0, result.output
    job = result.stdout.strip()
    assert http.get(f"/v1/jobs/{job}").json()["spec"]["working_dir"] == stored.as_uri()
    assert list(root.glob("*.zip")) == [stored]


# Issue 24 -----------------------------------------------------------------------------
def test_version() -> None:
    from dynabatch.api.cli import _register, app

    _register()
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and re.fullmatch(r"dynabatch \S+\n", result.stdout)


def test_submit_prints_the_page_url_on_stderr(
    cli: typer.Typer, server: Callable[..., TestClient], config: Path
) -> None:
    result = _invoke(cli, server(), "submit", str(config), "--no-wait",
                     "--url", "http://api.example:8000/")
    assert result.exit_code == 0, result.output
    job = result.stdout.strip()  # stdout: the id alone, for scripts
    assert f"job page: http://api.example:8000/jobs/{job}" in result.stderr


def test_submit_shows_a_specs_warning_once(
    cli: typer.Typer, server: Callable[..., TestClient], config: Path
) -> None:
    """The config's warning is read locally and the service sends it back too: one line,
    ``warning: FILE: message``, not Python's form pointing into pydantic nor a repeat."""
    config.write_text(CONFIG + "emulation: {slowdowns: [1, 2, 3]}\n")
    result = _invoke(cli, server(), "submit", str(config), "--no-wait")
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
    assert warned == [
        f"warning: {config}: emulation.slowdowns has 3 entries; entries past 2 apply only to "
        "workers that a scale request adds beyond workers (2)"], result.stderr


def test_followed_log_lines_are_printed_as_they_are(
    cli: typer.Typer, server: Callable[..., TestClient], config: Path
) -> None:

    http = server(sync_interval_s=0.02)
    cluster = http.app.state.service.cluster
    launch = cluster.launch

    def launch_with_output(job_id: str, spec: Any) -> None:
        launch(job_id, spec)
        coordinator = cluster.coordinators[job_id]
        # The user's code printed on worker w0, as the coordinator's log follows it.
        for text in ("loaded mydata:cancer 427 train", "[red]not red[/red] :thumbs_up:"):
            coordinator._actor_line("w0", "stdout", text)

    cluster.launch = launch_with_output
    result = _invoke(cli, http, "submit", str(config), "--interval", "0.02")
    assert result.exit_code == 0, result.output
    assert "loaded mydata:cancer 427 train" in result.stdout
    assert "[red]not red[/red] :thumbs_up:" in result.stdout


def test_tables_are_not_cut_when_output_is_not_a_terminal(
    cli: typer.Typer, server: Callable[..., TestClient], config: Path
) -> None:
    http = server(sync_interval_s=0.02)
    job = _invoke(cli, http, "submit", str(config), "--no-wait").stdout.strip()
    DynabatchClient(transport=AppTransport(http)).wait(job, timeout_s=10, interval_s=0.02)
    result = _invoke(cli, http, "status", job)
    assert result.exit_code == 0
    assert "…" not in result.stdout
    for header in ("partition", "samples/s", "compute/step", "wait/step"):
        assert header in result.stdout


def test_refusals_name_every_setting_that_allows_them(
    cli: typer.Typer, server: Callable[..., TestClient], config: Path, tmp_path: Path
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    line = _one_error_line(_invoke(cli, server(), "submit", str(config), "--no-wait",
                                   "--working-dir", str(code)))
    # Both missing settings in one answer, not one per attempt.
    assert "DYNABATCH_USER_CODE_MODULES='*'" in line and "DYNABATCH_CODE_ROOT" in line
    user_code = tmp_path / "user_code.yaml"
    user_code.write_text(CONFIG + "model: {name: 'mypkg.nets:build'}\n")
    line = _one_error_line(_invoke(cli, server(), "submit", str(user_code), "--no-wait"))
    assert "model.name" in line and "DYNABATCH_USER_CODE_MODULES" in line


def test_serve_reports_every_bad_setting_in_one_line(
    cli: typer.Typer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYNABATCH_USER_CODE_MODULES", "bad-name")
    monkeypatch.setenv("DYNABATCH_CODE_ROOT", "relative")
    line = _one_error_line(CliRunner().invoke(cli, ["serve"]))
    assert "DYNABATCH_USER_CODE_MODULES" in line and "DYNABATCH_CODE_ROOT" in line


def test_a_relative_working_dir_is_read_from_the_config_folder(
    cli: typer.Typer, server: Callable[..., TestClient], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    project = tmp_path / "project"
    (project / "mycode").mkdir(parents=True)
    (project / "mycode" / "m.py").write_text("X = 1\n")
    cfg = project / "job.yaml"
    cfg.write_text(CONFIG + "working_dir: mycode\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the config's folder
    root = tmp_path / "uploads"
    http = server(user_code_modules="*", code_root=str(root))
    result = _invoke(cli, http, "submit", str(cfg), "--no-wait")
    assert result.exit_code == 0, result.output
    (stored,) = root.glob("*.zip")
    with zipfile.ZipFile(stored) as z:
        assert z.namelist() == ["working_dir/m.py"]
    cfg.write_text(CONFIG + "working_dir: ../missing\n")
    line = _one_error_line(_invoke(cli, http, "submit", str(cfg), "--no-wait"))
    assert line.startswith(f"error: {cfg}: working_dir: {tmp_path / 'missing'} is not a dir")


# Issue 29 -----------------------------------------------------------------------------
def _log_api(n_lines: int, state: str = "SUCCEEDED") -> Callable[[str, str | None], Any]:
    """A client factory for an API whose job has ``n_lines`` log lines, served in pages of at
    most ``limit`` (the server's own paging); its GET /v1/jobs/{id} says ``state``."""
    job = "ab" * 6

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == f"/v1/jobs/{job}/logs":
            since = int(request.url.params.get("since", 0))
            limit = int(request.url.params.get("limit", 1000))
            lines = [{"seq": i, "time": 0.0, "level": "INFO", "message": f"line {i}"}
                     for i in range(since, min(n_lines, since + limit))]
            return httpx.Response(200, json={
                "job_id": job, "lines": lines,
                "next_since": lines[-1]["seq"] + 1 if lines else since})
        if request.url.path == f"/v1/jobs/{job}":
            return httpx.Response(200, json={
                "job_id": job, "name": "logs", "state": state, "created_at": 0.0,
                "updated_at": 0.0, "spec": {}})
        return httpx.Response(404, json={"detail": "not here"})

    return lambda url, token: DynabatchClient(url, token=token,
                                              transport=httpx.MockTransport(handler))


def _logs(cli: typer.Typer, n_lines: int, *args: str) -> list[str]:
    result = CliRunner().invoke(cli, ["logs", "ab" * 6, *args],
                                obj={"client_factory": _log_api(n_lines)})
    assert result.exit_code == 0, result.output
    return [line.split()[-1] for line in result.stdout.splitlines()]


def test_logs_prints_every_page_to_the_end(cli: typer.Typer) -> None:
    # Item 6: the first page (1,000 lines) was all `logs` printed, without a word.
    assert _logs(cli, 2_345) == [str(i) for i in range(2_345)]
    assert _logs(cli, 2_345, "--since", "2000") == [str(i) for i in range(2_000, 2_345)]
    assert _logs(cli, 0) == []


def test_logs_tail_shows_the_last_lines(cli: typer.Typer) -> None:
    assert _logs(cli, 2_345, "--tail", "3") == ["2342", "2343", "2344"]
    assert _logs(cli, 2, "--tail", "5") == ["0", "1"]
    assert _logs(cli, 2_345, "--tail", "2", "--follow", "--interval", "0.05") == [
        "2343", "2344"]


def test_submit_takes_set_overrides_as_run_does(
    cli: typer.Typer, server: Callable[..., TestClient], config: Path
) -> None:
    http = server(sync_interval_s=0)
    result = _invoke(cli, http, "submit", str(config), "--no-wait",
                     "--set", "epochs=5", "--set", "optimizer.lr=0.25")
    assert result.exit_code == 0, result.output
    spec = http.get(f"/v1/jobs/{result.stdout.strip()}").json()["spec"]
    assert spec["epochs"] == 5 and spec["optimizer"]["lr"] == 0.25
    line = _one_error_line(_invoke(cli, http, "submit", str(config), "--set", "epochs"))
    assert line.startswith("error: --set 'epochs': expected FIELD=VALUE")
    line = _one_error_line(_invoke(cli, http, "submit", str(config), "--set", "epochs=0"))
    assert str(config) in line and "epochs" in line


def test_a_missing_token_names_how_to_give_one(
    cli: typer.Typer, server: Callable[..., TestClient]
) -> None:
    line = _one_error_line(_invoke(cli, server(api_token="s3cret"), "list"))
    assert line.startswith("error: missing bearer token")
    assert "--token" in line and "DYNABATCH_API_TOKEN" in line

"""The Python API (``from dynabatch import Client, JobSpec``, ``dynabatch.run``) against the
real app in-process, with a fake cluster: what a user's script sees, and the CLI's errors."""

from __future__ import annotations

import io
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dynabatch
import pytest
import torch
import typer
from dynabatch import ApiError, Client, JobSpec, SpecError, SpecWarning
from dynabatch.actors.export import load_model
from dynabatch.actors.spec import parse_spec
from dynabatch.api.cli import job_commands as jobs_cli
from dynabatch.api.cli import run as run_cli
from dynabatch.embedded import ProgressView
from dynabatch.service.rest_client import DynabatchClient
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from tests.asgi import AppTransport
from tests.fakes import FakeCluster
from tests.unit import test_client_cli
from tests.unit.test_cli_run import FakeJob
from tests.unit.test_export import _train_to_the_end

server = test_client_cli.server  # the fixture: the app with a fake cluster

SPEC = {
    "name": "py-job",
    "dataset": {"name": "digits"},
    "workers": 2,
    "global_batch": 64,
    "epochs": 2,
}
SMALL = {**SPEC, "dataset": {"name": "digits", "limit": 256}}  # a model trained quickly


def _cli_error(http: TestClient, *args: str, token: str | None = None) -> str:
    """The CLI's one error line for the same call, without its ``error: `` prefix."""
    cli = typer.Typer(pretty_exceptions_enable=False)
    jobs_cli.register(cli)
    factory = lambda url, tok: DynabatchClient(url, token=tok, transport=AppTransport(http))  # noqa: E731
    env = {"DYNABATCH_API_TOKEN": token} if token else {}
    result = CliRunner().invoke(cli, list(args), obj={"client_factory": factory}, env=env)
    assert result.exit_code == 1, result.output
    return result.stderr.strip().removeprefix("error: ")


def test_the_public_names_are_the_layers_own() -> None:
    assert JobSpec is parse_spec({}).__class__
    assert dynabatch.run.__module__ == "dynabatch.embedded"
    assert {"Client", "Job", "JobSpec", "run", "RunResult", "load_model"} <= set(dir(dynabatch))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = dynabatch.nope


def test_submit_wait_history_logs_and_list(server: Callable[..., TestClient]) -> None:
    client = Client(transport=AppTransport(server(FakeCluster(real_gradients=True))))  # real losses
    job = client.submit(JobSpec.model_validate(SMALL))
    assert repr(job) == f"Job({job.id!r})"
    done = job.wait(timeout_s=30, interval_s=0.02)
    assert done.state.value == "SUCCEEDED" and done.spec.name == "py-job"
    history = job.history()
    assert [r.epoch for r in history] == [0, 1] and all(r.train_loss > 0 for r in history)
    lines = job.logs()
    assert [line.seq for line in lines] == list(range(len(lines))) and len(lines) >= 2
    assert [line.seq for line in job.logs(since=1)] == [line.seq for line in lines[1:]]
    assert [j.job_id for j in client.jobs("succeeded")] == [job.id]
    assert client.jobs(state="RUNNING") == []
    assert client.job(job.id).status().state.value == "SUCCEEDED"
    with pytest.raises(ValueError, match="state: 'done' is not one of PENDING"):
        client.jobs("done")


def test_submit_ships_the_working_dir_as_an_upload(
    server: Callable[..., TestClient], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "__init__.py").write_text("")
    (code / "pkg" / "losses.py").write_text("def loss(o, t):\n    return o.sum(1)\n")
    root = tmp_path / "uploads"
    http = server(user_code_modules="*", code_root=str(root))
    client = Client(transport=AppTransport(http))
    job = client.submit(SPEC, working_dir=code)
    (stored,) = root.glob("*.zip")  # the code travelled in the request, not as a path
    assert job.status().spec.working_dir == stored.as_uri()
    with zipfile.ZipFile(stored) as z:
        assert sorted(z.namelist()) == ["working_dir/pkg/__init__.py", "working_dir/pkg/losses.py"]
    # A config file's own relative working_dir is read from the file's folder, a dict's
    # from the current directory, as the CLI reads them; the same code is kept once.
    cfg = tmp_path / "job.yaml"
    cfg.write_text("name: from-file\nepochs: 1\nworking_dir: code\n")
    monkeypatch.chdir(code)  # not the config's folder
    assert client.submit(cfg).status().spec.working_dir == stored.as_uri()
    monkeypatch.chdir(tmp_path)
    assert (
        client.submit({**SPEC, "working_dir": "code"}).status().spec.working_dir == stored.as_uri()
    )
    assert list(root.glob("*.zip")) == [stored]
    # A service that keeps no uploads: the CLI's refusal, naming the argument.
    with pytest.raises(ApiError) as err:
        Client(transport=AppTransport(server(user_code_modules="*"))).submit(SPEC, working_dir=code)
    assert str(err.value).startswith("working_dir: ") and "DYNABATCH_CODE_ROOT" in str(err.value)


def test_a_bad_spec_names_the_field_and_sends_nothing(
    server: Callable[..., TestClient], tmp_path: Path
) -> None:
    client = Client(transport=AppTransport(server()))
    with pytest.raises(
        SpecError, match=r"^global_batch: Input should be greater than or equal to 1"
    ):
        client.submit({**SPEC, "global_batch": 0})
    with pytest.raises(SpecError, match=r"^bogus: unknown field"):
        client.submit({**SPEC, "bogus": 1})
    with pytest.raises(SpecError) as err:
        client.submit(SPEC, working_dir=tmp_path / "nope")
    assert str(err.value) == f"working_dir: {tmp_path / 'nope'} is not a directory"
    cfg = tmp_path / "job.yaml"
    cfg.write_text("epochs: 0\n")
    with pytest.raises(SpecError, match=rf"^{cfg}: epochs: Input should be greater"):
        client.submit(cfg)
    with pytest.raises(SpecError, match=r"^spec: expected a JobSpec, a dict .* got int"):
        client.submit(3)  # type: ignore[arg-type]
    assert client.jobs() == []  # nothing was sent


def test_errors_are_the_clis(
    server: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    http = server(api_token="s3cret")
    monkeypatch.delenv("DYNABATCH_API_TOKEN", raising=False)
    with pytest.raises(ApiError) as err:
        Client(transport=AppTransport(http), token="wrong").jobs()
    assert err.value.status == 401
    cli_line = _cli_error(http, "list", token="wrong")
    assert cli_line.endswith("(pass --token or set DYNABATCH_API_TOKEN to the service's token)")
    assert str(err.value) == cli_line.replace("--token", "Client(url, token=...)")
    # A notebook shows it as one line, not the client's frames.
    assert err.value._render_traceback_() == [f"ApiError: {err.value}"]
    monkeypatch.setenv("DYNABATCH_API_TOKEN", "s3cret")  # as the CLI reads it
    client = Client(transport=AppTransport(http))
    unknown = "0123456789ab"
    with pytest.raises(ApiError) as err:
        client.job(unknown)
    assert err.value.status == 404
    assert str(err.value) == _cli_error(http, "status", unknown, token="s3cret")
    with pytest.raises(ValueError) as bad:
        client.job("nope")
    assert str(bad.value) == _cli_error(http, "status", "nope")
    job = client.submit(SPEC)
    job.wait(timeout_s=30, interval_s=0.02)
    with pytest.raises(ApiError) as err:
        job.cancel()
    assert err.value.status == 409
    assert str(err.value) == _cli_error(http, "cancel", job.id, token="s3cret")


def test_scale_drain_and_cancel(server: Callable[..., TestClient]) -> None:
    http = server(sync_interval_s=0)  # the job stays put
    client = Client(transport=AppTransport(http))
    service = http.app.state.service
    job = client.submit({**SPEC, "workers": 3, "global_batch": 60, "epochs": 5})
    service.reconciler.sync_once()
    # Requested: the coordinator applies each at its next step boundary (the sync's).
    assert [w.worker for w in job.scale(2).workers] == ["w0", "w1", "w2"]
    service.reconciler.sync_once()  # the slowest (w1, alone on the slower node) left
    assert [w.worker for w in job.drain("w2").workers] == ["w0", "w2"]
    service.reconciler.sync_once()
    assert [w.worker for w in client.job(job.id).status().workers] == ["w0"]
    with pytest.raises(ValueError, match=r"'x7' is not a worker id"):
        job.drain("x7")
    with pytest.raises(ApiError, match="global_batch"):
        job.scale(61)
    assert job.cancel("changed my mind").reason == "changed my mind"
    service.reconciler.sync_once()
    assert job.wait(timeout_s=5, interval_s=0.01).state.value == "CANCELLED"


def test_model_downloads_the_directory_load_model_reads(
    server: Callable[..., TestClient], tmp_path: Path
) -> None:
    cluster = FakeCluster(real_gradients=True)
    http = server(cluster, sync_interval_s=0)
    client = Client(transport=AppTransport(http))
    job = client.submit(SMALL)
    with pytest.raises(ApiError) as err:
        job.model(tmp_path / "out")
    assert err.value.status == 409 and str(err.value) == f"job {job.id} has no trained weights yet"
    _train_to_the_end(cluster, job.id)
    model = cluster.coordinators[job.id].runtime.gradients.model  # the model the job trained
    out = job.model(tmp_path / "out")
    assert out == str(tmp_path / "out")
    assert sorted(p.name for p in Path(out).iterdir()) == ["manifest.json", "model.safetensors"]
    x = torch.randn(3, 64)
    assert torch.equal(load_model(out)(x), model.eval()(x))  # as trained
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match=r"^directory: .*/f is a file"):
        job.model(tmp_path / "f")


def test_the_progress_view_shows_the_steps_and_a_line_per_epoch() -> None:
    cluster = FakeCluster()
    cluster.launch(
        "a" * 12, parse_spec({"name": "bar", "workers": 2, "global_batch": 64, "epochs": 3})
    )
    out = io.StringIO()
    view = ProgressView(enabled=True, file=out)
    snap, hist = run_cli.follow_job(
        FakeJob(cluster, "a" * 12),
        console=view.console,
        quiet=True,
        interval_s=0.0,
        on_update=view.update,
    )
    view.close()
    text = out.getvalue()
    assert snap.state.value == "SUCCEEDED" and view.history == hist and len(hist) == 3
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"])]
    assert [r[0] for r in rows] == ["1", "2", "3"]  # one line per epoch, in order, from 1
    assert [r[2] for r in rows] == [f"{h.train_loss:.4f}" for h in hist]
    assert text.count("epoch  ") == 1  # the header once
    total = snap.epochs * snap.steps_per_epoch
    assert f"{total}/{total}" in text and "SUCCEEDED" in text  # the bar's last state
    assert "state SUCCEEDED" in text  # the job's own log lines go above the bar
    quiet = io.StringIO()
    silent = ProgressView(enabled=False, file=quiet)
    silent.update(snap, hist)
    assert silent.history == hist and quiet.getvalue() == ""


def test_run_refuses_a_bad_spec_before_ray_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import dynabatch.service.raycluster

    def connect(*_: Any, **__: Any) -> None:
        raise AssertionError("Ray was started")

    import ray

    monkeypatch.setattr(ray, "init", connect)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(dynabatch.service.raycluster, "connect", connect)
    with pytest.raises(SpecError, match=r"^epochs: Input should be greater"):
        dynabatch.run({**SPEC, "epochs": 0})
    # The options the CLI checks before Ray starts, with its words.
    with pytest.raises(SpecError) as err:
        dynabatch.run({**SPEC, "model": {"name": "mlp", "options": {"layerz": 3}}})
    assert str(err.value) == "model.options: unknown option 'layerz' for mlp (allowed: layers)"
    with pytest.raises(ValueError, match=r"^scheduler: needs an address"):
        dynabatch.run(SPEC, scheduler=True)


# Accepted with a warning: the third slowdown applies only to a worker a scale request adds.
WARNED = {**SPEC, "emulation": {"slowdowns": [1, 2, 3]}}
WARNING = ("emulation.slowdowns has 3 entries; entries past 2 apply only to workers that a "
           "scale request adds beyond workers (2)")


def test_a_specs_warning_points_at_the_users_line_once(
    server: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dynabatch.run`` issues the spec's warning at the user's call, not inside pydantic;
    ``Client.submit`` issues the service's copy alone (the local validation's would repeat
    it), with the job's id."""
    import ray

    monkeypatch.setattr(ray, "init", lambda *_, **__: pytest.fail("Ray was started"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.warns(SpecWarning) as caught, pytest.raises(ValueError, match=r"^scheduler"):
        dynabatch.run(WARNED, scheduler=True)  # stops before Ray, after the spec is read
    assert [(str(w.message), w.filename) for w in caught] == [(WARNING, __file__)]

    client = Client(transport=AppTransport(server()))
    with pytest.warns(SpecWarning) as caught:
        # The service runs in this process here, and FastAPI's reading of the body (a
        # pydantic TypeAdapter) warns in it too; `dynabatch serve` keeps that copy out of
        # its own log (test_serve_signals.py).
        warnings.filterwarnings("ignore", category=SpecWarning, module=r"pydantic\.type_adapter")
        job = client.submit(WARNED)
    assert [(str(w.message), w.filename) for w in caught] == [
        (f"job {job.id}: {WARNING}", __file__)]
    assert job.warnings == [WARNING]

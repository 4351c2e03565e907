"""Experiment tracking (issue 33, item 6): ``tracking.tensorboard`` writes TensorBoard event
files of a job's per-epoch and per-step scalars, never fails the job, and is confined by the
operator's ``DYNABATCH_ARTIFACT_ROOT`` like ``artifacts.dir``. The files are read back with
TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dynabatch.actors.spec import JobSpec, SpecError, parse_spec
from dynabatch.api.cli.run import local_tracking
from dynabatch.scheduler import tracking as tracking_module
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sim.timeline import SimClock
from dynabatch.scheduler.sync.coordinator import Coordinator
from dynabatch.scheduler.tracking import Tracking
from dynabatch.service.submit_policy import SubmitPolicy, check_submission
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.asgi import AppTransport
from tests.fakes import Lineages, sim_runtime

N_TRAIN = 64


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the event files under ``logdir``, as (step, value) pairs."""
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _coordinator(tmp_path: Path, loss_of: Any = None, **spec: Any) -> Coordinator:
    s = JobSpec.model_validate(
        {"name": "tb", "workers": 2, "global_batch": 16, "epochs": 2, **spec}
    )
    rt = sim_runtime(s, n_train=N_TRAIN, gradients=Lineages(loss_of=loss_of))
    return Coordinator("job1", s, resume=False, runtime=rt, clock=rt.clock)


def test_a_job_writes_per_epoch_and_per_step_scalars_tensorboard_reads_back(tmp_path):
    coord = _coordinator(
        tmp_path,
        tracking={"tensorboard": str(tmp_path / "tb")},
        loss_of=lambda epoch, step: 2.0 - epoch - step / 10,
    )
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED
    history = coord.history()
    tags = _scalars(tmp_path / "tb" / "job1")
    # Per epoch, at the epoch's number: the record's own values.
    assert tags["epoch/train_loss"] == [(r.epoch, pytest.approx(r.train_loss)) for r in history]
    assert [s for s, _ in tags["epoch/test_accuracy"]] == [0, 1]
    assert tags["epoch/test_loss"] == [(r.epoch, pytest.approx(r.test_loss)) for r in history]
    for tag in ("epoch/utilization", "epoch/time_s", "epoch/samples_per_s", "epoch/global_batch"):
        assert len(tags[tag]) == 2, tag
    workers = [w.worker for w in history[-1].workers]
    assert len(workers) == 2
    for w in workers:
        assert len(tags[f"worker_share/{w}"]) == 2 and len(tags[f"worker_batch/{w}"]) == 2
    last = history[-1]
    shares = [tags[f"worker_share/{w.worker}"][-1][1] for w in last.workers]
    assert sum(shares) == pytest.approx(1.0)
    assert shares == [pytest.approx(w.partition / last.samples_trained) for w in last.workers]
    # Per step, at samples trained since the job began: 4 steps of 16 in each epoch.
    steps = [16 * k for k in range(1, 9)]
    assert [s for s, _ in tags["step/global_batch"]] == steps
    assert {v for _, v in tags["step/global_batch"]} == {16.0}
    assert tags["step/loss"] == [
        (16 * (4 * e + k + 1), pytest.approx(2.0 - e - k / 10)) for e in range(2) for k in range(4)
    ]
    assert not [x for x in coord.logs() if x.level == "WARNING"]


def test_a_directory_that_cannot_be_written_is_one_warning_and_the_job_succeeds(tmp_path):
    (tmp_path / "file").write_text("")  # a file where the directory would be
    coord = _coordinator(tmp_path, tracking={"tensorboard": str(tmp_path / "file")})
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED
    assert len(coord.history()) == 2
    warnings = [x.message for x in coord.logs() if x.level == "WARNING"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        f"tracking.tensorboard: cannot write event files to {tmp_path / 'file'}/job1 ("
    )


class _FailsAfter:
    """A writer whose every add_scalar after the first ``ok`` raises, as a full disk does."""

    def __init__(self, ok: int):
        self.ok = ok
        self.calls = 0

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.calls += 1
        if self.calls > self.ok:
            raise OSError(28, "No space left on device")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_writer_failing_mid_job_warns_once_and_writes_no_more(tmp_path, monkeypatch):
    warnings: list[str] = []
    writer = _FailsAfter(ok=3)
    coord = _coordinator(tmp_path, tracking={"tensorboard": str(tmp_path / "tb")})
    monkeypatch.setattr(tracking_module, "_summary_writer", lambda _: writer)
    coord.tracking = Tracking(str(tmp_path / "tb"), "job1", warnings.append)
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED and len(coord.history()) == 2
    assert warnings == [
        f"tracking.tensorboard: cannot write event files to "
        f"{tmp_path / 'tb'}/job1 ([Errno 28] No space left on device); the "
        "job goes on without them"
    ]
    assert writer.calls == 4 and not coord.tracking.active


def test_no_tracking_writes_nothing(tmp_path):
    coord = _coordinator(tmp_path)
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED
    assert not coord.tracking.active and list(tmp_path.iterdir()) == []


# Confinement -----------------------------------------------------------------------------
def test_tracking_is_confined_under_the_artifact_root(tmp_path):
    spec = JobSpec.model_validate({"tracking": {"tensorboard": str(tmp_path / "tb")}})
    assert check_submission(spec, SubmitPolicy()) == [
        (
            "tracking.tensorboard",
            "not allowed: this service accepts no artifacts directories (DYNABATCH_ARTIFACT_ROOT)",
        )
    ]
    assert check_submission(spec, SubmitPolicy(artifact_root=str(tmp_path))) == []
    escape = JobSpec.model_validate({"tracking": {"tensorboard": f"{tmp_path}/../elsewhere"}})
    [(field, why)] = check_submission(escape, SubmitPolicy(artifact_root=str(tmp_path)))
    assert field == "tracking.tensorboard" and "is outside the allowed directories" in why
    relative = JobSpec.model_validate({"tracking": {"tensorboard": "runs"}})
    assert check_submission(relative, SubmitPolicy(artifact_root=str(tmp_path))) == [
        ("tracking.tensorboard", "'runs' must be an absolute path")
    ]


def test_a_uri_is_refused_in_one_line_naming_the_field():
    with pytest.raises(SpecError) as err:
        parse_spec({"tracking": {"tensorboard": "s3://bucket/runs"}})
    assert str(err.value).startswith("tracking.tensorboard: 's3://bucket/runs' is a URI")
    assert "\n" not in str(err.value)


def test_a_local_run_writes_a_relative_directory_under_the_current_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = local_tracking(JobSpec.model_validate({"tracking": {"tensorboard": "runs"}}))
    assert spec.tracking.tensorboard == str(tmp_path / "runs")
    absolute = JobSpec.model_validate({"tracking": {"tensorboard": "/data/tb"}})
    assert local_tracking(absolute).tracking.tensorboard == "/data/tb"


class _NoPSRuntime:
    """Enough of a parameter-server runtime to build its driver (nothing is started)."""

    def __init__(self) -> None:
        self.clock = SimClock(1.7e9)


def test_a_parameter_server_job_writes_its_epochs(tmp_path):
    from dynabatch.scheduler.ps.driver import PSCoordinator

    spec = JobSpec.model_validate(
        {"protocol": {"name": "ps"}, "tracking": {"tensorboard": str(tmp_path / "tb")}}
    )
    coord = PSCoordinator("ps1", spec, runtime=_NoPSRuntime())
    coord._snap = {"workers": {"w0": {"batch": 8, "applied": 3}, "w1": {"batch": 4, "applied": 3}}}
    for epoch, loss in enumerate((0.9, 0.5)):
        coord._record_epoch(
            {
                "epoch": epoch,
                "version": 6,
                "samples_applied": 48,
                "retried_samples": 0,
                "verified": True,
                "train_loss": loss,
                "test_loss": loss + 0.1,
                "test_accuracy": 0.5,
                "samples_by_worker": {"w0": 32, "w1": 16},
            },
            wall_s=2.0,
        )
    coord.tracking.close()
    tags = _scalars(tmp_path / "tb" / "ps1")
    assert tags["epoch/train_loss"] == [(0, pytest.approx(0.9)), (1, pytest.approx(0.5))]
    assert tags["worker_share/w0"] == [(0, pytest.approx(2 / 3)), (1, pytest.approx(2 / 3))]
    assert tags["epoch/samples_per_s"] == [(0, 24.0), (1, 24.0)]


# The service and the CLI -----------------------------------------------------------------
def test_a_service_refuses_a_directory_outside_its_root_and_status_shows_where(tmp_path):
    from dynabatch.api.app import create_app
    from dynabatch.api.cli import job_commands as client_cli
    from dynabatch.service.rest_client import DynabatchClient
    from dynabatch.service.settings import Settings
    from fastapi.testclient import TestClient
    from typer import Typer
    from typer.testing import CliRunner

    from tests.fakes import FakeCluster

    settings = Settings(
        db_path=str(tmp_path / "db"), sync_interval_s=0.01, artifact_root=str(tmp_path / "out")
    )
    cli = Typer(pretty_exceptions_enable=False)
    client_cli.register(cli)
    with TestClient(create_app(settings, cluster=FakeCluster())) as http:
        client = DynabatchClient(transport=AppTransport(http))
        refused = http.post("/v1/jobs", json={"tracking": {"tensorboard": "/elsewhere"}})
        assert refused.status_code == 422
        assert "tracking.tensorboard" in refused.text and "/elsewhere" in refused.text
        tb = str(tmp_path / "out" / "tb")
        job = client.submit({"name": "tb", "epochs": 1, "tracking": {"tensorboard": tb}})
        obj = {"client_factory": lambda url, token: DynabatchClient(
            url, token=token, transport=AppTransport(http))}
        result = CliRunner().invoke(cli, ["status", job.job_id], obj=obj)
    assert result.exit_code == 0, result.output
    lines = [x for x in result.stdout.splitlines() if "TensorBoard" in x]
    assert lines == [
        f"TensorBoard event files: {tb}/{job.job_id} (view: tensorboard --logdir {tb})"
    ]

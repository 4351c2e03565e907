"""Issue 29 item 8: every view shows the job's own metrics, the same progress, and no epoch
of zero time.

A regression job (its spec's metrics: ``mae``, ``mse``) was shown as classification: the
epoch line said ``acc None``, ``status`` and the page "test accuracy -", the final line no
metric; ``list`` said 0/60 where ``status`` said 1/60; the last epoch reported 0.00 s and
utilization 0.000.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from dynabatch.api.app import create_app
from dynabatch.api.cli import job_commands as client_cli
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.runtime.seam import DataInfo
from dynabatch.scheduler.sim.calls import Call
from dynabatch.scheduler.sync.coordinator import Coordinator
from dynabatch.scheduler.sync.epoch_report import summary
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot
from dynabatch.service.rest_client import DynabatchClient
from dynabatch.service.schemas import JobDetail
from dynabatch.service.settings import Settings
from fastapi.testclient import TestClient
from rich.console import Console
from typer.testing import CliRunner

from tests.asgi import AppTransport
from tests.fakes import FakeCluster, TimedSimRuntime, sim_runtime
from tests.unit.test_engine_faults import _spec

REGRESSION = {"mae": 12.3456, "mse": 301.25}


def _regression_record(epoch: int = 0) -> EpochRecord:
    return EpochRecord(epoch=epoch, wall_s=0.5, steps=2, dataset_size=353,
                       samples_trained=353, train_loss=0.25, test_loss=0.3,
                       test_metrics=REGRESSION, utilization=0.8, compute_balance=0.9,
                       policy="dbs", workers=[])


def test_the_epoch_line_shows_the_jobs_own_metrics():
    line = summary(_regression_record(2))
    assert "mae 12.3456, mse 301.2500" in line
    assert "acc" not in line and "None" not in line
    # An epoch whose evaluation did not complete says so, not "None".
    bare = summary(_regression_record().model_copy(update={"test_metrics": {}}))
    assert "None" not in bare and "no test scores" in bare


def test_the_final_line_shows_the_jobs_own_metrics():
    from dynabatch.api.cli.run import final_line

    snap = JobSnapshot(job_id="ab" * 6, name="diabetes", state="SUCCEEDED",
                       test_metrics=REGRESSION)
    assert final_line(snap) == "diabetes: SUCCEEDED; test mae 12.3456, mse 301.2500"
    failed = JobSnapshot(job_id="ab" * 6, name="diabetes", state="FAILED", reason="boom")
    assert final_line(failed) == "diabetes: FAILED (boom)"


# ------------------------------------------------------------------ the service's views
def _app(tmp_path: Path, cluster: FakeCluster) -> TestClient:
    settings = Settings(
        db_path=str(tmp_path / "v.db"), sync_interval_s=0, checkpoint_root=str(tmp_path)
    )
    return TestClient(create_app(settings, cluster=cluster))


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    with _app(tmp_path, FakeCluster()) as client:
        yield client


def _cli(http: TestClient, *args: str) -> str:
    app = typer.Typer(pretty_exceptions_enable=False)
    client_cli.register(app)
    transport = AppTransport(http)
    result = CliRunner().invoke(app, list(args), obj={
        "client_factory": lambda url, token: DynabatchClient(url, token=token,
                                                             transport=transport)})
    assert result.exit_code == 0, result.output
    return result.stdout


def _views(http: TestClient, job: str) -> tuple[str, str, str]:
    """The progress ``list``, ``status`` and the page (its JSON) show, each "N/M"."""
    listed = _cli(http, "list")
    (row,) = [ln for ln in listed.splitlines() if job in ln]
    status = _cli(http, "status", job).splitlines()[0]
    page = http.get(f"/v1/jobs/{job}").json()["progress"]
    found = [re.search(r"(\d+)(?:/| of )(\d+)", text) for text in (row, status, page)]
    assert all(found), (row, status, page)
    return tuple(f"{m[1]}/{m[2]}" for m in found)  # type: ignore[index, return-value]


def test_list_status_and_the_page_agree_on_progress_in_every_state(http: TestClient):
    client = DynabatchClient(transport=AppTransport(http))
    job = client.submit({"name": "v", "epochs": 4, "workers": 2}).job_id
    service = http.app.state.service
    service.reconciler.sync_once()  # a step of the coordinator: RUNNING, one epoch completed
    assert len(set(_views(http, job))) == 1, _views(http, job)
    service.reconciler.sync_once()  # two completed
    assert len(set(_views(http, job))) == 1, _views(http, job)
    DynabatchClient(transport=AppTransport(http)).cancel(job, "enough")
    service.reconciler.sync_once()  # the coordinator ends the job at its next step boundary
    assert service.get(job).state.value == "CANCELLED"
    done = len(service.history(job))
    assert 0 < done < 4
    assert set(_views(http, job)) == {f"{done}/4"}  # CANCELLED: the epochs it completed


def test_status_and_the_page_show_the_jobs_own_metrics(tmp_path: Path):
    # The job trains its model: its epochs are scored on the held-out set.
    with _app(tmp_path, FakeCluster(real_gradients=True)) as http:
        spec = {"name": "v", "epochs": 2, "workers": 2, "dataset": {"name": "digits", "limit": 256}}
        job = DynabatchClient(transport=AppTransport(http)).submit(spec).job_id
        http.app.state.service.reconciler.sync_once()  # a step of the coordinator: one epoch
        detail = http.get(f"/v1/jobs/{job}").json()
        scores = http.app.state.service.cluster.coordinators[job].snapshot().test_metrics
    assert set(scores) == {"accuracy"} and 0 <= scores["accuracy"] <= 1
    assert detail["test_metrics"] == pytest.approx(scores)
    # A regression job's status shows its metrics, not an accuracy it does not have.
    regression = JobDetail.model_validate({**detail, "test_accuracy": None,
                                           "test_metrics": REGRESSION})
    console = Console(record=True, width=250)
    console.print(client_cli._job_table(regression))
    text = console.export_text()
    assert "mae 12.3456, mse 301.2500" in text and "accuracy" not in text


# ------------------------------------------------------------------ no zero-time epoch
class _LateCoordinator(TimedSimRuntime):
    """A coordinator slower than its workers (a busy machine): by the time it collects a
    segment, its workers have also run the evaluation queued behind it, before the segment
    sent ahead. The held-out set is large: each evaluation takes longer than an epoch's
    training."""

    def load_data(self) -> DataInfo:
        return DataInfo("fake", self.data.n_train, 4000)

    def collect_segment(self, ticket: Call, grace_s: float) -> list[WorkerOutcome]:
        out = super().collect_segment(ticket, grace_s)
        queued = self._calls.pending
        if queued and queued[0].shards is not None:
            self._calls.run_through(queued[0], grace_s)  # ran before the coordinator looked
        return out


def test_no_epoch_is_charged_zero_time_for_an_evaluation_that_ran_before_it():
    spec = _spec(workers=2, global_batch=100, epochs=4, policy="dbs",
                 rebalance={"mode": "epoch"})
    rt = sim_runtime(spec, n_train=100, speeds={0: 1000, 1: 1000}, runtime=_LateCoordinator)
    coord = Coordinator("job", spec, runtime=rt, clock=rt.clock)
    coord.run()
    hist = coord.history()
    assert coord.snapshot().state.value == "SUCCEEDED" and len(hist) == 4
    for r in hist:
        # Each epoch is one step of 50 samples per worker at 1000 samples/s: 50 ms of
        # training at least, however the evaluations around it are charged.
        assert r.wall_s >= 0.05 - 1e-9, (r.epoch, r.wall_s)
        assert r.utilization > 0, (r.epoch, r.utilization)

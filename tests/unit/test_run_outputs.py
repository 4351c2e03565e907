"""What ``dynabatch run`` (and ``dynabatch.run``) leaves and prints around the job (issue 49):
the report in a folder that did not exist, the TensorBoard line only for a folder that
exists, a wrongly named collate refused before Ray starts, 1-based epochs wherever a user
reads them, and plain progress lines when the output is not a terminal."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import typer
from dynabatch.actors.data.fs import join
from dynabatch.actors.spec import JobSpec, parse_spec
from dynabatch.api.cli import run as run_cli
from dynabatch.scheduler.core.lifecycle import JobState
from rich.console import Console
from typer.testing import CliRunner

from tests.fakes import FakeCluster
from tests.unit.test_cli_run import FakeJob

SPEC = {"name": "outs", "workers": 2, "global_batch": 64, "epochs": 2}


def _app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)
    run_cli.register(app)
    return app


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``run_job`` on a fake cluster (no Ray): ``hooks["launched"](job_id, spec)`` runs after
    each launch; ``err`` is what ``run`` printed on stderr."""
    import dynabatch.scheduler.runtime.launch as launch_mod
    import dynabatch.service.raycluster

    cluster = FakeCluster()
    err = io.StringIO()
    hooks: dict[str, Any] = {"launched": lambda job_id, spec: None, "err": err,
                             "cluster": cluster}

    def launch(job_id: str, spec: JobSpec, **kw: Any) -> str:
        cluster.launch(job_id, spec)
        hooks["launched"](job_id, spec)
        return job_id

    monkeypatch.setattr(dynabatch.service.raycluster, "connect", lambda *a, **k: {})
    monkeypatch.setattr(launch_mod, "launch_coordinator", launch)
    monkeypatch.setattr(run_cli.time, "sleep", lambda s: None)
    monkeypatch.setattr(run_cli, "RayJob", lambda job_id: FakeJob(cluster, job_id))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(run_cli, "stderr", lambda: Console(file=err, width=300))
    return hooks


def _run(spec: dict[str, Any], report: Path | None = None) -> tuple[Any, str]:
    out = io.StringIO()
    snap = run_cli.run_job(parse_spec(spec), address=None, report=report, quiet=True,
                           console=Console(file=out, width=300))
    return snap, out.getvalue()


def test_the_report_goes_into_a_folder_that_did_not_exist(
    fake_ray: dict[str, Any], tmp_path: Path
) -> None:
    report = tmp_path / "out" / "deeper" / "r.json"
    snap, out = _run(SPEC, report)
    assert snap.state == JobState.SUCCEEDED
    assert report.is_file() and f'"job_id": "{snap.job_id}"' in report.read_text()
    assert f"report written to {report}" in out
    assert not report.with_suffix(".json.tmp").exists()


def test_run_refuses_a_report_path_it_cannot_write_before_ray_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dynabatch.service.raycluster

    def no_ray(*_: Any, **__: Any) -> None:
        raise AssertionError("Ray was started before the report path was checked")

    monkeypatch.setattr(dynabatch.service.raycluster, "connect", no_ray)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("name: r\nworkers: 1\nglobal_batch: 8\nepochs: 1\n")
    (tmp_path / "afile").write_text("not a folder")
    report = tmp_path / "afile" / "r.json"
    result = CliRunner().invoke(_app(), ["run", str(cfg), "--report", str(report)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: --report: {report}: ") and "afile" in line


def test_the_tensorboard_line_names_only_a_folder_that_exists(
    fake_ray: dict[str, Any], tmp_path: Path
) -> None:
    tb = str(tmp_path / "tb")
    spec = {**SPEC, "tracking": {"tensorboard": tb}}

    # Ended before it trained a step: no event files, no folder, no line.
    fake_ray["launched"] = lambda job_id, _: fake_ray["cluster"].cancel(job_id, "stopped")
    snap, _ = _run(spec)
    assert snap.state == JobState.CANCELLED
    assert not Path(join(tb, snap.job_id)).exists()
    assert "TensorBoard" not in fake_ray["err"].getvalue()

    # Trained (its tracking made the folder): named once.
    fake_ray["launched"] = lambda job_id, _: Path(join(tb, job_id)).mkdir(parents=True)
    snap, _ = _run(spec)
    lines = [x for x in fake_ray["err"].getvalue().splitlines() if "TensorBoard" in x]
    assert lines == [f"TensorBoard event files: {join(tb, snap.job_id)} "
                     f"(view: tensorboard --logdir {tb})"]


COLLATE_PLUGIN = '''
def pad_batch(samples):
    return samples
'''


@pytest.mark.parametrize("collate, problem", [
    ("early_collate_plugin:pad_batchh",
     "dataset.collate: module 'early_collate_plugin' has no attribute 'pad_batchh'"),
    ("no_such_collate_module:pad",
     "dataset.collate: cannot import module 'no_such_collate_module'"),
])
def test_a_wrongly_named_collate_is_refused_before_ray_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, collate: str, problem: str
) -> None:
    import dynabatch.service.raycluster
    import ray

    def no_ray(*_: Any, **__: Any) -> None:
        raise AssertionError("Ray was started before the collate was checked")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(dynabatch.service.raycluster, "connect", no_ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "early_collate_plugin.py").write_text(COLLATE_PLUGIN)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("name: c\nworkers: 1\nglobal_batch: 8\nepochs: 1\nworking_dir: code\n"
                   "dataset: {name: parquet, path: /data/x.parquet, collate: "
                   f"'{collate}'}}\n")
    result = CliRunner().invoke(_app(), ["run", str(cfg)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {cfg}: {problem}"), line


@pytest.mark.parametrize("state, epoch, step, shown", [
    (JobState.FAILED, 0, 0, False),  # failed before its first step: no folder
    (JobState.FAILED, 1, 2, True),
    (JobState.RUNNING, 0, 0, True),  # made at its first step, any moment now
])
def test_status_names_the_tensorboard_folder_only_when_the_job_made_it(
    state: JobState, epoch: int, step: int, shown: bool
) -> None:
    from types import SimpleNamespace

    from dynabatch.api.cli.job_commands import _job_table

    job = SimpleNamespace(
        name="tb", job_id="a" * 12, state=state, progress="epoch 1/2", step=step,
        epoch=epoch, steps_per_epoch=3, policy="dbs", generation=0, train_loss=None,
        test_metrics={}, utilization=None, rebalances_total=0, reason=None, workers=[],
        step_breakdown=None, ps=None,
        spec=parse_spec({**SPEC, "tracking": {"tensorboard": "/runs/tb"}}))
    out = io.StringIO()
    Console(file=out, width=300).print(_job_table(job))
    assert ("TensorBoard event files: /runs/tb/" in out.getvalue()) is shown


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _progress_text(file: io.StringIO) -> tuple[str, Any]:
    from dynabatch.embedded import ProgressView

    cluster = FakeCluster()
    cluster.launch("b" * 12, parse_spec({**SPEC, "name": "bar", "epochs": 3}))
    view = ProgressView(enabled=True, file=file)
    snap, _ = run_cli.follow_job(FakeJob(cluster, "b" * 12), console=view.console, quiet=True,
                                 interval_s=0.0, on_update=view.update)
    view.close()
    return file.getvalue(), snap


def test_progress_to_a_file_is_plain_lines_not_a_bar() -> None:
    """``dynabatch.run`` with its output redirected (a log file, CI): a progress line now
    and then (each epoch, the end, or every PROGRESS_EVERY_S), never tqdm's ``\\r``
    redraws; on a terminal, the bar."""
    text, snap = _progress_text(io.StringIO())
    assert "\r" not in text
    progress = [x for x in text.splitlines() if x.startswith("bar: step ")]
    total = snap.epochs * snap.steps_per_epoch
    assert 2 <= len(progress) <= snap.epochs + 2, progress  # a modest rate
    assert progress[-1].startswith(f"bar: step {total}/{total} (100%), epoch 3/3")
    assert progress[-1].endswith("SUCCEEDED")
    bar, _ = _progress_text(_Terminal())
    assert "\r" in bar and f"{total}/{total}" in bar


def test_epochs_are_counted_from_1_wherever_a_user_reads_them() -> None:
    """The job log's epoch line, ``run``'s epoch table and utilization line, and the
    progress (``epoch 1/N``) all count epochs from 1; the records keep their 0-based index."""
    from dynabatch.scheduler.sync.epoch_report import summary
    from dynabatch.scheduler.telemetry import EpochRecord

    record = EpochRecord(epoch=0, wall_s=1.0, steps=3, dataset_size=192,
                         samples_trained=192, train_loss=0.5, utilization=0.5,
                         compute_balance=0.9, rebalances=0, generation=0, policy="dbs",
                         emulated=False, workers=[])
    assert summary(record, epochs=3).startswith("epoch 1/3: ")
    assert run_cli.epoch_cells(record)[0] == "1"
    line = run_cli.utilization_line({"run": 0.5, "planned": 0.6, "planned_from_epoch": 2,
                                     "by_epoch": [0.4, 0.5, 0.6]})
    assert line.startswith("utilization 0.600 from epoch 3") and "epochs 1-2" in line
    line = run_cli.utilization_line({"run": 0.5, "planned": 0.6, "planned_from_epoch": 1,
                                     "by_epoch": [0.4, 0.6]})
    assert line.startswith("utilization 0.600 from epoch 2") and "epoch 1 trained" in line

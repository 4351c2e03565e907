"""``dynabatch run``: the job's log (the user's own output) reaches the user, configs are read
with overrides and a working_dir relative to the file, and oversubscription is said."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import typer
from dynabatch.actors.spec import parse_spec
from dynabatch.api.cli import run as run_cli
from dynabatch.api.cli.common import CliError
from dynabatch.api.cli.config import read_config
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine
from rich.console import Console
from typer.testing import CliRunner

from tests.fakes import FakeCluster

CONFIG = "name: run-job\ndataset: {name: digits}\nworkers: 2\nglobal_batch: 64\nepochs: 2\n"


class FakeJob:
    """A fake cluster's coordinator as ``run`` sees it (as a RayJob)."""

    def __init__(self, cluster: FakeCluster, job_id: str):
        self.cluster, self.job_id = cluster, job_id

    def snapshot(self) -> JobSnapshot:
        return self.cluster.snapshot(self.job_id)

    def history(self, since: int = 0) -> list[EpochRecord]:
        return self.cluster.history(self.job_id, since)

    def logs(self, since: int = 0) -> list[LogLine]:
        return self.cluster.logs(self.job_id, since)

    def cancel(self, reason: str) -> JobSnapshot:
        return self.cluster.cancel(self.job_id, reason)


@pytest.mark.parametrize("tty", [False, True])
def test_run_shows_the_users_own_output(tty: bool) -> None:
    cluster = FakeCluster()
    spec = parse_spec({"workers": 2, "global_batch": 64, "epochs": 1})
    cluster.launch("a" * 12, spec)
    coordinator = cluster.coordinators["a" * 12]
    # The user's code printed to stderr on worker w0, as the coordinator's log follows it.
    for text in ("UserWarning: dataset.path is ignored by my loader",
                 "[red]raw[/red] mydata:cancer: :thumbs_up:"):
        coordinator._actor_line("w0", "stderr", text)
    out = io.StringIO()
    console = Console(file=out, force_terminal=tty, width=200)
    snap, hist = run_cli.follow_job(FakeJob(cluster, "a" * 12), console=console, quiet=not tty,
                                    interval_s=0.0)
    text = out.getvalue()
    assert snap.state.value == "SUCCEEDED" and hist
    assert "UserWarning: dataset.path is ignored by my loader" in text
    assert "[red]raw[/red] mydata:cancer: :thumbs_up:" in text  # as printed, no markup/emoji
    assert "state SUCCEEDED" in text  # the job log's last line, read after the end
    assert text.count("dataset.path is ignored") == 1


@pytest.mark.parametrize("tty", [False, True])
def test_what_run_prints_after_the_live_table_starts_a_line_of_its_own(tty: bool) -> None:
    """rich's Live ends its last line only on a terminal (Textualize/rich#4192): redirected
    (a log file, CI, ``| tee``), ``make run``'s utilization line ran on from the table's
    bottom border."""
    cluster = FakeCluster()
    cluster.launch("c" * 12, parse_spec({"workers": 2, "global_batch": 64, "epochs": 1}))
    out = io.StringIO()
    console = Console(file=out, force_terminal=tty, width=200)
    run_cli.follow_job(FakeJob(cluster, "c" * 12), console=console, quiet=False,
                       interval_s=0.0)
    console.print("utilization", highlight=False)
    lines = out.getvalue().replace("\x1b[?25h", "").splitlines()  # a terminal's cursor shown
    assert lines[-1] == "utilization", lines[-3:]
    assert lines[-2].rstrip().endswith("┘"), lines[-3:]


def test_capacity_warning_says_oversubscription() -> None:
    spec = parse_spec({"workers": 8, "global_batch": 64})
    line = run_cli.capacity_warning(spec, cores=2)
    assert line is not None and "\n" not in line
    assert line.startswith("8 workers x 1 worker_cpus = 8 CPUs on 2 cores: oversubscribed 4.0x")
    assert run_cli.capacity_warning(parse_spec({"workers": 2, "global_batch": 64}), 2) is None


def test_run_warns_before_starting_an_oversubscribed_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dynabatch.service.raycluster

    cfg = tmp_path / "job.yaml"
    cfg.write_text(CONFIG.replace("workers: 2", "workers: 8"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(run_cli.os, "cpu_count", lambda: 2)

    def connect(*_, **__):
        raise RuntimeError("stop before Ray")

    monkeypatch.setattr(dynabatch.service.raycluster, "connect", connect)
    result = CliRunner().invoke(_app(), ["run", str(cfg)])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[0].startswith("warning: 8 workers x 1 worker_cpus = 8 CPUs on 2 cores")
    assert lines[1] == "error: RuntimeError: stop before Ray"  # never a traceback


def _app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)
    run_cli.register(app)
    return app


def test_set_overrides_fields_and_errors_name_the_field(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(CONFIG)
    _, spec = read_config(cfg, sets=["epochs=3", "optimizer.lr=0.01", "dataset.name=synthetic"])
    assert (spec.epochs, spec.optimizer.lr, spec.dataset.name) == (3, 0.01, "synthetic")
    with pytest.raises(CliError, match=r"job.yaml: epochs: Input should be greater"):
        read_config(cfg, sets=["epochs=0"])
    with pytest.raises(CliError, match=r"bogus: unknown field"):
        read_config(cfg, sets=["bogus=1"])
    with pytest.raises(CliError, match=r"--set 'epochs': expected FIELD=VALUE"):
        read_config(cfg, sets=["epochs"])
    with pytest.raises(CliError, match=r"--set epochs.x: epochs is not a section"):
        read_config(cfg, sets=["epochs.x=1"])
    result = CliRunner().invoke(_app(), ["run", str(cfg), "--set", "global_batch=0"])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith(f"error: {cfg}: global_batch: Input should be")


def test_working_dir_is_relative_to_the_config_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "proj" / "code").mkdir(parents=True)
    cfg = tmp_path / "proj" / "job.yaml"
    cfg.write_text(CONFIG + "working_dir: code\n")
    monkeypatch.chdir(tmp_path)
    _, spec = read_config(cfg)
    assert spec.working_dir == str(tmp_path / "proj" / "code")
    _, spec = read_config(cfg, working_dir=Path("proj"))  # --working-dir: from the cwd
    assert spec.working_dir == str(tmp_path / "proj")
    cfg.write_text(CONFIG + "working_dir: ../mycode\n")
    result = CliRunner().invoke(_app(), ["run", str(cfg)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = result.stderr.splitlines()
    assert line == (f"error: {cfg}: working_dir: {tmp_path / 'mycode'} is not a directory "
                    "(a relative working_dir is read from the config's folder)")
    result = CliRunner().invoke(_app(), ["run", str(cfg), "--working-dir", "nope"])
    assert result.stderr.strip() == f"error: --working-dir: {tmp_path / 'nope'} is not a directory"


def test_the_epoch_table_shows_every_held_out_metric_by_its_name() -> None:
    cluster = FakeCluster()
    spec = parse_spec({"workers": 2, "global_batch": 64, "epochs": 1})
    cluster.launch("b" * 12, spec)
    job = FakeJob(cluster, "b" * 12)
    snap, hist = run_cli.follow_job(job, console=Console(file=io.StringIO()), quiet=True,
                                    interval_s=0.0)
    hist = [r.model_copy(update={"test_metrics": {"accuracy": 0.5, "top2": 0.875}})
            for r in hist]
    out = io.StringIO()
    Console(file=out, width=250).print(run_cli.render(snap, hist))
    assert "accuracy 0.5000, top2 0.8750" in out.getvalue()


PLUGIN = '''
def load(path, target="y"):
    raise AssertionError("an option check never calls the loader")


def net(input_shape, num_classes, width=8):
    raise AssertionError("an option check never builds the model")
'''


@pytest.mark.parametrize(("fields", "problem"), [
    ("dataset: {name: 'early_opts_plugin:load', options: {path: a, sepp: ','}}",
     "dataset.options: unknown option 'sepp' for 'early_opts_plugin:load' (it takes: path, "
     "target)"),
    ("dataset: {name: 'early_opts_plugin:load', options: {target: z}}",
     "dataset.options: 'early_opts_plugin:load' needs option 'path' (it has no default)"),
    ("dataset: {name: synthetic, options: {n_sample: 64}}",
     "dataset.options: unknown option 'n_sample' for synthetic (allowed: n_classes, "
     "n_features, n_samples)"),
    ("model: {name: 'early_opts_plugin:net', options: {widht: 4}}",
     "model.options: unknown option 'widht' for 'early_opts_plugin:net' (it takes: width)"),
    ("model: {name: mlp, options: {layerz: 3}}",
     "model.options: unknown option 'layerz' for mlp (allowed: layers)"),
    ("dataset: {name: parquet, path: /no/such/data, options: {x: [a], colour: red}}",
     "dataset.options: unknown option 'colour' for parquet (allowed: cache_groups, "
     "num_classes, scale, shape, targets, x, y)"),
    ("dataset: {name: npy, path: /no/such/data, options: {xs: 'x*.npy'}}",
     "dataset.options: unknown option 'xs' for npy (allowed: num_classes, scale, targets, x, "
     "y)"),
    ("dataset: {name: imagefolder, path: /no/such/data, options: {transform: [flip]}}",
     "dataset.options: unknown option 'transform' for imagefolder (allowed: mode, "
     "transforms)"),
], ids=["user-unknown", "user-missing", "builtin-dataset", "user-model", "builtin-model",
        "parquet", "npy", "imagefolder"])
def test_run_refuses_an_unknown_option_before_starting_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: str, problem: str
) -> None:
    import dynabatch.service.raycluster
    import ray

    def no_ray(*_, **__):
        raise AssertionError("Ray was started before the options were checked")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(dynabatch.service.raycluster, "connect", no_ray)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "early_opts_plugin.py").write_text(PLUGIN)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("name: opts\nworkers: 1\nglobal_batch: 8\nepochs: 1\nworking_dir: code\n"
                   f"{fields}\n")
    result = CliRunner().invoke(_app(), ["run", str(cfg)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.splitlines() == [f"error: {cfg}: {problem}"]


# A spec the service accepts with a warning: the third slowdown applies only to a worker a
# scale request adds past ``workers``.
WARNED = CONFIG + "emulation: {slowdowns: [1, 2, 3]}\n"
WARNING = ("emulation.slowdowns has 3 entries; entries past 2 apply only to workers that a "
           "scale request adds beyond workers (2)")


def test_run_and_simulate_show_a_specs_warning_as_one_line_naming_the_file(
    tmp_path: Path,
) -> None:
    """Not Python's form (``.../pydantic/main.py:792: UserWarning: ...`` and a line of
    pydantic's source): the CLI's own ``warning: FILE: message``, once."""
    from dynabatch.api.cli import simulate as sim_cli

    cfg = tmp_path / "job.yaml"
    cfg.write_text(WARNED)
    (tmp_path / "cluster.yaml").write_text(
        "classes: [{name: n, count: 2, a_ms: 1, c_ms_per_sample: 0.1}]\n")
    app = _app()
    sim_cli.register(app)
    # ``run`` stops at its option check (before any Ray), after reading the config.
    ran = CliRunner().invoke(app, ["run", str(cfg), "--scheduler"])
    simulated = CliRunner().invoke(app, ["simulate", str(cfg), "--cluster",
                                         str(tmp_path / "cluster.yaml"), "--quiet"])
    assert ran.exit_code == 2 and simulated.exit_code == 0, (ran.output, simulated.output)
    for result in (ran, simulated):
        warned = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
        assert warned == [f"warning: {cfg}: {WARNING}"], result.stderr
        assert "pydantic" not in result.output

"""``dynabatch run CONFIG``: train a config on Ray with a live table, then write a report."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from dynabatch.actors.errors import first_line
from dynabatch.actors.spec import JobSpec
from dynabatch.api.cli.common import (
    CliError,
    breakdown_table,
    fail,
    live_view,
    log_text,
    one_line,
    out_console,
    print_plain,
    ps_table,
    stderr,
    tensorboard_line,
    tensorboard_made,
    workers_table,
)
from dynabatch.api.cli.config import SetOption, read_config, spec_warnings_shown
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine, splits_text
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

# A coordinator answers snapshot/history/cancel from another thread in milliseconds; this
# bounds a call to one that died or hangs.
CALL_TIMEOUT_S = 60.0


def render(snap: JobSnapshot, history: list[EpochRecord]) -> Group:
    """The live view: a job line, per-worker allocation and telemetry, recent epochs."""
    head = Text.assemble(
        (f"{snap.name} ", "bold"), (f"[{snap.state.value}] ", "cyan"),
        f"epoch {min(snap.epoch + 1, snap.epochs)}/{snap.epochs}  "
        f"step {snap.step}/{snap.steps_per_epoch}  policy {snap.policy}  "
        f"generation {snap.generation}",
        (" EMULATED heterogeneity" if snap.emulated else "", "yellow"),
    )
    if snap.reason:
        head.append(f"\n{snap.reason}", style="dim")
    epochs = Table(title="epochs", expand=False)
    for col in EPOCH_COLUMNS:
        epochs.add_column(col, justify="right")
    for r in history[-6:]:
        epochs.add_row(*epoch_cells(r))
    parts = [head, workers_table(snap), epochs]
    if snap.ps is not None:  # protocol ps: per-learner staleness
        parts.append(ps_table(snap.ps))
    if snap.step_breakdown is not None:
        parts.append(breakdown_table(snap.step_breakdown))
    return Group(*parts)


EPOCH_COLUMNS = ("epoch", "time", "train loss", "held-out", "utilization", "balance",
                 "rebalances", "samples", "retried")


def epoch_cells(r: EpochRecord) -> list[str]:
    """One finished epoch as the epoch table's cells (:data:`EPOCH_COLUMNS`), counted
    from 1 as the progress's ``epoch 1/N``."""
    # "verified": the ledger found every sample trained exactly once, from the reports.
    samples = f"{r.samples_trained:,}" + (" verified" if r.verified else "")
    # The held-out metrics, each by its name in the spec and its split named ("-" before any).
    held_out = splits_text(r.validation_metrics, r.scores) or "-"
    return [str(r.epoch + 1), f"{r.wall_s:.2f}s", f"{r.train_loss:.4f}", held_out,
            f"{r.utilization:.3f}", f"{r.compute_balance:.3f}", str(r.rebalances),
            samples, str(r.retried_samples)]


def final_line(snap: JobSnapshot) -> str:
    """The run's last line: its outcome, and the job's own held-out metrics."""
    line = f"{snap.name}: {snap.state.value}"
    if snap.reason:
        line += f" ({snap.reason})"
    if held := splits_text(snap.validation_metrics, snap.test_metrics):
        line += f"; {held}"
    return line


def utilization_summary(history: list[EpochRecord]) -> dict[str, Any] | None:
    """The run's utilization (compute over the workers' wall time, as each epoch's), over
    the whole run and over the epochs trained under a measured plan: from the first epoch
    whose batches differ from the first epoch's (the first plan splits the batch before
    anything is measured, and the segment sent ahead across the first boundary keeps it),
    else from the second. Each epoch weighs by its workers' wall time. None: no epochs."""
    if not history:
        return None

    def batches(r: EpochRecord) -> dict[str, int]:
        return {w.worker: w.batch for w in r.workers}

    def weighted(rs: list[EpochRecord]) -> float | None:
        seconds = [r.wall_s * max(1, sum(1 for w in r.workers if w.steps)) for r in rs]
        total = sum(seconds)
        return sum(r.utilization * s for r, s in zip(rs, seconds, strict=True)) / total \
            if total > 0 else None

    first = batches(history[0])
    start = next((i for i, r in enumerate(history) if batches(r) != first),
                 min(1, len(history) - 1))
    planned = history[start:]
    return {"run": weighted(history), "planned": weighted(planned),
            "planned_from_epoch": planned[0].epoch,
            "by_epoch": [round(r.utilization, 4) for r in history]}


def utilization_line(summary: dict[str, Any]) -> str:
    """The summary as the line ``run`` prints at the end."""
    run, planned, k = summary["run"], summary["planned"], summary["planned_from_epoch"]
    if run is None or planned is None:
        return "utilization: no training time measured"
    # Counted from 1, as every epoch a user reads; ``k`` is the record's 0-based index.
    before = f"epochs 1-{k}" if k > 1 else "epoch 1"
    return (f"utilization {planned:.3f} from epoch {k + 1}, under the policy's measured plan "
            f"(whole run {run:.3f}: {before} trained under the first split, before any "
            "measurement; per epoch "
            f"{', '.join(f'{u:.2f}' for u in summary['by_epoch'])}). Utilization is the "
            "workers' compute over their wall time; each epoch line above says where the "
            "rest of a step went.")


def write_report(path: Path, spec: JobSpec, snap: JobSnapshot,
                 history: list[EpochRecord], **extra: Any) -> None:
    """The JSON report, with ``extra`` blocks (``simulate``'s ``simulation``)."""
    report = {
        "job_id": snap.job_id,
        "emulated": spec.emulated,
        "spec": spec.model_dump(mode="json"),
        "final": snap.model_dump(mode="json"),
        "utilization": utilization_summary(history),
        "history": [r.model_dump(mode="json") for r in history],
        **extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)  # a folder named for it, made here
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, path)


class RayJob:
    """What ``run`` reads of its job's coordinator actor (a fake in the tests), every call
    bounded in time."""

    def __init__(self, handle: Any):
        self.handle = handle

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=CALL_TIMEOUT_S)

    def snapshot(self) -> JobSnapshot:
        return self._get(self.handle.snapshot.remote())

    def history(self, since: int = 0) -> list[EpochRecord]:
        return self._get(self.handle.history.remote(since))

    def logs(self, since: int = 0) -> list[LogLine]:
        return self._get(self.handle.logs.remote(since))

    def cancel(self, reason: str) -> JobSnapshot:
        return self._get(self.handle.cancel.remote(reason))


def capacity_warning(spec: JobSpec, cores: int) -> str | None:
    """One line when the job's workers ask for more CPUs than this machine has (the embedded
    Ray is then given that many, so the job starts, but its workers share cores); None when
    they fit."""
    workers = spec.initial_workers or 1
    need = spec.worker_cpus * workers
    if need <= cores:
        return None
    factor = need / max(cores, 1)
    return (f"{workers} workers x {spec.worker_cpus:g} worker_cpus = {need:g} CPUs on "
            f"{cores} cores: oversubscribed {factor:.1f}x, so the workers share cores; expect "
            f"steps about {factor:.1f}x slower and low utilization (use workers <= "
            f"{max(1, int(cores // spec.worker_cpus))}, or --address for a cluster)")


def local_tracking(spec: JobSpec) -> JobSpec:
    """``spec`` with a relative ``tracking.tensorboard`` made absolute against the current
    directory: the job's driver runs in another, and a local run writes where its user
    says (a service confines the path instead: dynabatch.service.submit_policy)."""
    tb = spec.tracking.tensorboard
    if not tb or os.path.isabs(os.path.expanduser(tb)):
        return spec
    path = os.path.abspath(os.path.expanduser(tb))
    return spec.model_copy(update={
        "tracking": spec.tracking.model_copy(update={"tensorboard": path})})


def option_problem(spec: JobSpec, *, here: bool = False) -> str | None:
    """The first dataset, model, tokenizer or collate option the job cannot take, as one
    line, or None: a typo is reported before Ray starts, not after. A user module that does
    not import here is left to the job (it may import on the cluster), unless the job runs
    ``here`` (the embedded local Ray, whose workers see what this process sees)."""
    from dynabatch.actors.data.open import check_file_options
    from dynabatch.actors.workloads import WorkloadError
    from dynabatch.actors.workloads.datasets import check_dataset_options
    from dynabatch.actors.workloads.hf import check_tokenizer
    from dynabatch.actors.workloads.imports import NotImportable, resolve_callable
    from dynabatch.actors.workloads.models import check_model_options

    # The job's working_dir is importable on the cluster (shipped with it), so here too.
    local = spec.working_dir if spec.working_dir and os.path.isdir(spec.working_dir) else None
    if local:
        sys.path.insert(0, local)
    try:
        for check, section in ((check_dataset_options, spec.dataset),
                               (check_file_options, spec.dataset),
                               (check_model_options, spec.model),
                               # dataset.tokenizer against the model's vocab_size
                               (check_tokenizer, spec)):
            try:
                check(section)
            except NotImportable:
                continue
            except WorkloadError as err:
                return one_line(str(err))
        collate = spec.dataset.collate
        if collate is None:
            return None
        try:
            resolve_callable(collate, "dataset.collate")
        except NotImportable as err:
            module = collate.partition(":")[0]
            return one_line(str(err)) if here or module in sys.modules else None
        except Exception as err:  # a module whose own code fails: the job would fail the same
            return one_line(f"dataset.collate: {first_line(err, limit=None)}")
        return None
    finally:
        if local:
            sys.path.remove(local)


# Told the job's snapshot and epoch history at every poll, the last at its end.
OnUpdate = Callable[[JobSnapshot, list[EpochRecord]], None]


def follow_job(job: RayJob, *, console: Console, quiet: bool,
               interrupted: dict[str, int] | None = None,
               interval_s: float = 0.5, tick: Callable[[], None] | None = None,
               on_update: OnUpdate | None = None,
               ) -> tuple[JobSnapshot, list[EpochRecord]]:
    """Follow the job to its end: its log lines (the user's own prints, warnings and errors
    among them, from every worker: dynabatch.actors.output) scroll above the live table,
    printed as they are (no markup, no emoji). Ctrl-C (``interrupted``) cancels it.
    ``tick`` runs once a poll (the cluster scheduler's keep-alive); ``on_update`` is told
    what each poll read (another view of the job: ``dynabatch.run``'s progress bar)."""
    interrupted = interrupted if interrupted is not None else {"n": 0}
    since = 0
    cancel_sent = False

    def print_logs() -> None:  # above the live view (it is the console's)
        nonlocal since
        for line in job.logs(since):
            print_plain(console, log_text(line.time, line.level, line.message))
            since = line.seq + 1

    with live_view(console, refresh_per_second=4, auto_refresh=not quiet) as live:
        while True:
            snap = job.snapshot()
            hist = job.history(0)
            print_logs()
            if not quiet:
                live.update(render(snap, hist))
            if on_update is not None:
                on_update(snap, hist)
            if snap.state.is_terminal:
                print_logs()  # what the actors wrote last
                break
            if interrupted["n"] and not cancel_sent:
                live.console.print("[yellow]Ctrl-C: cancelling at the next step boundary "
                                   "(again to abort)[/]")
                job.cancel("cancelled from the command line (Ctrl-C)")
                cancel_sent = True
            if tick is not None:
                tick()
            time.sleep(interval_s)
    return snap, hist


def _tensorboard_teller(spec: JobSpec, job_id: str, *, here: bool) -> OnUpdate:
    """Told each poll: prints where the job's TensorBoard files are (one line, on stderr)
    once its folder exists, which a job that ends before its first step never makes."""
    root = spec.tracking.tensorboard
    said = not root

    def tell(snap: JobSnapshot, hist: list[EpochRecord]) -> None:
        nonlocal said
        trained = bool(hist) or snap.epoch > 0 or snap.step > 0
        if not said and tensorboard_made(root, job_id, trained=trained, here=here):
            said = True
            print_plain(stderr(), tensorboard_line(root, job_id))

    return tell


def embedded_ray(address: str | None) -> bool:
    """Whether a run with ``address`` trains on the embedded local Ray (no cluster named)."""
    return address is None and not os.environ.get("RAY_ADDRESS")


def run_problem(
    spec: JobSpec, *, address: str | None, scheduler: bool, report: str | Path | None
) -> tuple[str, str] | None:
    """Why a run cannot start, found before Ray starts: (the option at fault, ``spec`` for
    the job's own, and the problem), or None."""
    here = embedded_ray(address)
    if scheduler and here:
        return "scheduler", ("needs an address: the embedded local Ray runs one job, with no "
                             "cluster scheduler")
    if problem := option_problem(spec, here=here):
        return "spec", problem
    if report and (problem := report_problem(Path(report))):
        return "report", f"{report}: {problem}"
    return None


def report_problem(path: Path) -> str | None:
    """Why the JSON report cannot be written at ``path`` (one line), or None: its folder is
    made now (as the report's own is at the end), so a job is never trained for a report
    that is then lost."""
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot make the folder {parent} ({err.strerror or type(err).__name__})"
    if path.is_dir():
        return "is a folder; name the report's file (e.g. report.json)"
    if not os.access(parent, os.W_OK):
        return f"cannot write in the folder {parent} (permission denied)"
    return None


def run_job(spec: JobSpec, *, address: str | None, report: Path | None, quiet: bool,
            console: Console, scheduler: bool | None = None,
            on_update: OnUpdate | None = None) -> JobSnapshot:
    """Train ``spec`` to its end, following it (:func:`follow_job`, which passes
    ``on_update`` each poll). On a cluster (``address`` or ``RAY_ADDRESS``), the job queues
    with the cluster's scheduler (started if none runs) and trains on the nodes it grants
    (resized by it from then); ``scheduler`` False, or the embedded local Ray, launches it at
    once."""
    from dynabatch.scheduler.runtime.launch import launch_coordinator
    from dynabatch.service import scheduling as sched
    from dynabatch.service.raycluster import connect

    spec = local_tracking(spec)
    cores = os.cpu_count() or 1
    need = int(spec.worker_cpus * (spec.initial_workers or 1) + 0.999)
    embedded = embedded_ray(address)
    if embedded and (warning := capacity_warning(spec, cores)):
        print_plain(stderr(), f"warning: {warning}")
    # A local working_dir is shipped with this driver's Ray job
    # (dynabatch.scheduler.runtime.launch).
    connect(address, num_cpus=max(cores, need), working_dir=spec.working_dir)
    placer = sched.scheduler_for_run(not embedded, scheduler)
    interrupted = {"n": 0}

    def on_sigint(signum, frame):
        interrupted["n"] += 1
        if interrupted["n"] > 1:
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, on_sigint)
    tick = None
    try:
        if placer is None:
            job_id = uuid.uuid4().hex[:12]
            handle = launch_coordinator(job_id, spec, detached=False, resume=False)
        else:
            submit_s = time.time()
            job_id, handle = sched.run_placed(
                placer, spec,
                lambda jid, slots: launch_coordinator(
                    jid, spec, detached=False, resume=False, assignment=slots),
                on_wait=lambda why: print_plain(stderr(), f"cluster scheduler: {why}"),
                interrupted=lambda: interrupted["n"] > 0)
            print_plain(stderr(), f"cluster scheduler: job {job_id} granted its nodes")
            tick = sched.keep_alive(placer, job_id, spec, submit_s)
        tell_tensorboard = _tensorboard_teller(spec, job_id, here=embedded)

        def updated(snap: JobSnapshot, hist: list[EpochRecord]) -> None:
            tell_tensorboard(snap, hist)
            if on_update is not None:
                on_update(snap, hist)

        try:
            snap, hist = follow_job(RayJob(handle), console=console, quiet=quiet,
                                    interrupted=interrupted, tick=tick, on_update=updated)
        finally:
            if placer is not None:
                sched.quietly(placer.finished, job_id)  # its nodes free at once
    finally:
        signal.signal(signal.SIGINT, old)
    summary = utilization_summary(hist)
    if summary is not None:
        print_plain(console, utilization_line(summary))
    if report:
        write_report(report, spec, snap, hist)
        console.print(f"report written to {report}")
        if hist:
            for p in report_plots(report):
                console.print(f"plot written to {p}")
    return snap


def report_plots(path: Path, out: Path | None = None) -> list[Path]:
    """Render a JSON report's PNG plots (dynabatch.api.cli.plots) beside it, or under ``out``."""
    from dynabatch.api.cli.plots import render

    report = json.loads(path.read_text())
    return render(report, out or path.parent, prefix=f"{path.stem}-")


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report_cmd(
        report: Annotated[Path, typer.Argument(help="A JSON report of `dynabatch run`.")],
        out: Annotated[Path | None, typer.Option(
            help="Directory for the PNGs; default: beside the report.")] = None,
    ) -> None:
        """Render a report's plots (batch shares, compute vs wait, loss and metrics) as PNG."""
        console = Console()
        try:
            paths = report_plots(report, out)
        except (OSError, ValueError, KeyError, TypeError) as err:
            fail(stderr(), f"{report}: {str(err) or type(err).__name__}", code=1)
        for p in paths:
            console.print(str(p), highlight=False, soft_wrap=True)

    @app.command("run")
    def run(
        config: Annotated[Path, typer.Argument(help="YAML job config (see examples/).")],
        address: Annotated[str | None, typer.Option(
            help="Ray cluster address; default: an embedded local Ray.")] = None,
        report: Annotated[Path | None, typer.Option(
            help="Write a JSON report here at the end.")] = None,
        quiet: Annotated[bool, typer.Option(help="No live table (log lines still show).")
                         ] = False,
        working_dir: Annotated[Path | None, typer.Option(
            "--working-dir", help="Ship this directory with the job to every node (its "
            "modules importable by the job's import paths); overrides the config's "
            "working_dir, which is read relative to the config's folder.")] = None,
        sets: SetOption = None,
        scheduler: Annotated[bool | None, typer.Option(
            "--scheduler/--no-scheduler", help="With --address: queue the job with the "
            "cluster scheduler (started if none runs there) and train on the nodes it "
            "grants (the default); --no-scheduler launches it at once, bypassing the "
            "cluster scheduler.", show_default=False)] = None,
    ) -> None:
        """Train CONFIG on Ray, showing the job's log and a live per-worker table."""
        console = out_console()
        try:
            with spec_warnings_shown(config):
                _, spec = read_config(config, sets=sets or (), working_dir=working_dir)
        except CliError as err:
            fail(stderr(), str(err))
        if found := run_problem(spec, address=address, scheduler=scheduler, report=report):
            option, problem = found
            fail(stderr(), f"{config if option == 'spec' else '--' + option}: {problem}")
        try:
            snap = run_job(spec, address=address, report=report, quiet=quiet, console=console,
                           scheduler=scheduler)
        except KeyboardInterrupt:
            console.print("[red]aborted[/]")
            raise typer.Exit(130) from None
        except ConnectionError as err:
            fail(stderr(), f"cannot reach Ray at {address}: {err}", code=1)
        except Exception as err:  # never a traceback: one line, as every command
            fail(stderr(), first_line(err, limit=None), code=1)
        print_plain(console, final_line(snap))
        if snap.state == JobState.CANCELLED:
            raise typer.Exit(130)
        if snap.state != JobState.SUCCEEDED:
            raise typer.Exit(1)
        sys.stdout.flush()

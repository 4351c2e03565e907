"""``dynabatch simulate CONFIG``: what would this cluster do with this job?

Runs the job's spec on a simulated cluster (``dynabatch.scheduler.sim.simulator``: the production
coordinator and machines on a virtual clock), described in YAML (``--cluster``) or fitted
from a real run's report (``--from-report``). Prints the epochs and a summary, or with
``--compare`` one table across policies; ``--report`` writes the same JSON report as
``dynabatch run`` (plus a ``simulation`` block). Errors are one line, exit status 2.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from dynabatch.actors.spec import POLICIES, JobSpec, SpecError, load_spec
from dynabatch.api.cli.common import fail, out_console, stderr
from dynabatch.api.cli.config import spec_warnings_shown
from dynabatch.api.cli.run import render, write_report
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sim.cluster_spec import ClusterError, ClusterSpec, load_cluster
from dynabatch.scheduler.sim.profiles import cluster_from_profiles, hosting, profiles_from_report
from dynabatch.scheduler.sim.simulator import SimResult, simulate
from dynabatch.scheduler.telemetry import WorkerStatus
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

SHOWN_WORKERS = 16


@contextmanager
def quiet_engine():
    """The coordinator logs through ``dynabatch.coordinator``; a simulation's lines are in its
    result (and its report), so they are not echoed while it runs."""
    logger = logging.getLogger("dynabatch.coordinator")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def progress_bar(console: Console, unit: str, quiet: bool) -> Progress:
    """A task's description, its bar, done of total ``unit`` and the time taken, on
    ``console`` (stderr) while it runs (``quiet``: none)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn(unit), TimeElapsedColumn(), console=console, disable=quiet,
                    transient=True)


class UsageError(ValueError):
    """A bad combination of options (one line)."""


def cluster_for(cluster: Path | None, from_report: Path | None, spec: JobSpec) -> ClusterSpec:
    if (cluster is None) == (from_report is None):
        raise UsageError("give exactly one of --cluster CLUSTER.yaml or --from-report R.json")
    if cluster is not None:
        return load_cluster(cluster)
    try:
        report = json.loads(from_report.read_text())
    except OSError as err:
        raise ClusterError(f"{from_report}: cannot read report ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ClusterError(f"{from_report}: not valid JSON ({err})") from None
    if not isinstance(report, dict):
        raise ClusterError(f"{from_report}: expected a JSON object")
    try:
        profiles, allreduce_s = profiles_from_report(report)
    except ClusterError as err:
        raise ClusterError(f"{from_report}: {err}") from None
    # Each fitted node hosted its worker: it offers what the job's workers ask for.
    return cluster_from_profiles(profiles, allreduce_s, **hosting(spec))


def policies_for(spec: JobSpec, compare: str | None) -> list[str]:
    if not compare:
        return [spec.policy]
    names = [p.strip() for p in compare.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise UsageError(f"--compare: unknown policy {bad[0] if bad else compare!r} "
                         f"(use {', '.join(POLICIES)})")
    return list(dict.fromkeys(names))


def simulation_block(r: SimResult, real_gradients: bool) -> dict[str, Any]:
    """What a simulated report adds to a real run's: how it was simulated and its figures
    (the cluster events, recoveries, the faults of its fault script that fired, and how many
    calls of each kind the workers ran)."""
    rec = r.runtime.record
    return {
        "cluster": r.cluster.model_dump(mode="json", by_alias=True),
        "real_gradients": real_gradients,
        "dataset_size": r.dataset_size,
        "sim_seconds": r.sim_seconds,
        "wall_s": r.wall_s,
        "steady_epoch_s": r.steady_epoch_s,
        "ideal_epoch_s": r.ideal.epoch_s if r.ideal else None,
        "fraction_of_ideal": r.fraction_of_ideal,
        "throughput_over_sum_v": r.compute_fraction,
        "cluster_events": [{"time_s": h.time, "kind": h.kind, "nodes": list(h.nodes),
                            "detail": h.detail} for h in r.happened],
        "recoveries": [{"failed_at_s": x.failed_at, "lost": list(x.lost),
                        "resumed_at_s": x.resumed_at, "seconds": x.seconds}
                       for x in r.recoveries],
        "faults_fired": [f.model_dump(mode="json", by_alias=True, exclude_defaults=True)
                         for f in r.runtime.faults.fired],
        "calls": {k: getattr(rec, k) for k in ("submitted", "segments", "regroups",
                                                "evaluations", "fetches")},
    }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def compare_table(results: list[SimResult]) -> Table:
    t = Table(title="simulated policies (steady = epochs after the first 2)")
    for col in ("policy", "state", "steady epoch", "samples/s", "fraction of ideal",
                "throughput/Σv", "balance", "utilization", "rebalances", "test acc",
                "sim time", "wall"):
        t.add_column(col, justify="left" if col in ("policy", "state") else "right")
    for r in results:
        last = r.history[-1] if r.history else None
        t.add_row(r.spec.policy, r.snapshot.state.value, _fmt(r.steady_epoch_s, ".4f") + "s",
                  _fmt(r.throughput, ",.0f"), _fmt(r.fraction_of_ideal, ".3f"),
                  _fmt(r.compute_fraction, ".3f"), _fmt(r.steady_mean("compute_balance"), ".3f"),
                  _fmt(r.steady_mean("utilization"), ".3f"), str(r.snapshot.rebalances_total),
                  _fmt(last.test_accuracy if last else None, ".4f"),
                  f"{r.sim_seconds:.1f}s", f"{r.wall_s:.1f}s")
    return t


def print_result(console: Console, r: SimResult) -> None:
    # The workers as the last epoch left them (a finished job's snapshot has no plan).
    workers = list(r.snapshot.workers) if not r.history else [
        WorkerStatus(worker=w.worker, node=w.node, rank=i, batch=w.batch,
                     partition=w.partition, throughput=w.throughput,
                     compute_s_per_step=w.compute_s / max(w.steps, 1),
                     wait_s_per_step=w.wait_s / max(w.steps, 1), slowdown=w.slowdown)
        for i, w in enumerate(r.history[-1].workers)]
    shown = r.snapshot.model_copy(update={"workers": workers[:SHOWN_WORKERS]})
    console.print(render(shown, r.history))
    if len(workers) > SHOWN_WORKERS:
        console.print(f"(first {SHOWN_WORKERS} of {len(workers)} workers shown)")
    ideal = r.ideal.epoch_s if r.ideal else None
    console.print(
        f"steady epoch {_fmt(r.steady_epoch_s, '.4f')}s, ideal {_fmt(ideal, '.4f')}s: "
        f"fraction of ideal {_fmt(r.fraction_of_ideal, '.3f')} (throughput/Σv "
        f"{_fmt(r.compute_fraction, '.3f')}); {r.sim_seconds:.2f}s simulated in "
        f"{r.wall_s:.2f}s", highlight=False)
    for h in r.happened:
        console.print(f"t={h.time:.2f}s {h.kind} {', '.join(h.nodes[:8])}"
                      + (" ..." if len(h.nodes) > 8 else "") + f" {h.detail}", highlight=False)
    for x in r.recoveries:
        console.print(f"failure at t={x.failed_at:.2f}s ({', '.join(x.lost)}): training again "
                      f"{x.seconds:.2f}s later", highlight=False)


def run_ps(spec: JobSpec, cl: ClusterSpec, console: Console, report: Path | None) -> bool:
    """A ``protocol: ps`` spec: the parameter-server simulator (dynabatch.scheduler.sim.ps_job:
    the same core as on Ray, real gradients, the cluster's push/pull costs). True if it finished."""
    from dynabatch.actors.workloads.datasets import load_dataset
    from dynabatch.api.cli.common import ps_table
    from dynabatch.scheduler.ps.driver import build_core, ps_status
    from dynabatch.scheduler.sim.ps_job import check_cluster, simulate_ps

    check_cluster(cl)
    ds = load_dataset(spec.dataset, seed=spec.seed)
    r = simulate_ps(spec, build_core(spec, len(ds.y_train)), cl, data=ds)
    t = Table(title=f"{spec.name}: protocol ps ({spec.protocol.mode}), simulated")
    for col in ("epoch", "sim time", "test loss", "test acc", "samples"):
        t.add_column(col, justify="right")
    for e in r.epochs:
        t.add_row(str(e["epoch"]), f"{e['t']:.3f}s", f"{e['test_loss']:.4f}",
                  f"{e['test_accuracy']:.4f}", "verified" if e["verified"] else "NOT verified")
    snap = {**r.snapshot, "pushes_per_s": r.snapshot["pushes"] / r.virtual_s
            if r.virtual_s else 0.0}
    status = ps_status(spec, snap)
    console.print(t)
    console.print(ps_table(status))
    tau = r.staleness_summary()
    console.print(f"{r.samples_applied:,} samples applied in {r.virtual_s:.3f}s simulated "
                  f"({r.throughput:,.0f} samples/s); staleness mean {tau['mean']:.2f}, p99 "
                  f"{tau['p99']:.1f}; final training loss {r.final_train_loss:.4f}",
                  highlight=False)
    if report:
        body = {"spec": spec.model_dump(mode="json"), "ps": status.model_dump(mode="json"),
                "epochs": r.epochs, "simulation": {
                    "cluster": cl.model_dump(mode="json", by_alias=True), "protocol": "ps",
                    "real_gradients": True, "sim_seconds": r.virtual_s,
                    "throughput": r.throughput, "staleness": tau,
                    "final_train_loss": r.final_train_loss}}
        report.write_text(json.dumps(body, indent=2))
        console.print(f"report written to {report}", highlight=False)
    return bool(r.epochs) and len(r.epochs) == spec.epochs and all(
        e["verified"] for e in r.epochs)


def report_path(report: Path, policy: str, several: bool) -> Path:
    return report.with_name(f"{report.stem}-{policy}{report.suffix}") if several else report


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate_cmd(
        config: Annotated[Path, typer.Argument(help="YAML job config (see examples/).")],
        cluster: Annotated[Path | None, typer.Option(
            help="Cluster YAML: node classes with counts, noise, all-reduce, events.")] = None,
        from_report: Annotated[Path | None, typer.Option(
            help="Fit the cluster from a `dynabatch run --report` file instead.")] = None,
        compare: Annotated[str | None, typer.Option(
            help="Comma-separated policies to run and compare, e.g. static,dbs,affine.")] = None,
        real_gradients: Annotated[bool, typer.Option(
            help="Train the real model on the real data (one share after another).")] = False,
        report: Annotated[Path | None, typer.Option(
            help="Write the JSON report here (one per policy with --compare).")] = None,
        dataset_size: Annotated[int | None, typer.Option(
            help="Timing only: samples per epoch, without loading the data.")] = None,
        quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    ) -> None:
        """Simulate CONFIG on a cluster of unequal nodes (4 to 10,000) on a virtual clock."""
        console, err = out_console(), stderr()  # stdout as wide as run's

        try:
            with spec_warnings_shown(config):
                spec = load_spec(config)
            cl = cluster_for(cluster, from_report, spec)
            policies = policies_for(spec, compare)
        except SpecError as e:
            fail(err, f"{config}: {e}")
        except (ClusterError, UsageError) as e:
            fail(err, str(e))
        if spec.protocol.name == "ps":
            # The parameter server has its own simulator; the sync options do not apply.
            if compare:
                fail(err, "--compare: policies size sync batches; protocol.name is ps")
            if dataset_size is not None:
                fail(err, "--dataset-size: protocol ps simulates real gradients on the dataset")
            try:
                with quiet_engine():
                    ok = run_ps(spec, cl, console, report)
            except (ClusterError, SpecError, ValueError) as e:
                fail(err, str(e))  # WorkloadError (a dataset or model that cannot load) included
            if not ok:
                raise typer.Exit(1)
            return
        results = []
        with quiet_engine(), progress_bar(err, "steps", quiet) as bar:
            for policy in policies:
                task = bar.add_task(f"simulating {policy}", total=None)

                def progress(done: int, total: int, task=task) -> None:
                    bar.update(task, completed=done, total=total)

                run = spec if policy == spec.policy else JobSpec.model_validate(
                    {**spec.model_dump(mode="json"), "policy": policy})
                try:
                    r = simulate(run, cl, dataset_size=dataset_size,
                                 real_gradients=real_gradients, progress=progress)
                except (ClusterError, SpecError, ValueError) as e:
                    # WorkloadError (a dataset or model that cannot load) is a ValueError
                    fail(err, str(e))
                results.append(r)
                if report:
                    path = report_path(report, policy, len(policies) > 1)
                    write_report(path, r.spec, r.snapshot, r.history,
                                 simulation=simulation_block(r, real_gradients))
        if len(results) > 1:
            console.print(compare_table(results))
        else:
            print_result(console, results[0])
        if report:
            console.print(f"report written to {report_path(report, '*', len(results) > 1)}",
                          highlight=False)
        if any(r.snapshot.state != JobState.SUCCEEDED for r in results):
            for r in results:
                if r.snapshot.state != JobState.SUCCEEDED:
                    console.print(f"{r.spec.policy}: {r.snapshot.state.value} "
                                  f"({r.snapshot.reason})", highlight=False)
            raise typer.Exit(1)

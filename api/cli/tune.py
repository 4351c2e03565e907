"""``dynabatch tune CONFIG``: choose each stage's (global batch, LR factor, warm-up) from short
probe runs in the simulator's real-gradient mode (:mod:`dynabatch.api.cli.tuning`), judged on a
validation
split held out of the training data, over several seeds; write the tuned YAML config and a
JSON report of every probe. Errors are one line, exit status 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
import yaml
from dynabatch.actors.spec import SpecError, load_spec
from dynabatch.api.cli.common import fail, out_console, stderr
from dynabatch.api.cli.config import spec_warnings_shown
from dynabatch.api.cli.simulate import progress_bar, quiet_engine
from dynabatch.api.cli.tuning import Probe, TuneError, tune
from dynabatch.scheduler.sim.cluster_spec import ClusterError, load_cluster, parse_cluster
from rich.table import Table


def register(app: typer.Typer) -> None:
    @app.command("tune")
    def tune_cmd(
        config: Annotated[Path, typer.Argument(help="YAML job config with schedule.stages.")],
        budget: Annotated[int, typer.Option(help="Most probe runs to spend.")] = 20,
        max_batch: Annotated[int, typer.Option(help="Largest global batch to try.")] = 1024,
        tolerance: Annotated[float, typer.Option(
            help="Validation accuracy a candidate may lose against the small-batch "
            "baseline.")] = 0.01,
        probe_epochs: Annotated[int, typer.Option(
            help="Epochs each probe trains of the stage it tunes.")] = 2,
        warmups: Annotated[str, typer.Option(
            help="Warm-ups (epochs after a jump) to try, comma-separated.")] = "0,1,2",
        seeds: Annotated[int, typer.Option(
            help="Seeds per probe (the config's seed and the next ones); a probe's "
            "accuracy is their mean.")] = 2,
        holdout: Annotated[float, typer.Option(
            help="Share of the training data held out as the validation split the probes "
            "are judged on.")] = 0.2,
        cluster: Annotated[Path | None, typer.Option(
            help="Cluster YAML for the simulated probes (default: equal nodes).")] = None,
        out: Annotated[Path, typer.Option(help="Tuned YAML config.")] = Path("tuned.yaml"),
        report: Annotated[Path, typer.Option(help="JSON report of the probes.")] = Path(
            "tune-report.json"),
        quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    ) -> None:
        """Tune CONFIG's stage-wise batch schedule (Hu et al.) with short probe runs."""
        console, err = out_console(), stderr()  # stdout as wide as run's

        try:
            with spec_warnings_shown(config):
                spec = load_spec(config)
            # By default equal nodes, one per worker (the probes judge accuracy, not time).
            cl = load_cluster(cluster) if cluster is not None else parse_cluster({"classes": [
                {"name": "node", "count": spec.initial_workers or 2, "a_ms": 2.0,
                 "c_ms_per_sample": 0.1}]})
        except SpecError as e:
            fail(err, f"{config}: {e}")
        except ClusterError as e:
            fail(err, str(e))
        try:
            warm = [float(w) for w in warmups.split(",") if w.strip()]
        except ValueError:
            fail(err, f"--warmups: expected numbers separated by commas, got {warmups!r}")
        with quiet_engine(), progress_bar(err, "probes", quiet) as bar:
            # Sized to what can run (the budget, or fewer when the stages have fewer
            # candidates), and shrunk as stages settle early.
            task = bar.add_task("baseline", total=None)

            def on_probe(p: Probe, done: int, total: int) -> None:
                bar.update(task, completed=done, total=total, description=(
                    f"stage {p.stage} B={p.global_batch} acc {p.accuracy:.3f}"))

            try:
                result = tune(spec, cl, max_batch=max_batch, tolerance=tolerance,
                              probe_epochs=probe_epochs, warmups=warm, seeds=seeds,
                              holdout=holdout, budget=budget, on_probe=on_probe)
            except (TuneError, ClusterError, SpecError, ValueError) as e:
                fail(err, str(e))
        out.write_text(yaml.safe_dump(result.spec.model_dump(mode="json"), sort_keys=False))
        report.write_text(json.dumps(result.report(), indent=1))
        table = Table(title="probes")
        for col in ("stage", "role", "B", "LR factor", "warm-up", "val. accuracy",
                    "baseline", "kept"):
            table.add_column(col, justify="right")
        for p in result.probes:
            ref = result.baseline.get(p.stage) if p.role == "candidate" else None
            table.add_row(str(p.stage), p.role, str(p.global_batch), f"{p.lr_factor:.3g}",
                          f"{p.warmup_epochs:g}", f"{p.accuracy:.4f}",
                          "" if ref is None else f"{ref:.4f}", "yes" if p.kept else "")
        console.print(table)
        stages = ", ".join(f"{st.epochs}x{st.global_batch}"
                           for st in result.spec.schedule.stages)
        console.print(f"tuned stages (epochs x batch): {stages}"
                      + (" (budget exhausted)" if result.budget_exhausted else ""),
                      highlight=False)
        console.print(f"wrote {out} and {report}", highlight=False)

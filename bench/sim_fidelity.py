"""Simulator fidelity: how well ``dynabatch simulate --from-report`` predicts a Ray run.

Three jobs run on Ray (a ``ray.cluster_utils`` cluster of 1-CPU nodes on this machine, made
unequal by emulated slowdowns), each with ``--policy`` (affine by default):

* cluster (a): ``bench/hetero.py``'s job on 2 workers at slowdowns 1 and 3;
* cluster (b): the same job on 4 workers at slowdowns 1, 1, 2 and 4;
* the disturbance: ``bench/disturbance.py``'s job (4 equal workers, ``rebalance: adaptive``
  every 2 steps; worker 3 runs 4x slower from epoch 1, step ``--at``).

Each run's report (the file ``dynabatch run --report`` writes) is read back as
``dynabatch simulate --from-report`` reads it (the same function): per-worker ``a + c·b``
fitted from the epoch records, the rest of a step from the epochs' wall time
(``scheduler/sim/profiles.py``). The same job is then simulated on that cluster (timing
only; the spec's emulation re-applies the slowdowns and the disturbance) and compared:

* clusters: the mean epoch time over the epochs after the first (the first pays the workers'
  start-up and the policy's first measurements), Ray against the simulator,
  ``error = |sim - ray| / ray``;
* disturbance: the steps from the slowdown until the per-step compute balance is back to
  >= 0.85 for 3 steps, ``bench/disturbance.py``'s ``steps_to_recover``, on both.

Each cluster also gets ``held_out``: the simulator fitted from the report's first half of
epochs only, against Ray's later epochs (a prediction of epochs the fit did not see).

Prints one JSON object (the machine's load average before and after included: the emulated
nodes share its cores).

Usage: python bench/sim_fidelity.py [--quick] [--policy affine] [--jobs a,b,disturbance]
       [--reports DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from dynabatch.actors.spec import JobSpec
from dynabatch.api.cli.run import write_report
from dynabatch.api.cli.simulate import cluster_for, quiet_engine
from dynabatch.scheduler.sim.cluster_spec import ClusterSpec
from dynabatch.scheduler.sim.cost_model import ring_allreduce_s
from dynabatch.scheduler.sim.simulator import simulate
from dynabatch.scheduler.telemetry import EpochRecord

from bench import disturbance, hetero
from bench.report import emit
from bench.runtime_watch import watch_steps

SKIP = 1  # epochs left out of the mean: the first pays start-up
NODES = 4  # the Ray cluster's nodes: the most any of the three jobs uses


def steady_epoch_s(history: list[EpochRecord], skip: int = SKIP) -> float:
    """The mean wall time of the epochs after the first ``skip``."""
    rest = history[skip:]
    if not rest:
        raise ValueError(f"history: {len(history)} epochs, none after the first {skip}")
    return statistics.mean(r.wall_s for r in rest)


def relative_error(predicted: float, measured: float) -> float:
    """``|predicted - measured| / measured``."""
    return abs(predicted - measured) / measured


def recovery(reports: list[list[Any]], at: int) -> dict[str, Any]:
    """Steps to recover balance after the disturbance at epoch 1, step ``at`` (the
    disturbance bench's definition), from the per-step reports a coordinator's
    ``watch_steps`` (``bench/runtime_watch.py``) gave, with the balance of the steps around it."""
    rows = disturbance.per_step_balance(reports)
    start = disturbance.disturbance_start(rows, at)
    return {
        "steps": disturbance.steps_to_recover(rows, start),
        "per_step_balance": [round(r["balance"], 3) for r in rows[max(0, start - 3) : start + 20]],
    }


def run_on_ray(spec: JobSpec, report: Path) -> tuple[list[EpochRecord], list[list[Any]]]:
    """Run ``spec`` on the connected Ray cluster, write its report to ``report``; its epoch
    records and per-step reports."""
    from dynabatch.scheduler.sync.coordinator import Coordinator

    coord = Coordinator(spec.name, spec, resume=False)
    steps: list[list[Any]] = []
    watch_steps(coord.runtime, steps.append)
    snap = coord.run()
    if snap.state.value != "SUCCEEDED":
        raise RuntimeError(f"{spec.name}: {snap.state.value}: {snap.reason}")
    history = coord.history()
    write_report(report, spec, snap, history)
    return history, steps


def run_in_sim(spec: JobSpec, cluster: ClusterSpec) -> tuple[list[EpochRecord], list[list[Any]]]:
    """The same job in the simulator on ``cluster``: its epoch records and per-step reports."""
    steps: list[list[Any]] = []
    with quiet_engine():
        res = simulate(spec, cluster,
                       coordinator_hook=lambda c: watch_steps(c.runtime, steps.append))
    if res.snapshot.state.value != "SUCCEEDED":
        raise RuntimeError(f"{spec.name} (simulated): {res.snapshot.reason}")
    return res.history, steps


def fitted_cluster(report: Path, spec: JobSpec) -> tuple[ClusterSpec, dict[str, Any]]:
    """The cluster ``dynabatch simulate --from-report`` fits from ``report`` for ``spec``,
    and its numbers for the JSON."""
    cl = cluster_for(None, report, spec)
    return cl, {
        "workers": [
            {
                "name": c.name,
                "a_ms": round(c.a_ms, 3),
                "c_ms_per_sample": round(c.c_ms_per_sample, 5),
            }
            for c in cl.classes
        ],
        # What the simulator charges a step beyond its slowest compute (scheduler/sim/profiles.py)
        "rest_of_step_ms": round(
            1e3 * ring_allreduce_s(len(cl.classes), 0.0, cl.allreduce.alpha_ms / 1e3, 0.0), 3
        ),
    }


def held_out(spec: JobSpec, report: Path, ray_hist: list[EpochRecord], k: int) -> dict[str, Any]:
    """The simulator fitted from the report's first ``k`` epochs only, against Ray's later
    epochs: a prediction of epochs the fit did not see."""
    data = json.loads(report.read_text())
    data["history"] = data["history"][:k]
    part = report.with_name(f"{report.stem}-first-{k}-epochs.json")
    part.write_text(json.dumps(data))
    cl, _ = fitted_cluster(part, spec)
    sim_hist, _ = run_in_sim(spec, cl)
    ray_s, sim_s = steady_epoch_s(ray_hist, k), steady_epoch_s(sim_hist, k)
    return {
        "fitted_from_epochs": f"0..{k - 1}",
        "compared_epochs": f"{k}..{len(ray_hist) - 1}",
        "ray_epoch_s": round(ray_s, 4),
        "sim_epoch_s": round(sim_s, 4),
        "error": round(relative_error(sim_s, ray_s), 4),
    }


def compare_cluster(slowdowns: list[float], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    spec = hetero.make_spec(slowdowns, args.policy, args)
    report = work / f"cluster-{len(slowdowns)}-workers.json"
    ray_hist, _ = run_on_ray(spec, report)
    cl, fit = fitted_cluster(report, spec)
    sim_hist, _ = run_in_sim(spec, cl)
    ray_s, sim_s = steady_epoch_s(ray_hist), steady_epoch_s(sim_hist)
    return {
        "slowdowns": slowdowns,
        "ray_epoch_s": round(ray_s, 4),
        "sim_epoch_s": round(sim_s, 4),
        "error": round(relative_error(sim_s, ray_s), 4),
        "ray_epochs_s": [round(r.wall_s, 3) for r in ray_hist],
        "sim_epochs_s": [round(r.wall_s, 3) for r in sim_hist],
        "ray_final_batches": {w.worker: w.batch for w in ray_hist[-1].workers},
        "sim_final_batches": {w.worker: w.batch for w in sim_hist[-1].workers},
        "fitted": fit,
        # Fitted from at least 2 epochs: the first alone pays start-up and has one batch.
        "held_out": held_out(spec, report, ray_hist, max(2, len(ray_hist) // 2)),
    }


def compare_disturbance(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    spec = disturbance.spec_for(args.policy, "adaptive", 2, args)
    report = work / "disturbance.json"
    ray_hist, ray_steps = run_on_ray(spec, report)
    cl, fit = fitted_cluster(report, spec)
    sim_hist, sim_steps = run_in_sim(spec, cl)
    ray_rec, sim_rec = recovery(ray_steps, args.at), recovery(sim_steps, args.at)
    return {
        "disturbance": f"worker 3 slows 4x at epoch 1 step {args.at}",
        "recovery": f"steps until per-step balance >= {disturbance.TARGET} for "
        f"{disturbance.HOLD} steps (bench/disturbance.py's steps_to_recover)",
        "ray_steps": ray_rec["steps"],
        "sim_steps": sim_rec["steps"],
        "ray_per_step_balance": ray_rec["per_step_balance"],
        "sim_per_step_balance": sim_rec["per_step_balance"],
        "ray_epochs_s": [round(r.wall_s, 3) for r in ray_hist],
        "sim_epochs_s": [round(r.wall_s, 3) for r in sim_hist],
        "fitted": fit,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="Fewer epochs and samples (a smoke run; noisier figures).",
    )
    ap.add_argument("--policy", default="affine")
    ap.add_argument("--jobs", default="a,b,disturbance", help="Which of a, b, disturbance.")
    ap.add_argument(
        "--reports",
        default=None,
        help="Keep the Ray runs' reports in this directory (for dynabatch simulate --from-report).",
    )
    ap.add_argument("--at", type=int, default=10, help="Step of epoch 1 where it slows down.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="Also write the JSON here.")
    args = ap.parse_args()
    # hetero.make_spec and disturbance.spec_for read these: their benches' defaults, fewer
    # with --quick.
    args.mnist, args.n_test = None, 2000
    args.n_train, args.epochs = (4096, 3) if args.quick else (12000, 6)
    dist = argparse.Namespace(**vars(args))
    dist.n_train, dist.epochs = (4096, 3) if args.quick else (8192, 3)

    import ray
    from dynabatch.service.raycluster import fast_health_check
    from ray.cluster_utils import Cluster

    load_before = os.getloadavg()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": 200 * 2**20,
            "_system_config": fast_health_check(),
        },
    )
    for i in range(NODES):
        # Both benches' node resources: their specs place workers by them.
        cluster.add_node(
            num_cpus=1,
            resources={"bench_node": 1, "disturb_node": 1, f"n{i}": 1},
            object_store_memory=150 * 2**20,
        )
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="dynabatch-bench", log_to_driver=False)
    out: dict[str, Any] = {
        "what": "dynabatch simulate --from-report against the Ray run it was fitted from",
        "command": " ".join(sys.argv),
        "emulated": True,
        "policy": args.policy,
        "cpus": os.cpu_count(),
        "epoch_mean": f"mean wall time of epochs {SKIP + 1}.. (the first, which pays start-up, "
        "is left out)",
        "error": "|sim_epoch_s - ray_epoch_s| / ray_epoch_s",
        "targets": "error <= 0.10 on both clusters; |sim_steps - ray_steps| <= 2",
        "clusters": {},
    }
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(args.reports or tmp)
            work.mkdir(parents=True, exist_ok=True)
            for name in args.jobs.split(","):
                if name == "disturbance":
                    out["disturbance"] = compare_disturbance(dist, work)
                else:
                    out["clusters"][name] = compare_cluster(hetero.CLUSTERS[name], args, work)
                print(f"[{name}] done", file=sys.stderr)
    finally:
        ray.shutdown()
        cluster.shutdown()
    out["loadavg_before"] = [round(x, 2) for x in load_before]
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    emit(out, args.out, indent=2)


if __name__ == "__main__":
    main()

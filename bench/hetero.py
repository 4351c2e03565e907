"""Heterogeneous-cluster benchmark: static vs DBS vs affine on a compute-dominated workload.

A LeNet-style CNN on 28x28 MNIST-format images (real files with --mnist DIR, generated
ones otherwise), global batch 256, on ``ray.cluster_utils`` clusters whose nodes are made
unequal by emulated slowdowns (the report says so):

  (a) 2 workers at slowdowns 1 and 3 (fits a 2-core machine)
  (b) 4 workers at slowdowns 1, 1, 2 and 4

Every policy runs the same seed for the same number of epochs, ``--repeats`` times,
interleaved (static, dbs, affine, static, ...) so that the machine's drift hits every
policy alike; the report gives each run and the medians.

The ideal is measured in the same cluster, the way the workers run: in lockstep (a barrier
before every timed step, so each worker computes while the others do, sharing the
machine's cores as in training). Pass 1 profiles every worker on a common grid of batch
sizes; the fits t_i(b) = a_i + c_i·b give an equal-finish split b*; pass 2 profiles each
worker around its own b* (0.8-1.2 b*), where training runs, and is fitted again. With
T* the equal-finish step time of those fits and A the all-reduce measured in lockstep:

  bound epoch  = steps × T*        (all-reduce fully hidden behind backward)
  ideal epoch  = steps × (T* + A)  (no overlap)

``fraction_of_ideal`` = ideal epoch / a policy's steady epoch (and likewise for the bound).
A policy can beat the ideal only by hiding the all-reduce; it cannot beat the bound
except by measurement noise. Prints one JSON object.

Usage: python bench/hetero.py [--clusters a,b] [--epochs 6] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np
import ray
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.scheduler.core.sync.steptime import StepTimeStats, equal_finish, fit
from dynabatch.scheduler.runtime.pool import eligible_nodes, spawn_worker
from dynabatch.scheduler.sync.coordinator import Coordinator
from dynabatch.service.raycluster import fast_health_check
from ray.cluster_utils import Cluster

from bench.report import emit
from bench.worker_probes import profile, time_allreduce

CLUSTERS = {"a": [1.0, 3.0], "b": [1.0, 1.0, 2.0, 4.0]}
PROFILE_BATCHES = [16, 64, 128, 192, 256]


def make_spec(slowdowns: list[float], policy: str, args: argparse.Namespace) -> JobSpec:
    dataset: dict[str, Any] = {"name": "mnist"}
    if args.mnist:
        dataset["path"] = args.mnist
        dataset["limit"] = args.n_train
    else:
        dataset["options"] = {"n_train": args.n_train, "n_test": args.n_test}
    return JobSpec.model_validate({
        "name": f"bench-{policy}", "dataset": dataset, "model": {"name": "lenet"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "workers": len(slowdowns), "global_batch": 256, "epochs": args.epochs,
        "policy": policy, "seed": args.seed, "node_resource": "bench_node",
        "emulation": {"slowdowns": slowdowns}, "collective_timeout_s": 120,
    })


def run_policy(spec: JobSpec) -> dict[str, Any]:
    coord = Coordinator(f"bench-{spec.policy}", spec, resume=False)
    t0 = time.perf_counter()
    snap = coord.run()
    total = time.perf_counter() - t0
    hist = coord.history()
    if snap.state.value != "SUCCEEDED":
        raise RuntimeError(f"{spec.policy}: {snap.state.value}: {snap.reason}")
    steady = hist[2:] or hist
    # Where a steady epoch's time goes, in seconds per epoch (the records' per-step
    # breakdown times the steps): the step's phases, the coordinator's share (wall time no
    # worker step covers) and what the previous epoch's evaluation cost the critical path.
    parts = ("gather_s", "forward_s", "backward_s", "allreduce_wait_s", "optimizer_s",
             "overlap_s", "coordinator_s", "evaluation_s")
    breakdown = {k: statistics.mean(getattr(r.breakdown, k) * r.steps for r in steady
                                    if r.breakdown is not None) for k in parts}
    return {
        "epoch_s": [round(r.wall_s, 3) for r in hist],
        "steady_epoch_s": statistics.mean(r.wall_s for r in steady),
        "balance": statistics.mean(r.compute_balance for r in steady),
        "utilization": statistics.mean(r.utilization for r in steady),
        "final_accuracy": hist[-1].test_accuracy,
        "final_batches": {w.worker: w.batch for w in hist[-1].workers},
        "slowdowns": {w.worker: w.slowdown for w in hist[-1].workers},
        "rebalances": snap.rebalances_total,
        "wall_s": round(total, 2),
        "breakdown_epoch_s": breakdown,
    }


def _lockstep_fits(workers: list[Any], grids: list[list[int]], repeats: int
                   ) -> tuple[list[Any], list[dict[int, float]]]:
    profiles = ray.get([w.__ray_call__.remote(profile, g, repeats, True, True) for w, g in
                        zip(workers, grids, strict=True)], timeout=600)
    fits = []
    for prof in profiles:
        stats = StepTimeStats()
        for b, t in prof.items():
            stats = stats.add(float(b), t)
        fits.append(fit(stats))
    return fits, profiles


def _equal_finish(fits: list[Any], B: int) -> tuple[np.ndarray, float]:
    a = np.array([f.a for f in fits])
    c = np.array([f.c for f in fits])
    n = len(fits)
    return equal_finish(a, c, float(B), np.ones(n), np.full(n, float(B)))


def measure_ideal(spec: JobSpec, n_train: int, repeats: int = 5) -> dict[str, Any]:
    """Lockstep step-time fits per worker plus the all-reduce: the best achievable epoch
    (see the module docstring)."""
    ds = load_dataset(spec.dataset, seed=spec.seed)
    data = {"x_train": ray.put(ds.x_train), "y_train": ray.put(ds.y_train),
            "input_shape": tuple(ds.input_shape), "num_classes": ds.num_classes}
    nodes = eligible_nodes(spec)
    workers = [spawn_worker(spec, f"w{i}", i, nodes[i].node_id, 0.0, data)
               for i in range(spec.initial_workers)]
    try:
        rv = ray.get(workers[0].open_store.remote(1, len(workers)), timeout=120)
        ray.get([w.join.remote(rv, r, 0) for r, w in enumerate(workers)], timeout=120)
        allreduce = statistics.median(
            ray.get([w.__ray_call__.remote(time_allreduce, 10) for w in workers],
                    timeout=120))
        n, B = len(workers), spec.global_batch
        fits1, _ = _lockstep_fits(workers, [PROFILE_BATCHES] * n, repeats)
        b1, _ = _equal_finish(fits1, B)
        # Around each worker's own share; every list has the same length (lockstep).
        grids = [[max(2, round(float(b) * f)) for f in (0.7, 0.85, 1.0, 1.15, 1.3)]
                 for b in b1]
        fits, profiles = _lockstep_fits(workers, grids, repeats)
        b_star, t_star = _equal_finish(fits, B)
    finally:
        for w in workers:
            ray.kill(w)
    a = np.array([f.a for f in fits1])
    c = np.array([f.c for f in fits1])
    t_static = float(np.max(a + c * (B / n)))
    steps = -(-n_train // B)
    return {
        "allreduce_s": allreduce,
        "fits": [{"a_s": f.a, "c_s_per_sample": f.c} for f in fits],
        "lockstep_step_s": [{str(b): round(t, 5) for b, t in p.items()} for p in profiles],
        "equal_finish_batches": [round(float(b), 1) for b in b_star],
        "ideal_step_s": t_star + allreduce,
        "bound_epoch_s": steps * t_star,
        "ideal_epoch_s": steps * (t_star + allreduce),
        "static_model_epoch_s": steps * (t_static + allreduce),
        "ideal_speedup": (t_static + allreduce) / (t_star + allreduce),
    }


def _median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def bench_cluster(name: str, args: argparse.Namespace) -> dict[str, Any]:
    slowdowns = CLUSTERS[name]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 200 * 2**20, "_system_config": fast_health_check()})
    for i in range(len(slowdowns)):
        cluster.add_node(num_cpus=1, resources={"bench_node": 1, f"n{i}": 1},
                         object_store_memory=150 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="dynabatch-bench", log_to_driver=False)
    try:
        policies = args.policies.split(",")
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        ideals = []
        n_train = _n_train(args)
        for r in range(args.repeats):
            ideals.append(measure_ideal(make_spec(slowdowns, "static", args), n_train))
            for policy in policies:
                runs[policy].append(run_policy(make_spec(slowdowns, policy, args)))
                print(f"[{name} round {r}] {policy}: "
                      f"{runs[policy][-1]['steady_epoch_s']:.2f}s/epoch", file=sys.stderr)
        ideal = {k: statistics.median(i[k] for i in ideals) for k in (
            "allreduce_s", "ideal_step_s", "bound_epoch_s", "ideal_epoch_s",
            "static_model_epoch_s", "ideal_speedup")}
        ideal["rounds"] = ideals
        out: dict[str, Any] = {"slowdowns": slowdowns, "emulated": True,
                               "repeats": args.repeats, "ideal": ideal, "policies": {}}
        for policy, rs in runs.items():
            steady = _median_of(rs, "steady_epoch_s")
            out["policies"][policy] = {
                "steady_epoch_s": steady,
                "steady_epoch_s_runs": [r["steady_epoch_s"] for r in rs],
                "balance": _median_of(rs, "balance"),
                "utilization": _median_of(rs, "utilization"),
                "final_accuracy": statistics.median(r["final_accuracy"] or 0 for r in rs),
                "fraction_of_ideal": ideal["ideal_epoch_s"] / steady,
                "fraction_of_bound": ideal["bound_epoch_s"] / steady,
                "runs": rs,
            }
        pol = out["policies"]
        if "static" in pol:
            base = pol["static"]["steady_epoch_s"]
            for p in pol.values():
                p["speedup"] = base / p["steady_epoch_s"]
                p["fraction_of_ideal_speedup"] = p["speedup"] / ideal["ideal_speedup"]
                p["accuracy_minus_static"] = p["final_accuracy"] - pol["static"]["final_accuracy"]
        best = min((k for k in pol if k != "static"), key=lambda k: pol[k]["steady_epoch_s"],
                   default="static")
        out["best_policy"] = best
        out["gap_to_ideal"] = gap_to_ideal(pol[best], ideal)
        # Per round, which of dbs and affine was faster: a median can hide a split.
        if "dbs" in runs and "affine" in runs:
            out["affine_faster_rounds"] = sum(
                a["steady_epoch_s"] <= d["steady_epoch_s"]
                for a, d in zip(runs["affine"], runs["dbs"], strict=True))
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def gap_to_ideal(policy: dict[str, Any], ideal: dict[str, Any]) -> dict[str, float]:
    """Where a policy's steady epoch loses to the ideal, seconds per epoch (medians over its
    runs): the evaluation on the critical path and the coordinator's share (neither is in
    the ideal), and the rest of the step time beyond T* + A (imbalance and noise,
    ``steps_above_ideal_s``; the all-reduce after compute is reported beside it)."""
    rs = policy["runs"]
    gap = policy["steady_epoch_s"] - ideal["ideal_epoch_s"]

    def med(key: str) -> float:
        return statistics.median(r["breakdown_epoch_s"][key] for r in rs)

    evaluation, coordinator = med("evaluation_s"), med("coordinator_s")
    return {"gap_s": gap, "evaluation_s": evaluation, "coordinator_s": coordinator,
            "steps_above_ideal_s": gap - evaluation - coordinator,
            "allreduce_wait_s": med("allreduce_wait_s"), "overlap_s": med("overlap_s"),
            "ideal_allreduce_epoch_s": ideal["ideal_epoch_s"] - ideal["bound_epoch_s"],
            "fraction_of_ideal_without_evaluation": ideal["ideal_epoch_s"] / (
                policy["steady_epoch_s"] - evaluation)}


def _n_train(args: argparse.Namespace) -> int:
    spec = make_spec([1.0], "static", args)
    return len(load_dataset(spec.dataset, seed=spec.seed).y_train)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="a,b")
    ap.add_argument("--policies", default="static,dbs,affine")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="Rounds of every policy (medians).")
    ap.add_argument("--mnist", default=None, help="Directory of real MNIST IDX files.")
    ap.add_argument("--n-train", type=int, default=12000)
    ap.add_argument("--n-test", type=int, default=2000)
    ap.add_argument("--out", default=None, help="Also write the JSON here (Ray may print to "
                    "stdout when nodes go down).")
    args = ap.parse_args()
    result = {"workload": "lenet on 28x28 MNIST-format, global batch 256",
              "command": " ".join(sys.argv),
              "data": args.mnist or f"generated MNIST-format ({args.n_train} train)",
              "epochs": args.epochs, "clusters": {}}
    for name in args.clusters.split(","):
        result["clusters"][name] = bench_cluster(name, args)
    emit(result, args.out, indent=2)


if __name__ == "__main__":
    main()

"""Heterogeneous-cluster benchmark: static vs DBS vs affine on a compute-dominated workload.

A LeNet-style CNN on 28x28 MNIST-format images (real files with --mnist DIR, generated
ones otherwise), global batch 256, on ``ray.cluster_utils`` clusters whose nodes are made
unequal by emulated slowdowns (the report says so):

  (a) 2 workers at slowdowns 1 and 3 (fits a 2-core machine)
  (b) 4 workers at slowdowns 1, 1, 2 and 4

Every policy runs the same seed for the same number of epochs. The ideal is measured in
the same run: each worker's step time at several batch sizes, profiled side by side on
the wall clock (as they run), is fitted with t_i(b) = a_i + c_i·b, the equal-finish
split gives the best step time T*, and the measured all-reduce time is added: ideal
epoch = steps × (T* + allreduce). The ideal speedup is the static split's step time under
the same fits over the ideal one.

Prints one JSON object. Usage: python bench/hetero.py [--clusters a,b] [--epochs 6]
"""

from __future__ import annotations

import argparse
import json
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
from ray.cluster_utils import Cluster

from actors.spec import JobSpec
from actors.workloads.datasets import load_dataset
from scheduler.coordinator import Coordinator
from scheduler.model import StepTimeStats, equal_finish, fit
from scheduler.pool import eligible_nodes, spawn_worker
from service.raycluster import fast_health_check

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
    }


def measure_ideal(spec: JobSpec, n_train: int) -> dict[str, Any]:
    """Solo step-time fits per worker plus the all-reduce: the best achievable epoch."""
    ds = load_dataset(spec.dataset, seed=spec.seed)
    data = {"x_train": ray.put(ds.x_train), "y_train": ray.put(ds.y_train),
            "input_shape": tuple(ds.input_shape), "num_classes": ds.num_classes}
    nodes = eligible_nodes(spec)
    workers = [spawn_worker(spec, f"w{i}", i, nodes[i].node_id, 0.0, data)
               for i in range(spec.initial_workers)]
    rv = ray.get(workers[0].open_store.remote(1, len(workers)))
    ray.get([w.join.remote(rv, r, 0) for r, w in enumerate(workers)])
    allreduce = statistics.median(ray.get([w.time_allreduce.remote(10) for w in workers]))
    # Side by side and on the wall clock, as they run in training: emulated nodes share
    # this machine's cores, and an epoch pays the wall time of the shared machine, so
    # solo profiles (one worker at a time) gave an "ideal" that a policy could beat.
    profiles = ray.get([w.profile.remote(PROFILE_BATCHES, 5, True) for w in workers])
    for w in workers:
        ray.kill(w)
    fits = []
    for prof in profiles:
        stats = StepTimeStats()
        for b, t in prof.items():
            stats = stats.add(float(b), t)
        fits.append(fit(stats))
    a = np.array([f.a for f in fits])
    c = np.array([f.c for f in fits])
    n = len(fits)
    B = spec.global_batch
    _, t_star = equal_finish(a, c, float(B), np.ones(n), np.full(n, float(B)))
    static_b = B / n
    t_static = float(np.max(a + c * static_b))
    steps = -(-n_train // B)
    return {
        "allreduce_s": allreduce,
        "fits": [{"a_s": f.a, "c_s_per_sample": f.c} for f in fits],
        "solo_step_s": [{str(b): round(t, 5) for b, t in p.items()} for p in profiles],
        "ideal_step_s": t_star + allreduce,
        "ideal_epoch_s": steps * (t_star + allreduce),
        "static_model_epoch_s": steps * (t_static + allreduce),
        "ideal_speedup": (t_static + allreduce) / (t_star + allreduce),
    }


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
        out: dict[str, Any] = {"slowdowns": slowdowns, "emulated": True, "policies": {}}
        for policy in args.policies.split(","):
            out["policies"][policy] = run_policy(make_spec(slowdowns, policy, args))
            print(f"[{name}] {policy}: {out['policies'][policy]['steady_epoch_s']:.2f}s/epoch",
                  file=sys.stderr)
        ideal = measure_ideal(make_spec(slowdowns, "static", args), _n_train(args))
        out["ideal"] = ideal
        pol = out["policies"]
        if "static" in pol:
            base = pol["static"]["steady_epoch_s"]
            for p in pol.values():
                p["speedup"] = base / p["steady_epoch_s"]
                p["fraction_of_ideal_speedup"] = p["speedup"] / ideal["ideal_speedup"]
                p["accuracy_minus_static"] = (p["final_accuracy"] or 0) - (
                    pol["static"]["final_accuracy"] or 0)
            best = max((k for k in pol if k != "static"), key=lambda k: pol[k]["speedup"],
                       default="static")
            out["best_policy"] = best
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def _n_train(args: argparse.Namespace) -> int:
    spec = make_spec([1.0], "static", args)
    return len(load_dataset(spec.dataset, seed=spec.seed).y_train)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="a,b")
    ap.add_argument("--policies", default="static,dbs,affine")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mnist", default=None, help="Directory of real MNIST IDX files.")
    ap.add_argument("--n-train", type=int, default=12000)
    ap.add_argument("--n-test", type=int, default=2000)
    ap.add_argument("--out", default=None, help="Also write the JSON here (Ray may print to "
                    "stdout when nodes go down).")
    args = ap.parse_args()
    result = {"workload": "lenet on 28x28 MNIST-format, global batch 256",
              "data": args.mnist or f"generated MNIST-format ({args.n_train} train)",
              "epochs": args.epochs, "clusters": {}}
    for name in args.clusters.split(","):
        result["clusters"][name] = bench_cluster(name, args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

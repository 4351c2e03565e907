"""Equal workers under the default policy: do their shares stay equal on real Ray?

Two equal one-CPU ``cluster_utils`` nodes train digits with a 32-wide MLP at global batch
64: 1-3 ms a step, mostly a fixed per-step cost, and on shared cores each step takes
0.5-2x its time. Before issue 29, DBS (the default policy) moved the split on that noise
(51/13 of 64 in a newcomer's run). Compared side by side, interleaved, ``--repeats``
times each, for ``rebalance: epoch`` and ``rebalance: adaptive`` (check every 2 steps):

* ``dbs``: the default, noise-aware (``DBSPolicy.z`` = 3);
* ``dbs_z0``: the same with ``z = 0``, every measured difference moving the split (the
  paper's rule, as before issue 29).

Every plan counts: those the epochs report and those the rebalance lines log. A run's
``max_deviation`` is the largest ``|b - 32| / 32`` over them; the target is <= 0.10.

This is a measurement, not a test: a worker whose process the OS holds back for a few
steps is, for those steps, a slower worker, and the policy is right to move its share.
The deterministic checks are the simulator's and the pure model's property tests
(``tests/unit/test_disturbance_response.py``, ``tests/unit/test_simulator.py``).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.sync.coordinator import Coordinator
from dynabatch.service.raycluster import fast_health_check
from ray.cluster_utils import Cluster

from bench.report import emit

GLOBAL_BATCH = 64
TARGET = 0.10
_BATCHES = re.compile(r"batches \{([^}]*)\}")


def spec_for(mode: str, epochs: int) -> JobSpec:
    rebalance = {"mode": mode} if mode == "epoch" else {"mode": mode, "check_steps": 2}
    return JobSpec.model_validate({
        "name": f"equal-{mode}", "dataset": {"name": "digits"},
        "model": {"name": "mlp", "hidden": 32},
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "workers": 2, "global_batch": GLOBAL_BATCH, "epochs": epochs, "seed": 3,
        "node_resource": "equal_node", "collective_timeout_s": 30, "rebalance": rebalance})


def run(mode: str, z: float | None, epochs: int) -> dict[str, Any]:
    coord = Coordinator(f"equal-{mode}", spec_for(mode, epochs), resume=False)
    assert coord.epochs.policy.name == "dbs"  # the default
    if z is not None:
        coord.epochs.policy = dataclasses.replace(coord.epochs.policy, z=z)
    snap = coord.run()
    if snap.state.value != "SUCCEEDED":
        raise RuntimeError(f"{mode}: {snap.state.value}: {snap.reason}")
    history = coord.history()
    plans = [[w.batch for w in rec.workers] for rec in history]
    # Were the workers equal? Each epoch's faster worker's samples per compute-second over
    # the slower one's: a split that follows a real, lasting difference is right to move.
    speed_ratios = [round(max(t) / min(t), 3) for rec in history
                    if min(t := [w.throughput for w in rec.workers]) > 0]
    for line in coord.logs():
        m = _BATCHES.search(line.message) if "rebalance" in line.message else None
        if m:
            plans.append([int(x.split(":")[1]) for x in m.group(1).split(",")])
    equal = GLOBAL_BATCH / 2
    deviations = [abs(b - equal) / equal for plan in plans for b in plan]
    return {"max_deviation": round(max(deviations), 3),
            "within_target": max(deviations) <= TARGET,
            "plans": plans, "speed_ratio_per_epoch": speed_ratios,
            "rebalances": snap.rebalances_total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="Also write the JSON here.")
    args = ap.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 150 * 2**20, "_system_config": fast_health_check()})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"equal_node": 1},
                         object_store_memory=100 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="dynabatch-bench", log_to_driver=False)
    variants = [(f"{mode}_{name}", mode, z) for mode in ("epoch", "adaptive")
                for name, z in (("dbs", None), ("dbs_z0", 0.0))]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in variants}
    try:
        for r in range(args.repeats):
            for name, mode, z in variants:
                runs[name].append(run(mode, z, args.epochs))
                print(f"[round {r}] {name}: max deviation {runs[name][-1]['max_deviation']}",
                      file=sys.stderr)
    finally:
        ray.shutdown()
        cluster.shutdown()
    out: dict[str, Any] = {
        "workload": f"digits, MLP hidden 32, 2 equal one-CPU nodes, global batch {GLOBAL_BATCH}",
        "target": f"every plan within +-{TARGET:.0%} of equal shares",
        "repeats": args.repeats, "command": " ".join(sys.argv)}
    for name, rs in runs.items():
        out[name] = {
            "median_max_deviation": statistics.median(r["max_deviation"] for r in rs),
            "runs_within_target": sum(r["within_target"] for r in rs),
            "runs": rs,
        }
    emit(out, args.out, indent=2)


if __name__ == "__main__":
    main()

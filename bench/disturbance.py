"""Disturbance benchmark: one of 4 workers slows down 4x in the middle of an epoch.

Workload of bench/hetero.py (LeNet, 28x28 MNIST-format images, global batch 256) on a
``ray.cluster_utils`` cluster of 4 equal nodes (emulated slowdowns; the report says so).
From epoch 1, step ``--at``, worker 3 runs 4x slower. Compared:

* ``affine`` + ``rebalance: adaptive`` (check every 2 steps, re-plan the rest of the epoch
  when the predicted step-time gain exceeds 5%);
* ``dbs`` + ``rebalance: epoch`` (the paper's per-epoch re-sizing).

Per-step compute balance = mean / max of the workers' compute time in that step. "Steps to
recover" counts steps from the disturbance until balance is back to >= 0.85 and stays there
for 3 steps; "first back" counts steps until it is first >= 0.85 again. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
from ray.cluster_utils import Cluster

from actors.spec import JobSpec
from scheduler.coordinator import Coordinator
from service.raycluster import fast_health_check

TARGET = 0.85
HOLD = 3


def spec_for(policy: str, mode: str, args: argparse.Namespace) -> JobSpec:
    return JobSpec.model_validate({
        "name": f"disturb-{policy}-{mode}",
        "dataset": {"name": "mnist", "options": {"n_train": args.n_train, "n_test": 1000}},
        "model": {"name": "lenet"}, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "workers": 4, "global_batch": 256, "epochs": args.epochs, "policy": policy,
        "rebalance": {"mode": mode, "check_steps": 2, "threshold": 0.05},
        "seed": 0, "node_resource": "disturb_node", "collective_timeout_s": 120,
        "emulation": {"slowdowns": [1, 1, 1, 1],
                      "disturbances": [{"worker": 3, "factor": 4.0, "epoch": 1,
                                        "step": args.at}]},
    })


def run(policy: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    coord = Coordinator(f"disturb-{policy}", spec_for(policy, mode, args), resume=False)
    snap = coord.run()
    if snap.state.value != "SUCCEEDED":
        raise RuntimeError(f"{policy}/{mode}: {snap.state.value}: {snap.reason}")
    steps = [row for row in coord.recent_steps() if row]
    per_step = []
    for row in steps:
        times = [s.compute_s for s in row]
        per_step.append({"epoch": row[0].epoch, "step": row[0].step,
                         "balance": statistics.mean(times) / max(times),
                         "batches": {s.worker: s.batch for s in row}})
    start = next(i for i, r in enumerate(per_step) if r["epoch"] == 1 and r["step"] >= args.at)
    recover = None
    for i in range(start, len(per_step) - HOLD + 1):
        if all(r["balance"] >= TARGET for r in per_step[i:i + HOLD]):
            recover = i - start
            break
    first = next((i - start for i in range(start, len(per_step))
                  if per_step[i]["balance"] >= TARGET), None)
    window = [r["balance"] for r in per_step[start + 5:start + 21]]
    before = [r["balance"] for r in per_step[max(0, start - 5):start]]
    hist = coord.history()
    return {
        "steps_to_first_back_at_target": first,
        "steps_to_recover": recover,
        "recovered_within_10_steps": recover is not None and recover <= 10,
        "median_balance_steps_5_to_20_after": statistics.median(window) if window else None,
        "balance_before": statistics.mean(before) if before else None,
        "balance_at_disturbance": per_step[start]["balance"],
        "balance_after_recovery": statistics.mean(
            r["balance"] for r in per_step[start + (recover or 0):][:20]),
        "epoch_s": [round(r.wall_s, 3) for r in hist],
        "rebalances": snap.rebalances_total,
        "final_accuracy": hist[-1].test_accuracy,
        "per_step_balance": [round(r["balance"], 3) for r in per_step[start - 3:start + 25]],
        "steps_per_epoch": hist[0].steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--at", type=int, default=10, help="Step of epoch 1 where it slows down.")
    ap.add_argument("--n-train", type=int, default=8192)
    ap.add_argument("--out", default=None, help="Also write the JSON here.")
    args = ap.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 200 * 2**20, "_system_config": fast_health_check()})
    for i in range(4):
        cluster.add_node(num_cpus=1, resources={"disturb_node": 1, f"d{i}": 1},
                         object_store_memory=150 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="dynabatch-bench", log_to_driver=False)
    try:
        out = {"workload": "lenet, MNIST-format 28x28, global batch 256, 4 workers",
               "emulated": True, "disturbance": f"worker 3 slows 4x at epoch 1 step {args.at}",
               "target": f"per-step balance >= {TARGET} for {HOLD} steps",
               "adaptive_affine": run("affine", "adaptive", args),
               "epoch_dbs": run("dbs", "epoch", args)}
    finally:
        ray.shutdown()
        cluster.shutdown()
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

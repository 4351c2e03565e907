"""Disturbance benchmark: one of 4 workers slows down 4x in the middle of an epoch.

Workload of bench/hetero.py (LeNet, 28x28 MNIST-format images, global batch 256) on a
``ray.cluster_utils`` cluster of 4 equal nodes (emulated slowdowns; the report says so).
From epoch 1, step ``--at``, worker 3 runs 4x slower. Compared, ``--repeats`` times each,
interleaved, with medians:

* ``affine`` and ``dbs``, both with ``rebalance: adaptive`` (check every 2 steps, re-plan
  the rest of the epoch when the predicted step-time gain exceeds 5%): the same trigger, so
  the policies are compared like for like;
* ``dbs`` + ``rebalance: epoch`` (the paper's per-epoch re-sizing), for reference;
* ``--variants`` picks others, e.g. ``affine:adaptive:1`` (check every step), or
  ``affine:adaptive:2:no_updates`` (the driver without plan updates: a re-plan waits for
  the segment in flight, as before issue 23), or ``dbs:adaptive:2:picard`` (dbs without its
  secant step: the paper's proportional correction alone).

Two measures of recovery, in steps after the disturbance:

* ``steps_to_reallocate``: until the slowed worker's batch is within 15% of the batch the
  policy settles on for it (the median of its last 10 steps) and stays there for 3 steps.
  This is the policy's own reaction; 4 workers share 2 cores here, so per-step compute
  times are noisy even when nothing is disturbed.
* ``steps_to_recover``: until the per-step compute balance (mean / max of the workers'
  compute time) is back to >= 0.85 for 3 steps; ``steps_to_first_back_at_target`` until it
  is first >= 0.85 again.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from collections import deque
from collections.abc import Iterable
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
from bench.runtime_watch import count_segments, watch_steps

TARGET = 0.85
HOLD = 3


def spec_for(policy: str, mode: str, check: int, args: argparse.Namespace) -> JobSpec:
    return JobSpec.model_validate({
        "name": f"disturb-{policy}-{mode}",
        "dataset": {"name": "mnist", "options": {"n_train": args.n_train, "n_test": 1000}},
        "model": {"name": "lenet"}, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "workers": 4, "global_batch": 256, "epochs": args.epochs, "policy": policy,
        "rebalance": {"mode": mode, "check_steps": check, "threshold": 0.05},
        "seed": 0, "node_resource": "disturb_node", "collective_timeout_s": 120,
        "emulation": {"slowdowns": [1, 1, 1, 1],
                      "disturbances": [{"worker": 3, "factor": 4.0, "epoch": 1,
                                        "step": args.at}]},
    })


def _first_held(per_step: list[dict[str, Any]], start: int, ok: Any) -> int | None:
    """Steps from ``start`` until ``ok`` holds for HOLD steps in a row (None: never)."""
    for i in range(start, len(per_step) - HOLD + 1):
        if all(ok(r) for r in per_step[i:i + HOLD]):
            return i - start
    return None


def per_step_balance(reports: Iterable[list[Any]]) -> list[dict[str, Any]]:
    """One row per committed step (the reports ``runtime_watch.watch_steps`` passes, one per
    worker): its epoch, step, compute balance (mean / max of the workers' compute times) and
    the workers' batches."""
    rows = []
    for row in reports:
        if not row:
            continue
        times = [s.compute_s for s in row]
        rows.append({"epoch": row[0].epoch, "step": row[0].step,
                     "balance": statistics.mean(times) / max(times),
                     "batches": {s.worker: s.batch for s in row}})
    return rows


def disturbance_start(per_step: list[dict[str, Any]], at: int, epoch: int = 1) -> int:
    """The index of the first step at or after the disturbance (``epoch``, step ``at``)."""
    return next(i for i, r in enumerate(per_step) if r["epoch"] == epoch and r["step"] >= at)


def steps_to_recover(per_step: list[dict[str, Any]], start: int) -> int | None:
    """Steps from ``start`` until the per-step balance is >= TARGET for HOLD steps in a row
    (None: never)."""
    return _first_held(per_step, start, lambda r: r["balance"] >= TARGET)


def run(policy: str, mode: str, check: int, args: argparse.Namespace,
        updates: bool = True, picard: bool = False) -> dict[str, Any]:
    coord = Coordinator(f"disturb-{policy}", spec_for(policy, mode, check, args),
                        resume=False)
    if picard:  # dbs without its secant step: the paper's proportional correction alone
        coord.epochs.policy = dataclasses.replace(coord.epochs.policy, secant=False)
    if not updates:  # the driver as before plan updates: a re-plan waits for the segment ahead
        # (every update refused: the allocation is deferred to the step after that segment)
        coord.runtime.update_segment = lambda update, timeout_s: False
    recent: deque[list] = deque(maxlen=512)  # the last steps' reports, one per worker
    watch_steps(coord.runtime, recent.append)
    counts = count_segments(coord.runtime)
    snap = coord.run()
    if snap.state.value != "SUCCEEDED":
        raise RuntimeError(f"{policy}/{mode}: {snap.state.value}: {snap.reason}")
    per_step = per_step_balance(recent)
    start = disturbance_start(per_step, args.at)
    recover = steps_to_recover(per_step, start)
    first = next((i - start for i in range(start, len(per_step))
                  if per_step[i]["balance"] >= TARGET), None)
    slowed = per_step[start]["batches"]
    victim = sorted(slowed)[3]  # ordinal 3: "w3" of w0..w3
    settled = statistics.median(r["batches"].get(victim, 0) for r in per_step[-10:])
    reallocate = _first_held(per_step, start, lambda r: abs(
        r["batches"].get(victim, 0) - settled) <= 0.15 * settled)
    window = [r["balance"] for r in per_step[start + 5:start + 21]]
    before = [r["balance"] for r in per_step[max(0, start - 5):start]]
    hist = coord.history()
    return {
        "steps_to_reallocate": reallocate,
        "victim_batch_before": slowed.get(victim),
        "victim_batch_settled": settled,
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
        "plan_updates": counts.updates_applied,
        "plan_updates_refused": counts.updates_refused,
        "final_accuracy": hist[-1].test_accuracy,
        "per_step_balance": [round(r["balance"], 3) for r in per_step[start - 3:start + 25]],
        "per_step_victim_batch": [r["batches"].get(victim) for r in per_step[start - 3:start + 25]],
        "steps_per_epoch": hist[0].steps,
    }


def _median_or_none(values: list[Any]) -> float | None:
    """Median, a run that never recovered counting as infinitely slow (None if that is
    where the median falls)."""
    m = statistics.median(float("inf") if v is None else v for v in values)
    return None if m == float("inf") else m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--at", type=int, default=10, help="Step of epoch 1 where it slows down.")
    ap.add_argument("--n-train", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3, help="Runs of each variant (medians).")
    ap.add_argument("--variants", default="affine:adaptive:2,dbs:adaptive:2,dbs:epoch:2",
                    help="policy:rebalance mode:check_steps, comma-separated; a variant "
                    "named mode_policy (plus _checkN when check_steps is not 2)")
    ap.add_argument("--out", default=None, help="Also write the JSON here.")
    args = ap.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 200 * 2**20, "_system_config": fast_health_check()})
    for i in range(4):
        cluster.add_node(num_cpus=1, resources={"disturb_node": 1, f"d{i}": 1},
                         object_store_memory=150 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="dynabatch-bench", log_to_driver=False)
    variants = []
    for v in args.variants.split(","):
        policy, mode, check, *rest = v.split(":")
        name = f"{mode}_{policy}" + ("" if int(check) == 2 else f"_check{check}")
        name += "_no_updates" if "no_updates" in rest else ""
        name += "_picard" if "picard" in rest else ""
        variants.append((name, policy, mode, int(check), "no_updates" not in rest,
                         "picard" in rest))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in variants}
    try:
        for r in range(args.repeats):
            for name, policy, mode, check, updates, picard in variants:
                runs[name].append(run(policy, mode, check, args, updates, picard))
                print(f"[round {r}] {name}: recovered in {runs[name][-1]['steps_to_recover']}"
                      " steps", file=sys.stderr)
        out: dict[str, Any] = {
            "workload": "lenet, MNIST-format 28x28, global batch 256, 4 workers",
            "emulated": True, "disturbance": f"worker 3 slows 4x at epoch 1 step {args.at}",
            "target": "recovery within 5 steps",
            "balance_target": f"per-step balance >= {TARGET} for {HOLD} steps",
            "repeats": args.repeats, "command": " ".join(sys.argv)}
        for key, rs in runs.items():
            out[key] = {
                "median_steps_to_reallocate": _median_or_none(
                    [r["steps_to_reallocate"] for r in rs]),
                "median_steps_to_recover": _median_or_none([r["steps_to_recover"] for r in rs]),
                "median_balance_steps_5_to_20_after": _median_or_none(
                    [r["median_balance_steps_5_to_20_after"] for r in rs]),
                "median_epoch_s": statistics.median(statistics.mean(r["epoch_s"][1:])
                                                    for r in rs),
                # From epoch 2: the slowdown in force throughout, re-balanced (steady).
                "median_steady_epoch_s": statistics.median(
                    statistics.mean(r["epoch_s"][2:] or r["epoch_s"][1:]) for r in rs),
                "plan_updates": [r["plan_updates"] for r in rs],
                "plan_updates_refused": [r["plan_updates_refused"] for r in rs],
                "runs": rs,
            }
    finally:
        ray.shutdown()
        cluster.shutdown()
    emit(out, args.out, indent=2)


if __name__ == "__main__":
    main()

"""How long one policy decision takes at 10, 1,000 and 10,000 workers.

Realistic telemetry: every worker has a hidden step-time model t_i(b) = a_i + c_i·b
(heterogeneous speeds, a few stragglers, some with a memory cap), decayed statistics at two
batch sizes, and a DBS window of samples / compute seconds. Global batch = 10·n, dataset =
100 · global batch. Two scenarios per policy:

* ``fresh``: no current allocation (first plan, or a change of membership);
* ``replan``: the current allocation is the equal split of the same members (the usual
  control-loop call; affine runs its hysteresis check, static keeps the plan).

Prints ONE JSON object: per policy and worker count, the median (and the fastest) wall time
in milliseconds of ``decide()`` over several runs, plus the worst median at the largest size
against the 10 ms target. The fastest run is reported because on a shared machine the
median also measures the neighbours. Pure CPU; no Ray.

    .venv/bin/python bench/policy_scale.py [--repeats 9] [--sizes 10,1000,10000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynabatch.scheduler.core.sync.allocation import Allocation, WorkerTelemetry, make_allocation
from dynabatch.scheduler.core.sync.policy import policy_for
from dynabatch.scheduler.core.sync.steptime import StepTimeStats

POLICIES = ("static", "dbs", "affine")
TARGET_MS = 10.0


def make_telemetry(n: int, seed: int = 0) -> list[WorkerTelemetry]:
    rng = np.random.default_rng(seed)
    global_batch = 10 * n
    speed = rng.lognormal(0.0, 0.5, n)  # relative speed per worker
    speed[rng.random(n) < 0.05] /= 4.0  # stragglers
    c = 1e-3 / speed
    a = 0.01 * rng.uniform(0.5, 1.5, n)
    b0 = global_batch // n
    out = []
    for i in range(n):
        st = StepTimeStats()
        for b in (b0, 2 * b0):
            for _ in range(3):
                t = (a[i] + c[i] * b) * (1.0 + 0.02 * rng.standard_normal())
                st = st.add(float(b), float(t), decay=0.9)
        steps = 50
        out.append(
            WorkerTelemetry(
                worker=f"w{i:05d}",
                batch=b0,
                samples=steps * b0,
                compute_s=steps * (a[i] + c[i] * b0),
                cap=int(4 * b0) if i % 10 == 0 else None,
                capacity=float(rng.integers(1, 9)),
                stats=st,
            )
        )
    return out


def equal_current(telemetry: list[WorkerTelemetry], global_batch: int, dataset: int) -> Allocation:
    n = len(telemetry)
    b = np.full(n, global_batch // n, dtype=np.int64)
    b[: global_batch - int(b.sum())] += 1
    return make_allocation([t.worker for t in telemetry], b, global_batch, dataset)


def time_decide(policy, telemetry, global_batch, dataset, current, repeats: int):
    """(median, min) wall time of decide() in ms, after one warm-up call."""
    policy.decide(telemetry, global_batch, dataset, current)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        policy.decide(telemetry, global_batch, dataset, current)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3), round(min(times) * 1e3, 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--sizes", default="10,1000,10000")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    results: dict[str, dict[str, dict[str, float]]] = {name: {} for name in POLICIES}
    for n in sizes:
        telemetry = make_telemetry(n)
        global_batch = 10 * n
        dataset = 100 * global_batch
        current = equal_current(telemetry, global_batch, dataset)
        for name in POLICIES:
            policy = policy_for(name)
            fresh = time_decide(policy, telemetry, global_batch, dataset, None, args.repeats)
            replan = time_decide(policy, telemetry, global_batch, dataset, current, args.repeats)
            results[name][str(n)] = {
                "fresh_ms": fresh[0],
                "replan_ms": replan[0],
                "fresh_min_ms": fresh[1],
                "replan_min_ms": replan[1],
            }
    largest = str(max(sizes))
    worst = max(max(r[largest]["fresh_ms"], r[largest]["replan_ms"]) for r in results.values())
    print(
        json.dumps(
            {
                "unit": "ms: *_ms = median, *_min_ms = fastest of the runs of decide()",
                "repeats": args.repeats,
                "global_batch": "10*n",
                "dataset": "100*global_batch",
                "results": results,
                "worst_at_largest_ms": round(worst, 3),
                "largest_workers": int(largest),
                "target_ms": TARGET_MS,
                "within_target": worst < TARGET_MS,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

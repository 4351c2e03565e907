"""Goodput mode (Pollux/AdaScale) against the best fixed global batch: time to a target.

LeNet on digits on 3 unequal nodes. ``goodput`` starts at B_0 = 32 (LR 0.02, momentum 0.9)
and picks each epoch's batch in [32, 512] from the gradient noise scale it estimates from
the workers' unequal local batches, with the AdaScale LR gain. The fixed runs train at
B ∈ {32, 64, 128, 256, 512} with the LR scaled by √(B/32) (a safe rule without a noise
estimate). Time to target is simulated seconds until the first epoch at or above the target
accuracy; the best fixed B is the one that gets there first. Mean over ``--seeds``.

    PYTHONPATH=. .venv/bin/python bench/goodput.py [--seeds 2] [--target 0.95]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sched_common import MODE, job, run, time_to

B0, LR, TOP = 32, 0.02, 512
FIXED = (32, 64, 128, 256, 512)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--target", type=float, default=0.95)
    args = ap.parse_args()
    runs: dict[str, Any] = {}

    def measure(name: str, make) -> None:
        t0 = time.perf_counter()
        times, evals, batches = [], [], []
        for seed in range(args.seeds):
            res = run(make(seed))
            t, g = time_to(res, args.target)
            times.append(t)
            evals.append(g)
            batches.append([r.global_batch for r in res.history])
            if name == "goodput":
                runs.setdefault("goodput_noise_scale", []).append(
                    [round(r.noise_scale, 1) if r.noise_scale else None for r in res.history])
        ok = [t for t in times if t is not None]
        runs[name] = {"time_to_target_s": [None if t is None else round(t, 3) for t in times],
                      "mean_time_s": round(statistics.mean(ok), 3) if len(ok) == len(times)
                      else None, "grad_evals_to_target": evals,
                      "batches": batches[0]}
        print(f"{name}: {runs[name]} ({time.perf_counter() - t0:.0f}s real)", file=sys.stderr)

    measure("goodput", lambda seed: job(
        name="goodput", epochs=args.epochs, seed=seed, global_batch=B0,
        optimizer={"name": "sgd", "lr": LR, "momentum": 0.9},
        schedule={"mode": "goodput", "max_global_batch": TOP}))
    for b in FIXED:
        measure(f"fixed_{b}", lambda seed, b=b: job(
            name=f"fixed-{b}", epochs=args.epochs, seed=seed, global_batch=b,
            optimizer={"name": "sgd", "lr": LR * math.sqrt(b / B0), "momentum": 0.9}))
    fixed = {k: v["mean_time_s"] for k, v in runs.items()
             if k.startswith("fixed_") and v["mean_time_s"] is not None}
    best = min(fixed, key=fixed.get) if fixed else None
    g = runs["goodput"]["mean_time_s"]
    print(json.dumps({
        "target_accuracy": args.target, "runs": runs, "best_fixed": best,
        "goodput_over_best_fixed_time": round(g / fixed[best], 3) if g and best else None,
        "mode": MODE, "seeds": args.seeds}, indent=1))


if __name__ == "__main__":
    main()

"""Goodput mode (Pollux/AdaScale) against the best fixed global batch: time to a target.

LeNet on MNIST-format data (12,000 generated training images, 2,000 test) on 8 unequal
simulated nodes (per-sample cost 0.05 to 0.2 ms, a fixed 4 ms per step on each) whose ring
all-reduce costs about 15 ms a step, so a large batch pays in throughput: B = 512 is 23 steps
an epoch and about 13x the samples per second of B = 32.

Every arm uses the same learning-rate rule, AdaScale's gain r(B) relative to B_0 = 32 at
``--lr`` (SGD, momentum 0.9), from the gradient noise the run itself measures (the gain is 1
until the first epoch's estimate): ``goodput`` picks each epoch's B in [32, 512]; each
``fixed_B`` arm pins B (goodput mode with ``min_global_batch = max_global_batch = B``), so
the only difference is the batch. Evaluations every ``--eval-every`` steps; time to target is
the simulated training seconds until the first evaluation at or above ``--target`` (a run
stops there; ``batches`` lists the epochs completed by then, ``next_batch_chosen`` each
epoch's decision for the next). Per seed and median over ``--seeds``; the best fixed B is
the one with the lowest median (a seed that never gets there counts as infinitely slow).

    PYTHONPATH=. .venv/bin/python bench/goodput.py [--seeds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sched_common import MODE, dataset, job, median, pin_threads, run

B0, TOP = 32, 512
FIXED = (32, 64, 128, 256, 512)
CLUSTER = {
    "classes": [
        {"name": "fast", "count": 4, "a_ms": 4, "c_ms_per_sample": 0.05},
        {"name": "mid", "count": 2, "a_ms": 4, "c_ms_per_sample": 0.1},
        {"name": "slow", "count": 2, "a_ms": 4, "c_ms_per_sample": 0.2},
    ],
    "noise_sigma": 0.05,
    "allreduce": {"alpha_ms": 1.0, "beta_ms_per_mb": 2.0},
}


def _spec(args, seed: int, lo: int, hi: int):
    return job(name=f"goodput-{lo}-{hi}", epochs=args.epochs, seed=seed, global_batch=B0,
               workers=8, dataset=dataset(args.mnist),
               optimizer={"name": "sgd", "lr": args.lr, "momentum": 0.9},
               schedule={"mode": "goodput", "min_global_batch": lo, "max_global_batch": hi})


def _arm(args, lo: int, hi: int) -> dict[str, Any]:
    times, evals, batches, chosen, noise, finals = [], [], [], [], [], []
    for seed in range(args.seeds):
        res, curve = run(_spec(args, seed, lo, hi), CLUSTER, eval_every=args.eval_every,
                         stop_at=args.target)
        t, g, _ = curve.time_to(args.target)
        times.append(None if t is None else round(t, 3))
        evals.append(g)
        batches.append([r.global_batch for r in res.history])
        chosen.append([r.goodput_batch for r in res.history])
        noise.append([None if r.noise_scale is None else round(r.noise_scale, 1)
                      for r in res.history])
        finals.append(round(curve.points[-1][3], 4))
    m = median(times)
    return {"time_to_target_s": times, "median_time_s": None if m is None else round(m, 3),
            "grad_evals_to_target": evals, "batches": batches,
            "next_batch_chosen": chosen, "noise_scale": noise,
            "last_accuracy": finals}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--eval-every", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mnist", default=None, help="directory of real MNIST IDX files")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    threads = pin_threads(args.threads)
    runs: dict[str, Any] = {}
    for name, lo, hi in [("goodput", B0, TOP), *((f"fixed_{b}", b, b) for b in FIXED)]:
        t0 = time.perf_counter()
        runs[name] = _arm(args, lo, hi)
        print(f"{name}: {runs[name]['time_to_target_s']} ({time.perf_counter() - t0:.0f}s "
              "real)", file=sys.stderr)
    fixed = {k: v["median_time_s"] for k, v in runs.items()
             if k.startswith("fixed_") and v["median_time_s"] is not None}
    best = min(fixed, key=fixed.get) if fixed else None
    g = runs["goodput"]
    ratios = None
    if best is not None:
        ratios = [None if a is None or b is None else round(a / b, 3)
                  for a, b in zip(g["time_to_target_s"], runs[best]["time_to_target_s"],
                                  strict=True)]
    out = {
        "target_accuracy": args.target, "b0": B0, "max_batch": TOP, "lr0": args.lr,
        "lr_rule": "AdaScale gain r(B) relative to B_0 from the run's own noise estimate, in "
                   "every arm",
        "runs": runs, "best_fixed": best,
        "goodput_over_best_fixed_median_time": (
            round(g["median_time_s"] / fixed[best], 3)
            if best is not None and g["median_time_s"] is not None else None),
        "per_seed_ratio_vs_best_fixed": ratios,
        "cluster": CLUSTER, "eval_every_steps": args.eval_every, "epochs_max": args.epochs,
        "mode": MODE, "seeds": args.seeds, "torch_threads": threads,
    }
    text = json.dumps(out, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

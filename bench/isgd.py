"""ISGD against SGD (Wang et al., arXiv 1603.05544): time and gradient evaluations to a
target accuracy, same learning rate and batch cycle, paired over 5 seeds.

The paper's set-up, scaled down: LeNet on MNIST-format data (12,000 generated training
images, 2,000 test), global batch 100 on 3 unequal nodes, SGD with momentum 0.9 at a
learning rate that trains without a plateau (0.05: ~0.85 accuracy after one epoch). The
sample order is drawn *once* (``dataset.shuffle: once``), so the same 120 batches recur in
a fixed cycle, as in the paper's Caffe data layers, and ISGD's FIFO spans one cycle
(``isgd.window: epoch``, n_b = 120), 3σ, ζ = ``--max-extra`` extra iterations, ε = 0.1,
monitoring from the second epoch. Both arms of a seed are the same job but for ``isgd``.

Time to target: the model is evaluated every ``--eval-every`` steps (the simulator's
evaluation costs no simulated time); time is the simulated training seconds (ISGD's extra
passes and loss all-reduces charged) until the first evaluation at or above ``--target``,
which lies in the slow late phase of training; gradient evaluations are the per-sample
gradients computed until then. ``ratio_per_seed`` is ISGD's time over SGD's on the same
seed. ``flagged_share``: the share of monitored batches flagged. Target: ISGD's median time
≤ 0.8× SGD's (the paper reports 21% faster on AlexNet/ImageNet). ``--variants 1:5,2:5``
adds runs at other control limits σ and budgets ζ.

    PYTHONPATH=. .venv/bin/python bench/isgd.py [--seeds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynabatch.scheduler.sim.cluster_spec import parse_cluster
from dynabatch.scheduler.sim.cost_model import SimulatedCluster

from bench.sched_common import CLUSTER, MODE, dataset, job, median, pin_threads, run

BATCH, LR = 100, 0.05


def _spec(args, seed: int, isgd: bool, max_extra: int, sigma: float):
    return job(name="isgd" if isgd else "sgd", epochs=args.epochs, seed=seed,
               global_batch=BATCH, dataset={**dataset(args.mnist), "shuffle": "once"},
               optimizer={"name": "sgd", "lr": args.lr, "momentum": 0.9},
               isgd={"enabled": isgd, "window": "epoch", "sigma": sigma,
                     "max_extra": max_extra, "epsilon": 0.1})


def _measure(args, isgd: bool, max_extra: int = 5, sigma: float = 3.0) -> dict[str, Any]:
    """Per-seed times and gradient evaluations to target, the share of monitored batches
    flagged, and the extra iterations per flagged batch."""
    times, evals, finals = [], [], []
    flagged = monitored = extra = 0
    for seed in range(args.seeds):
        res, curve = run(_spec(args, seed, isgd, max_extra, sigma), CLUSTER,
                         eval_every=args.eval_every)
        t, g, _ = curve.time_to(args.target)
        times.append(None if t is None else round(t, 3))
        evals.append(g)
        finals.append(round(curve.points[-1][3], 4))
        flagged += sum(r.isgd_flagged for r in res.history)
        extra += sum(r.isgd_extra_iterations for r in res.history)
        monitored += sum(r.steps for r in res.history[1:])
    m = median(times)
    out: dict[str, Any] = {"time_to_target_s": times, "grad_evals_to_target": evals,
                           "median_time_s": None if m is None else round(m, 3),
                           "final_accuracy": finals}
    if isgd:
        out["flagged_share"] = round(flagged / monitored, 4) if monitored else 0.0
        out["extra_per_flagged"] = round(extra / flagged, 2) if flagged else None
    return out


def _paired(sgd: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    ratios = [None if a is None or b is None else round(b / a, 3)
              for a, b in zip(sgd["time_to_target_s"], other["time_to_target_s"], strict=True)]
    ok = [r for r in ratios if r is not None]
    s, o = sgd["median_time_s"], other["median_time_s"]
    return {"ratio_per_seed": ratios,
            "median_ratio": round(statistics.median(ok), 3) if ok else None,
            "over_sgd_median_time": round(o / s, 3) if s and o else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--max-extra", type=int, default=5)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--variants", default="", help="sigma:max_extra pairs, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mnist", default=None, help="directory of real MNIST IDX files")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    threads = pin_threads(args.threads)
    out: dict[str, Any] = {"target_accuracy": args.target}
    for kind in ("sgd", "isgd"):
        t0 = time.perf_counter()
        out[kind] = _measure(args, kind == "isgd", args.max_extra)
        print(f"{kind}: {out[kind]} ({time.perf_counter() - t0:.0f}s real)", file=sys.stderr)
    out["flagged_share"] = out["isgd"]["flagged_share"]
    out.update(_paired(out["sgd"], out["isgd"]))
    m = out["over_sgd_median_time"]
    out["target_met"] = m is not None and m <= 0.8
    variants = {}
    for v in filter(None, args.variants.split(",")):
        sigma, zeta = v.split(":")
        res = _measure(args, True, int(zeta), float(sigma))
        res.update(_paired(out["sgd"], res))
        variants[f"sigma{sigma}_extra{zeta}"] = res
        print(f"variant {v}: {res}", file=sys.stderr)
    if variants:
        out["variants"] = variants
    # What ISGD adds to every step even when it flags nothing: the all-reduce of the batch
    # loss (a separate collective on the workers; charged by the cluster's latency model).
    n = sum(c["count"] for c in CLUSTER["classes"])
    out["loss_allreduce_s_per_step"] = SimulatedCluster(parse_cluster(CLUSTER)).allreduce_s(
        n, 0, 8.0)
    out.update({"batch": BATCH, "lr": args.lr, "momentum": 0.9, "shuffle": "once",
                "window": "epoch (120 batches)", "sigma": 3.0, "max_extra": args.max_extra,
                "epsilon": 0.1, "eval_every_steps": args.eval_every, "epochs": args.epochs,
                "mode": MODE, "seeds": args.seeds, "torch_threads": threads})
    text = json.dumps(out, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""Stage-wise variable global batch (Hu et al. 2022): small early, large later.

LeNet on MNIST-format data (12,000 generated training images, 2,000 test images; a new draw
per seed), 30 epochs on 3 unequal simulated nodes, SGD with momentum 0.9 and the learning
rate stepped down ×0.1 at epochs 20 and 25. The learning rate is η = 0.02 per 32 samples
everywhere, scaled linearly with the batch (Goyal et al.). Runs:

* ``fixed_small``: B = 32 throughout;
* ``fixed_large``: B = 512 throughout, LR ×16 with a 3-epoch linear warm-up from 0;
* ``variable``: stages B = 32 (5 epochs), 128 (5), 512 (20), a 1-epoch ramp after each jump;
* ``large_first_stage``: ``variable`` with its *first* stage at B = 512 and the same 3-epoch
  warm-up as ``fixed_large``: only the early stage differs (the paper's claim: early stages
  are sensitive to a large batch);
* ``tuned``: the stages ``dynabatch tune`` chose for this job (``--tuned FILE``, the YAML it
  wrote from ``bench/stages-mnist.yaml``), when given.

Targets (kept in the output): ``variable`` within 1 point of ``fixed_small``'s accuracy with at
least 3× fewer updates; ``fixed_large`` and ``large_first_stage`` below ``variable``.
Accuracy: the final epoch's test accuracy; per seed, mean and median over ``--seeds``; the
targets compare means. Torch's threads are pinned (``--threads``, recorded): a run's floats,
and so its accuracy, depend on them.

    PYTHONPATH=. .venv/bin/python bench/batch_stages.py [--seeds 5] [--tuned FILE] [--out FILE]
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

from dynabatch.actors.spec import load_spec

from bench.sched_common import MODE, dataset, job, pin_threads, run, updates

EPOCHS = 30
ETA, B0 = 0.02, 32  # learning rate per 32 samples
MILESTONES = [20, 25]


def _spec(stages: list[tuple[int, int]], seed: int, mnist: str | None,
          lr_warmup: float = 0.0, warmup: float = 1.0):
    first = stages[0][1]
    return job(
        name="stages", epochs=EPOCHS, seed=seed, dataset=dataset(mnist),
        optimizer={"name": "sgd", "lr": ETA * first / B0, "momentum": 0.9,
                   "schedule": {"name": "multistep", "milestones": MILESTONES, "gamma": 0.1,
                                "warmup_epochs": lr_warmup}},
        schedule={"stages": [{"epochs": e, "global_batch": b} for e, b in stages],
                  "lr_scaling": "linear", "warmup_epochs": warmup},
    )


RUNS: dict[str, dict[str, Any]] = {
    "fixed_small": {"stages": [(30, 32)]},
    "fixed_large": {"stages": [(30, 512)], "lr_warmup": 3.0},
    "variable": {"stages": [(5, 32), (5, 128), (20, 512)]},
    "large_first_stage": {"stages": [(5, 512), (5, 128), (20, 512)], "lr_warmup": 3.0},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--tuned", type=Path, default=None, help="YAML written by dynabatch tune")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mnist", default=None, help="directory of real MNIST IDX files")
    ap.add_argument("--only", default="", help="comma-separated runs (default: all)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    threads = pin_threads(args.threads)
    specs = {name: [_spec(r["stages"], seed, args.mnist, r.get("lr_warmup", 0.0))
                    for seed in range(args.seeds)] for name, r in RUNS.items()}
    if args.tuned is not None:
        tuned = load_spec(args.tuned)
        specs["tuned"] = [tuned.model_copy(update={"seed": seed}) for seed in range(args.seeds)]
    if args.only:
        specs = {k: v for k, v in specs.items() if k in args.only.split(",")}
    out: dict[str, Any] = {}
    for name, seeds in specs.items():
        accs, ups, walls = [], [], []
        t0 = time.perf_counter()
        for spec in seeds:
            res, _ = run(spec)
            accs.append(res.history[-1].test_accuracy)
            ups.append(updates(res))
            walls.append(sum(r.wall_s for r in res.history))
        s0 = seeds[0]
        out[name] = {"accuracy": round(statistics.mean(accs), 4),
                     "accuracy_median": round(statistics.median(accs), 4),
                     "accuracy_per_seed": [round(a, 4) for a in accs],
                     "updates": int(statistics.mean(ups)),
                     "wall_s": round(statistics.mean(walls), 2),
                     "stages": [[st.epochs, st.global_batch] for st in s0.schedule.stages],
                     "lr_factors": [st.lr_factor for st in s0.schedule.stages],
                     "lr": s0.optimizer.lr,
                     "lr_warmup_epochs": s0.optimizer.schedule.warmup_epochs}
        print(f"{name}: {out[name]} ({time.perf_counter() - t0:.0f}s real)", file=sys.stderr)
    targets = {}
    if {"fixed_small", "variable", "fixed_large", "large_first_stage"} <= set(out):
        small, var = out["fixed_small"], out["variable"]
        targets = {
            "variable_within_1pt_of_fixed_small": var["accuracy"] >= small["accuracy"] - 0.01,
            "variable_3x_fewer_updates": small["updates"] >= 3 * var["updates"],
            "fixed_large_below_variable": out["fixed_large"]["accuracy"] < var["accuracy"],
            "large_first_stage_below_variable":
                out["large_first_stage"]["accuracy"] < var["accuracy"],
        }
    text = json.dumps({"runs": out, "targets": targets, "mode": MODE, "seeds": args.seeds,
                       "epochs": EPOCHS, "milestones": MILESTONES, "lr_per_32": ETA,
                       "torch_threads": threads}, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

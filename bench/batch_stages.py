"""Stage-wise variable global batch (Hu et al. 2022): small early, large later.

LeNet on digits (1,437 training samples), 30 epochs, SGD with momentum 0.9 and the learning
rate stepped down ×0.1 at epochs 20 and 25. The learning rate is η = 0.01 per 16 samples
everywhere, scaled linearly with the batch (Goyal et al.), with a linear warm-up after each
jump. Runs:

* ``fixed_small``: B = 16 throughout;
* ``fixed_large``: B = 256 throughout, LR ×16 with a 3-epoch warm-up;
* ``variable``: stages B = 16 (5 epochs), 64 (5), 256 (20), warm-up 1 epoch after each jump;
* ``large_first_stage``: ``variable`` with its *first* stage at B = 256: only the early stage
  differs (the paper's claim: early stages are sensitive to a large batch);
* ``tuned``: the stages ``dynabatch tune`` chose for this job (``--tuned FILE``, the YAML it
  wrote), when given.

Targets (kept in the output): ``variable`` within 1 point of ``fixed_small``'s accuracy with at
least 3× fewer updates; ``fixed_large`` and ``large_first_stage`` below ``variable``.
Accuracy: the final epoch's test accuracy (360 held-out samples), mean over ``--seeds``.

    PYTHONPATH=. .venv/bin/python bench/batch_stages.py [--seeds 2] [--tuned tuned.yaml]
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

from actors.spec import load_spec
from bench.sched_common import MODE, job, run, updates

EPOCHS = 30
ETA, B0 = 0.01, 16  # learning rate per 16 samples


def _spec(stages: list[tuple[int, int]], seed: int, lr_warmup: float = 0.0,
          warmup: float = 1.0):
    first = stages[0][1]
    return job(
        name="stages", epochs=EPOCHS, seed=seed,
        optimizer={"name": "sgd", "lr": ETA * first / B0, "momentum": 0.9,
                   "schedule": {"name": "multistep", "milestones": [20, 25], "gamma": 0.1,
                                "warmup_epochs": lr_warmup}},
        schedule={"stages": [{"epochs": e, "global_batch": b} for e, b in stages],
                  "lr_scaling": "linear", "warmup_epochs": warmup},
    )


RUNS: dict[str, dict[str, Any]] = {
    "fixed_small": {"stages": [(30, 16)]},
    "fixed_large": {"stages": [(30, 256)], "lr_warmup": 3.0},
    "variable": {"stages": [(5, 16), (5, 64), (20, 256)]},
    "large_first_stage": {"stages": [(5, 256), (5, 64), (20, 256)]},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--tuned", type=Path, default=None, help="YAML written by dynabatch tune")
    args = ap.parse_args()
    specs = {name: [_spec(r["stages"], seed, r.get("lr_warmup", 0.0))
                    for seed in range(args.seeds)] for name, r in RUNS.items()}
    if args.tuned is not None:
        tuned = load_spec(args.tuned)
        specs["tuned"] = [tuned.model_copy(update={"seed": seed}) for seed in range(args.seeds)]
    out: dict[str, Any] = {}
    for name, seeds in specs.items():
        accs, ups, walls = [], [], []
        t0 = time.perf_counter()
        for spec in seeds:
            res = run(spec)
            accs.append(res.history[-1].test_accuracy)
            ups.append(updates(res))
            walls.append(sum(r.wall_s for r in res.history))
        out[name] = {"accuracy": round(statistics.mean(accs), 4),
                     "accuracy_per_seed": [round(a, 4) for a in accs],
                     "updates": int(statistics.mean(ups)),
                     "wall_s": round(statistics.mean(walls), 2),
                     "stages": [[st.epochs, st.global_batch] for st in seeds[0].schedule.stages],
                     "lr": seeds[0].optimizer.lr}
        print(f"{name}: {out[name]} ({time.perf_counter() - t0:.0f}s real)", file=sys.stderr)
    small, var = out["fixed_small"], out["variable"]
    targets = {
        "variable_within_1pt_of_fixed_small": var["accuracy"] >= small["accuracy"] - 0.01,
        "variable_3x_fewer_updates": small["updates"] >= 3 * var["updates"],
        "fixed_large_below_variable": out["fixed_large"]["accuracy"] < var["accuracy"],
        "large_first_stage_below_variable":
            out["large_first_stage"]["accuracy"] < var["accuracy"],
    }
    print(json.dumps({"runs": out, "targets": targets, "mode": MODE, "seeds": args.seeds,
                      "epochs": EPOCHS}, indent=1))


if __name__ == "__main__":
    main()

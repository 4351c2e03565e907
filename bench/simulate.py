"""Simulator benchmark: static vs DBS vs affine on 1,000 and 10,000 simulated nodes, and the
simulator's prediction of the two Ray clusters that ``bench/hetero.py`` measured.

Scale (timing only, ``dynabatch.scheduler.sim.simulator``: the production coordinator and machines
on a
virtual clock). Nodes come in 3 speed classes, 1x/2x/4x, a third each:
``t(b) = a + c·b`` with (a, c) = (8 ms, 0.4 ms/sample), (4 ms, 0.2), (2 ms, 0.1), and 5%
per-step lognormal noise. The global batch is 64 samples per node, so the equal-finish split
is far from equal (about 16 / 52 / 124 samples per step). A ring all-reduce of a 1 MiB model
(2 µs per hop, ~10 GB/s). ``workers: auto`` (one worker per node), rebalancing at epoch
boundaries, the same seed for every policy. ``fraction_of_ideal`` = ideal epoch / steady
epoch (the epochs after the first 2), the ideal being the equal-finish step under the true
model plus the all-reduce, with the expected maximum of the per-step noise (see
``dynabatch.scheduler.sim.cost_model``). ``sim_wall_s``: wall seconds of the slowest of the
cluster's three runs (each simulates every epoch of one policy).

Validation: clusters (a) 2 workers at slowdowns [1, 3] and (b) 4 at [1, 1, 2, 4], LeNet on
12,000 MNIST-format samples, global batch 256, simulated from what ``bench/hetero.py``
measured in its own run (``bench/results-hetero-{a,b}.json``): each worker's solo step-time
fit (divided by its emulated slowdown, which the job spec's emulation re-applies), the
measured all-reduce. The results keep each profile point's median, not its per-step spread,
so the validation runs without jitter (``noise_sigma`` 0). Nothing of the measured epochs
goes into the prediction. ``predicted_epoch_s`` is the simulated steady epoch
of the policy that run found best, ``measured_epoch_s`` the measured one.

Prints one JSON object on stdout (details per policy go to stderr).

    nice -n 19 .venv/bin/python bench/simulate.py [--clusters 1000,10000] [--epochs 10]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.sim.cluster_spec import parse_cluster
from dynabatch.scheduler.sim.profiles import WorkerProfile, cluster_from_profiles
from dynabatch.scheduler.sim.simulator import SimResult, simulate

HERE = Path(__file__).resolve().parent
POLICIES = ("static", "dbs", "affine")
SPEED_CLASSES = (("x1", 8.0, 0.4), ("x2", 4.0, 0.2), ("x4", 2.0, 0.1))
PER_NODE_BATCH = 64


def scale_cluster(nodes: int, seed: int) -> dict[str, Any]:
    third = nodes // 3
    counts = (nodes - 2 * third, third, third)
    return {
        "classes": [{"name": name, "count": k, "a_ms": a, "c_ms_per_sample": c}
                    for (name, a, c), k in zip(SPEED_CLASSES, counts, strict=True)],
        "noise_sigma": 0.05, "seed": seed,
        "allreduce": {"alpha_ms": 0.002, "beta_ms_per_mb": 0.1, "model_mb": 1.0},
    }


def scale_spec(nodes: int, policy: str, epochs: int, seed: int) -> JobSpec:
    return JobSpec.model_validate({
        "name": f"sim-{nodes}-{policy}", "workers": "auto",
        "global_batch": PER_NODE_BATCH * nodes, "epochs": epochs, "policy": policy,
        "seed": seed,
    })


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_scale(nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    cluster = parse_cluster(scale_cluster(nodes, args.seed))
    out: dict[str, Any] = {"policies": {}}
    walls = []
    for policy in POLICIES:
        spec = scale_spec(nodes, policy, args.epochs, args.seed)
        r = simulate(spec, cluster, dataset_size=spec.global_batch * args.steps)
        _check(r)
        out["policies"][policy] = {"fraction_of_ideal": round(r.fraction_of_ideal, 4)}
        walls.append(r.wall_s)
        log(f"[{nodes}] {policy}: steady epoch {r.steady_epoch_s:.4f}s (ideal "
            f"{r.ideal.epoch_s:.4f}s), fraction of ideal {r.fraction_of_ideal:.3f}, "
            f"throughput/sum(v) {r.compute_fraction:.3f}, balance "
            f"{r.steady_mean('compute_balance'):.3f}, {len(r.history)} epochs in "
            f"{r.wall_s:.1f}s wall")
    out["sim_wall_s"] = round(max(walls), 2)
    return out


def _check(r: SimResult) -> None:
    if r.snapshot.state.value != "SUCCEEDED":
        raise RuntimeError(f"{r.spec.name}: {r.snapshot.state.value}: {r.snapshot.reason}")
    bad = [h.epoch for h in r.history if not h.verified]
    if bad:
        raise RuntimeError(f"{r.spec.name}: epochs {bad} not verified")


def profile_misfit(solo: list[dict[str, float]], fits: list[dict[str, float]]) -> float:
    """RMS of log(measured / fitted) over the solo-profile points (reported, not simulated:
    it mixes the fit's error with the noise of a median of 5 steps)."""
    res = [math.log(t / (f["a_s"] + f["c_s_per_sample"] * int(b)))
           for prof, f in zip(solo, fits, strict=True) for b, t in prof.items()]
    return float(np.sqrt(np.mean(np.square(res))))


def validate(name: str, args: argparse.Namespace) -> dict[str, Any]:
    path = HERE / f"results-hetero-{name}.json"
    report = json.loads(path.read_text())
    res = report["clusters"][name]
    slow, ideal = res["slowdowns"], res["ideal"]
    m = re.search(r"\((\d+) train\)", report["data"])
    if not m:
        raise RuntimeError(f"{path}: data {report['data']!r} does not give the train size")
    n_train = int(m.group(1))
    # The solo profile includes the emulated slowdown; the spec's emulation re-applies it.
    profiles = [WorkerProfile(f"w{i}", f"node{i}", f["a_s"] / s, f["c_s_per_sample"] / s, 0)
                for i, (f, s) in enumerate(zip(ideal["fits"], slow, strict=True))]
    misfit = profile_misfit(ideal["solo_step_s"], ideal["fits"])
    cluster = cluster_from_profiles(profiles, ideal["allreduce_s"], seed=args.seed)
    per_policy = {}
    for policy, measured in res["policies"].items():
        spec = JobSpec.model_validate({
            "name": f"hetero-{name}-{policy}", "dataset": {"name": "mnist"},
            "model": {"name": "lenet"}, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "workers": len(slow), "global_batch": 256, "epochs": report["epochs"],
            "policy": policy, "seed": 0, "emulation": {"slowdowns": slow},
            "collective_timeout_s": 120,
        })
        r = simulate(spec, cluster, dataset_size=n_train)
        _check(r)
        got, want = r.steady_epoch_s, measured["steady_epoch_s"]
        per_policy[policy] = (got, want)
        log(f"[hetero-{name}] {policy}: predicted {got:.3f}s, measured {want:.3f}s "
            f"({got / want:.2f}x)"
            f"; batches {[w.batch for w in r.history[-1].workers]} vs "
            f"{[measured['final_batches'][w] for w in sorted(measured['final_batches'])]}; "
            f"solo-profile misfit {misfit:.3f}")
    best = res.get("best_policy", "affine")
    predicted, measured = per_policy[best]
    return {"predicted_epoch_s": round(predicted, 4), "measured_epoch_s": round(measured, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="1000,10000")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--steps", type=int, default=16, help="Steps per epoch at 1,000 nodes.")
    ap.add_argument("--large-epochs", type=int, default=6,
                    help="Epochs beyond 1,000 nodes (2 learning + 4 steady by default).")
    ap.add_argument("--large-steps", type=int, default=8)
    ap.add_argument("--validation", default="a,b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result: dict[str, Any] = {"clusters": {}, "validation": {}}
    for nodes in (int(x) for x in args.clusters.split(",") if x):
        run_args = args
        if nodes > 1000:
            run_args = argparse.Namespace(**{**vars(args), "epochs": args.large_epochs,
                                             "steps": args.large_steps})
        result["clusters"][str(nodes)] = bench_scale(nodes, run_args)
    for name in (x for x in args.validation.split(",") if x):
        result["validation"][name] = validate(name, args)
    text = json.dumps(result)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

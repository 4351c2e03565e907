"""Ji et al. 2019, performance-aware dynamic batch sizes for ASGD, best against best (issue 21):
every arm at its own best α0, chosen on a validation split, against ASGD and n-softsync.

Arms (λ learners of unequal speed; b0 per learner, μλ = λ·b0):

* ``asgd``: async, every learner's batch b0, plain α0.
* ``softsync_n{λ}`` and ``softsync_n{λ/2}``: n-softsync with α0/τ per gradient (Rudra's rule,
  the one that makes n-softsync work at all).
* ``perf_aware``: async with Ji's b_i = clip(round(λ·b0·v_i/Σv), b0/4, 4·b0), v_i the EMA of
  the measured samples/s, re-planned every 2λ pushes, plain α0 (the plain reading).
* ``perf_aware_tau``: the same batches with α0/τ per gradient.
* ``perf_aware_scaled``: the same batches, each gradient's α scaled by its own b_i/b0.

Protocol. The training set is split 80/20 (seeded); every arm runs every α0 of its grid
(``--lrs``) over ``--seeds`` seeds on the 80%, and its α0 is the one with the lowest mean
final loss on the 20% validation split. While an arm's best sits at an edge of its grid, the
grid is widened past that edge (×2 or ÷2, at most ``--widen`` times), so every chosen α0 is
interior unless the JSON's ``alpha0_interior`` says otherwise. At that α0 the arm reports
its final training loss (the mean cross-entropy of the final weights over its training
split) at *equal samples*
(every arm trains ``--epochs`` epochs) and at *equal wall-clock* (each arm's training loss,
measured at every epoch's end, interpolated at the earliest time any arm finished), its
throughput and its speed-up (throughput over one speed-1 learner's at b0; ideal Σ speeds).
Two clusters: ``--speeds`` (8 learners 1:1:2:2:4:4:16:16) and ``--speeds2`` (4 at 1:1:2:4).

``best``: the perf-aware arm with the lowest equal-samples loss on the first cluster, with
its loss over ASGD's and over the better n-softsync's (targets ≤ 0.4 each). ``cifar``: that
arm against ASGD on CIFAR-format data (``hard_mnist:cifar_like``, generated) with the small
ResNet, each at its own α0 from ``--cifar-lrs`` (chosen on the validation split), test
accuracy on the held-out test set (target: ≥ ASGD + 10 points); ``--cifar-path``: real
CIFAR-10 files instead. ``--ray-arm``: the winning arm and ASGD on real Ray actors, each at
its own α0 from the simulator's sweep (short; emulated speeds). ``--reuse FILE``: keep that
file's digits sweep (and its CIFAR and Ray parts unless redone), chaining ``commands``.

Simulator: ``dynabatch.scheduler.sim.ps_job`` (the production PS core and driver, real gradients,
virtual clock t_i(b) = (2 ms + 0.5 ms·b)/speed_i with 5% jitter).

    python bench/async_ji.py --jobs 2 --out FILE      # digits sweep and CIFAR part
    python bench/async_ji.py --reuse FILE --cifar-lrs '' --ray-arm best --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.datasets import DatasetArrays, load_dataset
from dynabatch.scheduler.ps.driver import build_core
from dynabatch.scheduler.sim import ps_job as sim_ps
from dynabatch.scheduler.sim.cluster_spec import parse_cluster
from dynabatch.scheduler.sim.ps_job import simulate_ps
from dynabatch.scheduler.sim.ps_runtime import SimPSRuntime

from bench.report import emit

CIFAR = "bench.hard_mnist:cifar_like"
A_S, C_S = 0.002, 0.0005  # a speed-1 learner: t(b) = 2 ms + 0.5 ms·b


def arms(lam: int) -> dict[str, dict]:
    # The plain reading of the paper (alpha0 for every batch size); scaled is the default now.
    pa = {"name": "ps", "mode": "async", "batch": "perf_aware", "replan_pushes": 2 * lam,
          "scale_lr": False}
    return {
        "asgd": {"name": "ps", "mode": "async"},
        f"softsync_n{lam}": {"name": "ps", "mode": "softsync", "n": lam,
                             "lr_staleness": "per_gradient"},
        f"softsync_n{max(1, lam // 2)}": {"name": "ps", "mode": "softsync",
                                          "n": max(1, lam // 2),
                                          "lr_staleness": "per_gradient"},
        "perf_aware": pa,
        "perf_aware_tau": {**pa, "lr_staleness": "per_gradient"},
        "perf_aware_scaled": {**pa, "scale_lr": True},
    }


class _Recording(SimPSRuntime):
    """The simulator's PS runtime, also measuring the training loss of the current weights
    at every epoch's end (for equal wall-clock), and test accuracy when given a test set."""

    test: tuple[np.ndarray, np.ndarray] | None = None
    every_epoch_train = True

    def _handle(self, events, t: float) -> None:
        for closed in self.events.handle(events).closed:
            loss, acc = self.store.evaluate(self.ds.x_test, self.ds.y_test)
            rec = self.events.record(closed, loss, acc, t)
            if _Recording.every_epoch_train:
                rec["full_train_loss"] = self.store.evaluate(self.ds.x_train,
                                                             self.ds.y_train)[0]
            if _Recording.test is not None:
                rec["heldout_accuracy"] = self.store.evaluate(*_Recording.test)[1]
            self.epochs.append(rec)


sim_ps.SimPSRuntime = _Recording  # simulate_ps builds this runtime


def spec_for(arm: str, proto: dict, a, lam: int, lr: float, seed: int, dataset: dict,
             model: dict, epochs: int, speeds: list[float]) -> JobSpec:
    return JobSpec.model_validate(dict(
        name=f"ji-{arm}".replace("_", "-"), dataset=dataset, model=model,
        optimizer={"name": "sgd", "lr": lr, "momentum": a.momentum}, workers=lam,
        global_batch=a.b0 * lam, epochs=epochs, seed=seed, protocol=proto,
        emulation={"slowdowns": [max(speeds) / s for s in speeds]}))


def with_validation(ds: DatasetArrays, seed: int, frac: float = 0.2) -> DatasetArrays:
    """The training set split: train on 1−frac, the 'test' slot holds the validation part."""
    idx = np.random.default_rng([seed, 21]).permutation(len(ds.y_train))
    k = int(len(idx) * frac)
    va, tr = idx[:k], idx[k:]
    return DatasetArrays(ds.name, ds.x_train[tr], ds.y_train[tr], ds.x_train[va],
                         ds.y_train[va], num_classes=ds.num_classes)


def run_one(arm, proto, a, speeds, lr, seed, ds, dataset, model, epochs) -> dict:
    lam = len(speeds)
    spec = spec_for(arm, proto, a, lam, lr, seed, dataset, model, epochs, speeds)
    core = build_core(spec, len(ds.y_train))
    # One node per learner at the fastest speed: the spec's emulated slowdown of learner i
    # (max/s_i) makes its t(b) = (A_S + C_S·b)/s_i.
    top = max(speeds)
    cluster = parse_cluster({
        "classes": [{"name": "n", "count": lam, "a_ms": A_S * 1e3 / top,
                     "c_ms_per_sample": C_S * 1e3 / top}],
        "noise_sigma": 0.05, "seed": seed, "parameter_server": {"beta_ms_per_mb": 0.0}})
    res = simulate_ps(spec, core, cluster, data=ds)
    assert all(e["verified"] for e in res.epochs)
    taus = np.asarray([t for v in res.staleness.values() for t in v] or [0])
    fin = res.final_train_loss
    out = {"val_loss": _finite(res.epochs[-1]["test_loss"]),
           "train_loss": _finite(fin),
           "curve": [(round(e["t"], 4), _finite(e.get("full_train_loss", fin)))
                     for e in res.epochs],
           "throughput": res.throughput,
           "staleness_mean": float(taus.mean()), "staleness_p99": float(np.percentile(taus, 99)),
           "batches": {w: v["batch"] for w, v in res.snapshot["workers"].items()}}
    out["staleness_by_worker"] = {w: float(np.mean(v)) for w, v in res.staleness.items() if v}
    # samples applied at τ ≤ 2 (a gradient weighted by its learner's final batch)
    w_tau = [(out["batches"].get(w, a.b0), t) for w, v in res.staleness.items() for t in v]
    tot = sum(b for b, _ in w_tau) or 1
    out["fresh_sample_share"] = sum(b for b, t in w_tau if t <= 2) / tot
    if "heldout_accuracy" in res.epochs[-1]:
        out["test_accuracy"] = res.epochs[-1]["heldout_accuracy"]
        out["val_accuracy"] = res.epochs[-1]["test_accuracy"]
    return out


def _finite(x) -> float:
    x = float(x) if x is not None else float("inf")
    return x if np.isfinite(x) else float("inf")


def _at(curve: list, t: float) -> float:
    """The training loss at time t, linear between epoch ends (the first epoch's before)."""
    ts = [c[0] for c in curve]
    ls = [c[1] for c in curve]
    if t <= ts[0]:
        return ls[0]
    return float(np.interp(t, ts, ls))


def _r(x: float, k: int = 4):
    return None if not np.isfinite(x) else round(float(x), k)


def _mean_val(grid: dict[float, list]) -> dict[float, float]:
    return {lr: float(np.mean([r["val_loss"] for r in rs])) for lr, rs in grid.items()}


_CTX: tuple = ()  # the sweep's arguments, inherited by forked workers (--jobs)


def sweep(a, speeds, lrs, seeds, ds, dataset, model, epochs, names=None,
          widen: int = 0, refine: bool = False) -> dict:
    """Every arm over its α0 grid (mean validation loss over ``seeds``). ``widen``: while an
    arm's best α0 sits at an edge of its grid, add the next point beyond it (×2 above, ÷2
    below), at most ``widen`` times, so that each arm's chosen α0 is interior; ``refine``:
    then also try the best α0 ×√2 and ÷√2 (a finer step around it). ``a.jobs`` > 1: the
    arms in that many forked processes (the figures are on the virtual clock: unchanged)."""
    global _CTX
    names = names or list(arms(len(speeds)))
    _CTX = (a, speeds, lrs, seeds, ds, dataset, model, epochs, widen, refine)
    if a.jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("fork")) as ex:
            return dict(zip(names, ex.map(_sweep_arm, names), strict=True))
    return {arm: _sweep_arm(arm) for arm in names}


def _sweep_arm(arm: str) -> dict:
    a, speeds, lrs, seeds, ds, dataset, model, epochs, widen, refine = _CTX
    proto = arms(len(speeds))[arm]
    t0 = time.perf_counter()
    grid: dict[float, list] = {}

    def run(lr: float) -> None:
        grid[lr] = [run_one(arm, proto, a, speeds, lr, s, ds, dataset, model, epochs)
                    for s in seeds]

    def best_lr() -> float:
        val = _mean_val(grid)
        return min(grid, key=lambda lr: (val[lr], lr))

    for lr in lrs:
        run(lr)
    for _ in range(widen):
        best = best_lr()
        if min(grid) < best < max(grid):
            break
        run(round(best * 2 if best == max(grid) else best / 2, 6))
    if refine:
        best = best_lr()
        for lr in (round(best / 2**0.5, 6), round(best * 2**0.5, 6)):
            run(lr)
    val = _mean_val(grid)
    best = best_lr()
    dt = time.perf_counter() - t0
    print(f"  {arm}: α0={best} val={ {k: _r(val[k]) for k in sorted(grid)} } ({dt:.0f}s)",
          file=sys.stderr, flush=True)
    return {"alpha0": best, "grid": sorted(grid), "alpha0_interior": min(grid) < best < max(grid),
            "val_loss_by_alpha0": {str(k): _r(val[k]) for k in sorted(grid)},
            "runs": grid[best], "sweep_s": round(dt, 1)}


def summarise(res: dict, speeds: list[float], b0: int) -> dict:
    t_end = min(max(r["curve"][-1][0] for r in v["runs"]) for v in res.values())
    one = b0 / (A_S + C_S * b0)  # a speed-1 learner alone, samples/s
    out = {}
    for arm, v in res.items():
        rs = v["runs"]
        row = {"alpha0": v["alpha0"], "grid": v["grid"], "alpha0_interior": v["alpha0_interior"],
               "val_loss_by_alpha0": v["val_loss_by_alpha0"],
               "train_loss_equal_samples": _r(np.mean([r["train_loss"] for r in rs])),
               "train_loss_equal_time": _r(np.mean([_at(r["curve"], t_end) for r in rs])),
               "per_seed_equal_samples": [_r(r["train_loss"]) for r in rs],
               "throughput": _r(np.mean([r["throughput"] for r in rs]), 1),
               "speedup": _r(np.mean([r["throughput"] for r in rs]) / one, 2),
               "staleness_mean": _r(np.mean([r["staleness_mean"] for r in rs]), 2),
               "staleness_p99": _r(np.mean([r["staleness_p99"] for r in rs]), 1),
               "staleness_by_worker": {w: _r(np.mean([r["staleness_by_worker"].get(w, np.nan)
                                                      for r in rs]), 1)
                                       for w in rs[0]["staleness_by_worker"]},
               "fresh_sample_share": _r(np.mean([r["fresh_sample_share"] for r in rs]), 3),
               "batches": rs[0]["batches"]}
        if "test_accuracy" in rs[0]:
            row["test_accuracy"] = _r(np.mean([r["test_accuracy"] for r in rs]))
            row["per_seed_test_accuracy"] = [_r(r["test_accuracy"]) for r in rs]
        row["sweep_s"] = v["sweep_s"]
        out[arm] = row
    return {"equal_time_s": _r(t_end, 3), "ideal_speedup": sum(speeds), "arms": out}


def ratios(s: dict, arm: str, key: str) -> dict:
    a = s["arms"]
    soft = [k for k in a if k.startswith("softsync")]
    best_soft = min(soft, key=lambda k: a[k][key] if a[k][key] is not None else 1e9)

    def rat(x, y):
        return None if x is None or y in (None, 0) else round(x / y, 3)
    return {"loss_ratio_vs_asgd": rat(a[arm][key], a["asgd"][key]),
            "loss_ratio_vs_softsync": rat(a[arm][key], a[best_soft][key]),
            "softsync_arm": best_soft}


def exported_train_loss(coord: object, spec: JobSpec) -> float:
    """The mean training loss, over the whole training set, of the model the Ray job
    exported (what the simulator's ``final_train_loss`` measures on its final weights)."""
    import tempfile

    from dynabatch.actors.export import load_model, write_files
    from dynabatch.actors.ps import ParamStore

    ds = load_dataset(spec.dataset, seed=spec.seed)
    with tempfile.TemporaryDirectory() as d:
        model = load_model(write_files(coord.model_files(), d))  # type: ignore[attr-defined]
    flat = torch.nn.utils.parameters_to_vector(
        [p for p in model.parameters() if p.requires_grad])
    store = ParamStore(spec, tuple(ds.input_shape), ds.num_classes)
    return store.evaluate(ds.x_train, ds.y_train, flat.detach().numpy())[0]


def run_ray(arm: str, a, speeds, lrs: dict[str, float]) -> dict:
    """``arm`` and ASGD on local Ray actors, each at its own α0 (``lrs``)."""
    import ray
    from dynabatch.scheduler.ps.driver import PSCoordinator

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=len(speeds), include_dashboard=False,
             object_store_memory=200 * 2**20, log_to_driver=False)
    out = {}
    try:
        for name in ("asgd", arm):
            spec = spec_for(name, arms(len(speeds))[name], a, len(speeds), lrs[name], 0,
                            {"name": "digits"}, {"name": "mlp", "hidden": 64}, a.ray_epochs,
                            speeds)
            coord = PSCoordinator(f"ji-{name}", spec)
            snap = coord.run()
            assert snap.state.value == "SUCCEEDED", snap.reason
            hist = coord.history()
            st = coord.server_stats
            span = st["epochs"][-1]["t"] - st["started_s"]
            out[name] = {"alpha0": lrs[name], "final_loss": _r(exported_train_loss(coord, spec)),
                         "throughput": _r(sum(r.samples_trained for r in hist) / span, 1),
                         "batches": {w.worker: w.batch for w in snap.ps.workers}}
    finally:
        ray.shutdown()
    out["loss_ratio_vs_asgd"] = (round(out[arm]["final_loss"] / out["asgd"]["final_loss"], 3)
                                 if out[arm]["final_loss"] and out["asgd"]["final_loss"]
                                 else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speeds", default="1,1,2,2,4,4,16,16")
    ap.add_argument("--speeds2", default="1,1,2,4", help="second cluster ('' to skip)")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lrs", default=",".join(f"{0.0125 * 2 ** (k / 2):.4g}" for k in range(15)))
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--widen", type=int, default=4,
                    help="extend an arm's grid beyond an edge optimum at most this often")
    ap.add_argument("--refine", action="store_true", help="then try the best α0 ×/÷ √2")
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--b0", type=int, default=16)
    ap.add_argument("--cifar-lrs", default="0.0125,0.025,0.05,0.1",
                    help="'' to skip the CIFAR part")
    ap.add_argument("--cifar-epochs", type=int, default=12)
    ap.add_argument("--cifar-seeds", type=int, default=3)
    ap.add_argument("--cifar-train", type=int, default=2000)
    ap.add_argument("--cifar-widen", type=int, default=2)
    ap.add_argument("--cifar-path", default=None,
                    help="real CIFAR-10 (cifar-10-batches-py) instead of the generated set")
    ap.add_argument("--ray-arm", default="", help="run this arm and ASGD on Ray ('best')")
    ap.add_argument("--ray-epochs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1, help="arms in this many processes")
    ap.add_argument("--reuse", default=None,
                    help="take the digits sweep (clusters, best) from this results file, "
                         "and its CIFAR and Ray parts unless this run redoes them")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lrs = [float(x) for x in a.lrs.split(",")]
    seeds = list(range(a.seeds))
    cmd = "python bench/async_ji.py " + " ".join(sys.argv[1:])
    load = [round(x, 2) for x in os.getloadavg()]  # this run's (a reused part keeps its own)
    out: dict = {"command": cmd, "commands": [cmd],
                 "load_average": load,
                 "mode": "simulator (scheduler/sim/ps_job.py, real gradients, virtual clock)",
                 "epochs": a.epochs, "b0": a.b0, "lrs": lrs, "widen": a.widen,
                 "refine": a.refine,
                 "seeds": a.seeds,
                 "momentum": a.momentum, "dataset": "digits (80% train / 20% validation)",
                 "model": "mlp hidden 64", "selection": "α0 per arm by mean validation loss"}
    digits = load_dataset(JobSpec.model_validate({"dataset": {"name": "digits"}}).dataset)
    ds = with_validation(digits, 0)
    clusters = {}
    if a.reuse:
        prev = json.loads(Path(a.reuse).read_text())
        clusters = prev["clusters"]
        out.update({k: prev[k] for k in ("command", "load_average", "epochs", "lrs", "widen",
                                         "refine", "seeds") if k in prev})
        chain = prev.get("commands")
        out["commands"] = [*(chain if isinstance(chain, list) else [prev["command"]]), cmd]
        out.update({k: prev[k] for k in ("cifar", "ray") if k in prev})
    for key in ("speeds", "speeds2"):
        text = getattr(a, key)
        if not text or a.reuse:
            continue
        speeds = [float(s) for s in text.split(",")]
        print(f"cluster {speeds}", file=sys.stderr)
        res = sweep(a, speeds, lrs, seeds, ds, {"name": "digits"},
                    {"name": "mlp", "hidden": 64}, a.epochs, widen=a.widen, refine=a.refine)
        clusters[":".join(f"{s:g}" for s in speeds)] = summarise(res, speeds, a.b0)
    out["clusters"] = clusters
    first = next(iter(clusters.values()))
    pa = [k for k in first["arms"] if k.startswith("perf_aware")]
    key = "train_loss_equal_samples"
    win = min(pa, key=lambda k: first["arms"][k][key] or 1e9)
    out["best"] = {"arm": win, "cluster": next(iter(clusters)), **ratios(first, win, key),
                   "equal_time": ratios(first, win, "train_loss_equal_time")}
    out["by_cluster"] = {c: {arm: {**ratios(s, arm, key),
                                   "equal_time": ratios(s, arm, "train_loss_equal_time")}
                             for arm in s["arms"] if arm.startswith("perf_aware")}
                         for c, s in clusters.items()}
    out["best"]["target_met"] = bool(
        (out["best"]["loss_ratio_vs_asgd"] or 9) <= 0.4
        and (out["best"]["loss_ratio_vs_softsync"] or 9) <= 0.4)
    if a.cifar_lrs:
        speeds = [float(s) for s in a.speeds2.split(",")] if a.speeds2 else \
            [float(s) for s in a.speeds.split(",")]
        cspec = ({"name": "cifar10", "path": a.cifar_path, "limit": a.cifar_train}
                 if a.cifar_path else
                 {"name": CIFAR, "options": {"n_train": a.cifar_train, "n_test": 1000}})
        cds = load_dataset(JobSpec.model_validate({"dataset": cspec}).dataset)
        _Recording.test = (cds.x_test, cds.y_test)
        _Recording.every_epoch_train = False
        cv = with_validation(cds, 0)
        clr = [float(x) for x in a.cifar_lrs.split(",")]
        print(f"cifar {speeds}", file=sys.stderr)
        res = sweep(a, speeds, clr, list(range(a.cifar_seeds)), cv,
                    cspec, {"name": "resnet", "options": {"widths": [8, 16, 32]}}, a.cifar_epochs,
                    names=["asgd", win], widen=a.cifar_widen)
        s = summarise(res, speeds, a.b0)
        acc = {k: v["test_accuracy"] for k, v in s["arms"].items()}
        gain = round(100 * (acc[win] - acc["asgd"]), 2)
        per_seed = [round(100 * (x - y), 2) for x, y in
                    zip(s["arms"][win]["per_seed_test_accuracy"],
                        s["arms"]["asgd"]["per_seed_test_accuracy"], strict=True)]
        out["cifar"] = {"command": cmd, "load_average": load, "arm": win,
                        "speeds": speeds, "epochs": a.cifar_epochs, "lrs": clr,
                        "widen": a.cifar_widen, "seeds": a.cifar_seeds,
                        "n_train": a.cifar_train, "dataset": cspec["name"],
                        "accuracy_gain_per_seed": per_seed,
                        "model": "resnet widths 8,16,32", "test_accuracy": acc,
                        "accuracy_gain_vs_asgd": gain, "target_met": gain >= 10, **s}
    if a.ray_arm:
        arm = win if a.ray_arm == "best" else a.ray_arm
        speeds = [float(s) for s in a.speeds2.split(",")]
        sw = clusters[":".join(f"{s:g}" for s in speeds)]["arms"]
        lrs_ray = {k: sw[k]["alpha0"] for k in ("asgd", arm)}
        out["ray"] = {"command": cmd, "load_average": load, "arm": arm,
                      "speeds": speeds, "alpha0": lrs_ray, "epochs": a.ray_epochs,
                      "note": "real Ray actors (local), emulated speeds, digits MLP on the "
                              "whole training set, 1 seed, each arm at its own α0 from "
                              "the simulator's sweep of this cluster",
                      **run_ray(arm, a, speeds, lrs_ray)}
    emit(out, a.out, indent=1)


if __name__ == "__main__":
    main()

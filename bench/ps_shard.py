"""When does sharding the parameter server over k actors start to pay?

The real server path (``dynabatch.actors.ps.ParameterServer`` holding the one ``PSCore`` and slice
0,
``dynabatch.actors.ps.ParamShard`` actors for slices 1..k−1, async protocol, plain SGD) under a
sweep of
model size (an MLP on digits whose hidden width sets the parameter count) × k shards ×
learners. The learners here are load generators: each loops over the server's own learner
protocol (``request`` → fetch the k slices of its version in parallel → put slices 1..k−1 on
their shards in parallel → ``push`` slice 0) with a fixed random gradient and **no compute**,
so the figures are the server path's capacity, not a model's training speed. Per config,
after a warm-up:

* ``pull_ms``: a learner's fetch of its version's k slices (median);
* ``push_ms``: a learner's push, shard puts and commit (median);
* ``apply_ms``: the server's update, slice 0 here and slices 1..k−1 on the shards in
  parallel (median, measured on the server);
* ``pushes_per_s``: pushes the server took per second, all learners together.

Each figure is the median over ``--repeats`` runs, the k values interleaved within each
repeat (the machine is noisy). ``speedup`` is pushes/s over k = 1's at the same size and
learner count. Prints one JSON
object (``--out FILE`` also writes it). Start Ray under the lock:

    flock /tmp/dynabatch-ray.lock .venv/bin/python bench/ps_shard.py \
        --out bench/results-ps-shard.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from dynabatch.actors.spec import JobSpec

from bench.report import emit

CALL_TIMEOUT_S = 60.0
START_TIMEOUT_S = 600.0  # new actors import torch; Ray starts two processes at a time here


class LoadLearner:
    """Drives the server like ``dynabatch.actors.learner.Learner`` but pushes a fixed
    gradient instead of computing one: it measures the server path alone. One pool serves
    every config."""

    def __init__(self, seed: int):
        self.seed = seed
        self.grad = np.zeros(0, np.float32)

    def ready(self) -> bool:
        return True

    def run(self, worker: str, server, shards, bounds, seconds: float) -> dict:
        import ray

        self.worker = worker
        size = bounds[-1][1]
        if self.grad.size != size:
            self.grad = np.random.default_rng(self.seed).standard_normal(size).astype(
                np.float32)
        lo0, hi0 = bounds[0]
        pulls, pushes = [], []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            reply = ray.get(server.request.remote(self.worker), timeout=CALL_TIMEOUT_S)
            if "work" not in reply:
                continue
            work = reply["work"]
            t0 = time.perf_counter()
            parts = ray.get(reply["weights"], timeout=CALL_TIMEOUT_S)
            assert sum(p.size for p in parts) == self.grad.size
            t1 = time.perf_counter()
            if shards:
                ray.get([s.put.remote(work.ticket, self.grad[lo:hi])
                         for s, (lo, hi) in zip(shards, bounds[1:], strict=True)],
                        timeout=CALL_TIMEOUT_S)
            ray.get(server.push.remote(self.worker, self.grad[lo0:hi0], work.version,
                                       work.chunk.samples, 0.001), timeout=CALL_TIMEOUT_S)
            pulls.append(t1 - t0)
            pushes.append(time.perf_counter() - t1)
        return {"pull_s": pulls, "push_s": pushes}


def _apply_times(server: Any) -> list[float]:
    """Wall seconds of the server's recent updates, read inside its actor (``__ray_call__``)."""
    return list(server.apply_s)


def one(hidden: int, k: int, learners: int, seconds: float, warmup: float, pool: list
        ) -> dict:
    import ray
    from dynabatch.actors.ps import ParameterServer, ParamShard, param_count, shard_bounds
    from dynabatch.scheduler.ps.driver import build_core

    spec = JobSpec.model_validate(dict(
        dataset={"name": "digits"}, model={"name": "mlp", "hidden": hidden},
        optimizer={"name": "sgd", "lr": 1e-6}, workers=learners, global_batch=16 * learners,
        epochs=1, seed=0, protocol={"name": "ps", "mode": "async", "shards": k}))
    shape, classes = (64,), 10
    size = param_count(spec, shape, classes)
    bounds = shard_bounds(size, k)
    core = build_core(spec, 10**9)  # no epoch ends during the measurement
    shards = [ray.remote(ParamShard).options(num_cpus=0).remote(spec, shape, classes, b)
              for b in bounds[1:]]
    x = np.zeros((1, 64), np.float32)
    y = np.zeros(1, np.int64)
    server = ray.remote(ParameterServer).options(num_cpus=0, max_concurrency=1000).remote(
        spec, core, shape, classes, x, y, shards, bounds, call_timeout_s=CALL_TIMEOUT_S)
    names = [f"w{i}" for i in range(learners)]
    gens = pool[:learners]
    try:
        ray.get([h.actor_id.remote() for h in (server, *shards)], timeout=START_TIMEOUT_S)
        for w in names:
            ray.get(server.join.remote(w), timeout=CALL_TIMEOUT_S)
        # Warm-up (first puts, caches), then the measured window.
        runs = list(zip(gens, names, strict=True))
        ray.get([g.run.remote(w, server, shards, bounds, warmup) for g, w in runs],
                timeout=CALL_TIMEOUT_S + warmup)
        v0 = ray.get(server.snapshot.remote(), timeout=CALL_TIMEOUT_S)["pushes"]
        n_apply = len(ray.get(server.__ray_call__.remote(_apply_times), timeout=CALL_TIMEOUT_S))
        t0 = time.monotonic()
        res = ray.get([g.run.remote(w, server, shards, bounds, seconds) for g, w in runs],
                      timeout=CALL_TIMEOUT_S + seconds)
        wall = time.monotonic() - t0
        snap = ray.get(server.snapshot.remote(), timeout=CALL_TIMEOUT_S)
        applies = ray.get(server.__ray_call__.remote(_apply_times),
                          timeout=CALL_TIMEOUT_S)[n_apply:]
    finally:
        for h in [server, *shards]:
            ray.kill(h, no_restart=True)
    pulls = [t for r in res for t in r["pull_s"]]
    pushes = [t for r in res for t in r["push_s"]]
    return {"hidden": hidden, "params": size, "mb": round(4 * size / 2**20, 2), "shards": k,
            "learners": learners, "pushes": snap["pushes"] - v0,
            "pushes_per_s": round((snap["pushes"] - v0) / wall, 1),
            "pull_ms": round(1e3 * float(np.median(pulls)), 2) if pulls else None,
            "push_ms": round(1e3 * float(np.median(pushes)), 2) if pushes else None,
            "apply_ms": round(1e3 * float(np.median(applies)), 2) if applies else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", default="128,1024,2048,4096",
                    help="MLP widths (2 hidden layers on digits: ~25k to ~17M parameters)")
    ap.add_argument("--shards", default="1,2,4")
    ap.add_argument("--learners", default="1,4")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False,
             object_store_memory=2 * 2**30, log_to_driver=False)
    rows = []
    counts = [int(x) for x in a.learners.split(",")]
    pool = [ray.remote(LoadLearner).options(num_cpus=0).remote(i) for i in range(max(counts))]
    ray.get([g.ready.remote() for g in pool], timeout=START_TIMEOUT_S)
    try:
        ks = [int(x) for x in a.shards.split(",")]
        for hidden in (int(h) for h in a.hidden.split(",")):
            for n in counts:
                runs: dict[int, list[dict]] = {k: [] for k in ks}
                for _ in range(a.repeats):
                    for k in ks:  # interleaved, so load drifts hit every k alike
                        r = one(hidden, k, n, a.seconds, a.warmup, pool)
                        runs[k].append(r)
                        print(json.dumps(r), file=sys.stderr)
                base = None
                for k in ks:
                    r = dict(runs[k][0])
                    for key in ("pushes_per_s", "pull_ms", "push_ms", "apply_ms"):
                        vals = [x[key] for x in runs[k] if x[key] is not None]
                        r[key] = round(float(np.median(vals)), 2) if vals else None
                    r["pushes_per_s_runs"] = [x["pushes_per_s"] for x in runs[k]]
                    r.pop("pushes")
                    base = base or r["pushes_per_s"]
                    r["speedup"] = round(r["pushes_per_s"] / base, 3) if base else None
                    rows.append(r)
    finally:
        ray.shutdown()
    pays = [r for r in rows if r["shards"] > 1 and (r["speedup"] or 0) > 1.05]
    out = {"machine_cpus": os.cpu_count(), "seconds": a.seconds, "repeats": a.repeats,
           "rows": rows,
           "pays": [{"params": r["params"], "learners": r["learners"], "shards": r["shards"],
                     "speedup": r["speedup"]} for r in pays],
           "note": "sharding pays where speedup > 1.05 (pushes/s over k = 1's, same size and "
                   "learners)"}
    emit(out, a.out)


if __name__ == "__main__":
    main()

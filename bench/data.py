"""Data read by position: worker memory against dataset size, and epoch time by source.

Memory. MNIST-format Parquet sets of about ``--small-mb`` and ``--large-mb`` (generated on
disk: rendered digits, tiled with fresh noise) train the same job (LeNet, 2 workers) for
``--rss-steps`` steps each; every worker's peak resident memory (VmHWM) is sampled while
it runs. ``rss_growth`` = max peak on the large set / on the small set − 1 (target ≤ 0.1).

Speed. LeNet on the same ``--n`` MNIST-format samples from in-memory arrays (the built-in
``mnist``), from Parquet and from an image folder of PNGs, side by side in one run,
2 workers, ``--epochs`` epochs; the median wall time of the epochs after the first is
compared.
``epoch_ratio.parquet`` (target ≤ 1.1) and ``epoch_ratio.imagefolder`` are against
in-memory, with each source's per-step breakdown (data wait, gather, forward, backward,
loader speed).

    .venv/bin/python bench/data.py --out bench/results-data.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from dynabatch.actors.workloads.images import generate_mnist

from bench.data_files import write_imagefolder, write_parquet
from bench.report import emit

ROW = 28 * 28 + 8  # bytes per row in the file: pixels and the label


def make_parquet(path: str, mb: float, seed: int = 0, base: int = 20000) -> int:
    """About ``mb`` MB of MNIST-format rows under ``path/train`` (one file per ~256 MB) and
    a 2,000-row ``path/test``; returns the training rows."""
    n = int(mb * 1e6 / ROW)
    xb, yb, xt, yt = generate_mnist(min(base, n), 2000, seed)
    rng = np.random.default_rng(seed)
    per_file = max(1, int(256e6 / ROW))
    done, k = 0, 0
    while done < n:
        m = min(per_file, n - done)
        idx = rng.integers(0, len(yb), m)
        x = xb[idx]
        noise = rng.integers(0, 24, x.shape, dtype=np.uint8)
        x = np.where(x > 230, x, np.minimum(x.astype(np.uint16) + noise, 255).astype(np.uint8))
        write_parquet(f"{path}/train/chunk{k:03d}", x, yb[idx], row_group_size=1024)
        done, k = done + m, k + 1
    write_parquet(f"{path}/test", xt, yt, row_group_size=1024)
    return n


def _spec(dataset: dict, epochs: int, **kw: Any):
    from dynabatch.actors.spec import JobSpec

    base = dict(name="data-bench", dataset=dataset, model={"name": "lenet"},
                optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9}, workers=2,
                worker_cpus=1, global_batch=128, epochs=epochs, seed=0, policy="static",
                spares=0)
    base.update(kw)
    return JobSpec.model_validate(base)


def _worker_pids() -> set[int]:
    """The pids of this machine's dynabatch worker actors (their title is ray::Worker)."""
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if f.read(11) == b"ray::Worker":
                        out.add(int(d))
            except OSError:
                continue
    return out


def _hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_run(path: str, steps: int) -> dict[str, Any]:
    """Train on ``path`` for ``steps`` steps, sampling the workers' peak RSS."""
    from dynabatch.scheduler.sync.coordinator import Coordinator

    coord = Coordinator(f"rss-{Path(path).name}", _spec(
        {"name": "parquet", "path": path, "options": {"shape": [1, 28, 28]}}, 1), resume=False)
    peaks: dict[int, int] = {}
    t = threading.Thread(target=coord.run, daemon=True)
    t0 = time.monotonic()
    t.start()
    while t.is_alive():
        for pid in _worker_pids():
            v = _hwm(pid)
            if v:
                peaks[pid] = max(peaks.get(pid, 0), v)
        if coord.step_in_epoch >= steps:
            coord.cancel("bench: enough steps")
            break
        time.sleep(0.2)
    t.join(timeout=120)
    return {"steps": coord.step_in_epoch, "seconds": round(time.monotonic() - t0, 1),
            "peak_rss_mb": sorted(round(v / 2**20, 1) for v in peaks.values())}


def speed_run(name: str, dataset: dict, epochs: int) -> dict[str, Any]:
    from dynabatch.scheduler.sync.coordinator import Coordinator

    coord = Coordinator(f"speed-{name}", _spec(dataset, epochs), resume=False)
    snap = coord.run()
    if snap.state.value != "SUCCEEDED":
        raise SystemExit(f"{name}: {snap.state.value}: {snap.reason}")
    hist = coord.history()
    last = hist[-1]
    walls = [r.wall_s for r in hist[1:]] or [last.wall_s]  # the first epoch warms up
    b = last.breakdown
    ms = {k: round(getattr(b, k) * 1e3, 2) for k in (
        "gather_s", "data_wait_s", "forward_s", "backward_s", "allreduce_wait_s",
        "optimizer_s", "coordinator_s", "evaluation_s")} if b else {}
    return {"epoch_s": round(float(np.median(walls)), 3), "steps": last.steps,
            "test_accuracy": snap.test_accuracy, "ms_per_step": ms,
            "loader_samples_per_s": round(b.loader_rate) if b and b.loader_rate else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small-mb", type=float, default=200)
    ap.add_argument("--large-mb", type=float, default=2000)
    ap.add_argument("--rss-steps", type=int, default=60)
    ap.add_argument("--n", type=int, default=12000, help="samples in the speed comparison")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to generate (default: a temp dir)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import ray

    root = args.dir or tempfile.mkdtemp(prefix="dynabatch-data-")
    result: dict[str, Any] = {"machine": f"{os.cpu_count()} cores, shared",
                              "note": "2 workers on one machine (local Ray)"}
    for attempt in range(3):  # a loaded shared machine can time the raylet's start out
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False,
                     object_store_memory=200 * 2**20, log_to_driver=False)
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    try:
        if not args.skip_rss:
            sets = {}
            for label, mb in (("small", args.small_mb), ("large", args.large_mb)):
                t0 = time.monotonic()
                n = make_parquet(f"{root}/{label}", mb)
                size = sum(f.stat().st_size for f in Path(root, label).rglob("*.parquet"))
                sets[label] = {"rows": n, "bytes_on_disk": size,
                               "generate_s": round(time.monotonic() - t0, 1),
                               **rss_run(f"{root}/{label}", args.rss_steps)}
            result["rss"] = sets
            small = max(sets["small"]["peak_rss_mb"])
            large = max(sets["large"]["peak_rss_mb"])
            result["rss_growth"] = round(large / small - 1, 4)
        x, y, xt, yt = generate_mnist(args.n, 2000, 0)
        write_parquet(f"{root}/speed/pq/train", x, y, row_group_size=1024)
        write_parquet(f"{root}/speed/pq/test", xt, yt, row_group_size=1024)
        t0 = time.monotonic()
        write_imagefolder(f"{root}/speed/img/train", x, y)
        write_imagefolder(f"{root}/speed/img/test", xt, yt)
        result["imagefolder_write_s"] = round(time.monotonic() - t0, 1)
        runs = {
            "in_memory": speed_run("memory", {"name": "mnist", "options": {
                "n_train": args.n, "n_test": 2000}}, args.epochs),
            "parquet": speed_run("parquet", {"name": "parquet", "path": f"{root}/speed/pq",
                                             "options": {"shape": [1, 28, 28]}}, args.epochs),
            "imagefolder": speed_run("imagefolder", {"name": "imagefolder",
                                                     "path": f"{root}/speed/img"}, args.epochs),
        }
        result["speed"] = runs
        base = runs["in_memory"]["epoch_s"]
        result["epoch_ratio"] = {k: round(runs[k]["epoch_s"] / base, 3)
                                 for k in ("parquet", "imagefolder")}
    finally:
        ray.shutdown()
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    emit(result, args.out)


if __name__ == "__main__":
    main()

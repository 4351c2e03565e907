"""Can the loader feed a GPU? Samples per second and data wait per step, default threads
against one (issue 30, item 6).

A worker's :class:`~dynabatch.actors.data.loader.Loader` reads the shares of its planned
steps ahead, with staging buffers as on a GPU node (page-locked there; here ordinary
memory, the same code path). Two sources:

* ``parquet``: a locally written Parquet set of CIFAR-sized uint8 images (3x32x32, row
  groups of 1024), read in the block order a worker trains;
* ``map_style``: an in-memory map-style dataset whose ``__getitem__`` converts one uint8
  image to float32 (Python per sample, as a user's ``Dataset`` is): with more than one
  reader, read by that many reader processes.

For each, at the default thread count (:func:`~dynabatch.actors.data.loader.default_threads`
of ``--worker-cpus``) and at 1 thread:

* ``samples_per_s``: the feed alone, steps taking no time;
* ``data_wait_per_step_ms``: the time a step blocks for its batch when each step takes
  ``--step-ms`` (a device step: the host thread sleeps, as it waits on a GPU);

and the ratios default / one thread side by side. Prints one JSON object; ``--out`` writes
it too.

    .venv/bin/python bench/loader_feed.py --out bench/results-loader-feed.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynabatch.actors.data.loader import Loader, default_threads
from dynabatch.actors.data.source import Source


def feed(
    source: Source,
    threads: int,
    batch: int,
    steps: int,
    step_s: float,
    device: torch.device | None = None,
    segment: int = 8,
    depth: int = 4,
    step: Any = None,
    opener: Any = None,
) -> dict[str, float]:
    """Train-like reading of ``steps`` shares of ``batch`` from ``source``: each segment of
    ``segment`` steps is planned ahead (as a worker plans it), each step gathers its share
    then takes ``step_s`` (or runs ``step(x, y)``); ``opener`` as the loader's. The reader
    processes of a map-style source start before the clock does. Returns samples per second over the
    whole run, the mean data wait per step, and the step's own mean seconds."""
    device = device or torch.device("cpu")
    loader = Loader(
        source, device, seed=0, depth=depth, threads=threads, staging=True, opener=opener
    )
    loader.start()  # reader processes start as a worker starts them: before its first step
    n = len(source)
    block = max(1, source.block)
    order = np.random.default_rng(0).permutation(-(-n // block))
    order = (order[:, None] * block + np.arange(block)[None, :]).ravel()
    order = order[order < n]
    per_epoch = n // batch
    loader.set_order(0, order, 0)
    loader.take_stats()
    waited = took = 0.0
    t0 = time.perf_counter()
    for k in range(steps):
        s = k % per_epoch
        if k % segment == 0:
            ahead = [
                ((j % per_epoch) * batch, (j % per_epoch) * batch + batch)
                for j in range(k, k + segment + 1)
            ]
            loader.plan(ahead)
        x, y = loader.gather(s * batch, s * batch + batch)
        t1 = time.perf_counter()
        if step is not None:
            step(x, y)
        elif step_s > 0:
            time.sleep(step_s)
        took += time.perf_counter() - t1
        waited += loader.take_stats()[0]
    wall = time.perf_counter() - t0
    loader.close()
    return {
        "samples_per_s": round(steps * batch / wall, 1),
        "data_wait_per_step_ms": round(1e3 * waited / steps, 3),
        "step_ms": round(1e3 * took / steps, 3),
    }


class ImageDataset:
    """A map-style dataset of uint8 images: ``__getitem__`` scales one to float32."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.x[i].astype(np.float32) * np.float32(1 / 255), int(self.y[i])


def open_images(n: int) -> Source:
    """The map-style source of :func:`images` (a picklable recipe: reader processes)."""
    from dynabatch.actors.data.mapstyle import MapSource

    return MapSource(ImageDataset(*images(n)), "bench", num_classes=10)


def images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, n)


def side_by_side(make: Any, threads: int, batch: int, steps: int, step_s: float) -> dict[str, Any]:
    """One source (fresh from ``make()`` for each run, so caches start cold; also the
    recipe of reader processes) at ``threads`` readers and at 1, with the ratios."""
    out: dict[str, Any] = {}
    for label, k in ((f"default_{threads}_threads", threads), ("1_thread", 1)):
        rate = feed(make(), k, batch, steps, 0.0, opener=make)["samples_per_s"]
        paced = feed(make(), k, batch, steps, step_s, opener=make)
        out[label] = {"samples_per_s": rate, **paced}
    d, one = out[f"default_{threads}_threads"], out["1_thread"]
    out["rate_ratio"] = round(d["samples_per_s"] / one["samples_per_s"], 2)
    out["wait_ratio"] = (
        round(d["data_wait_per_step_ms"] / one["data_wait_per_step_ms"], 3)
        if one["data_wait_per_step_ms"] > 0
        else None
    )
    return out


def main(argv: list[str] | None = None) -> int:
    from functools import partial

    from dynabatch.actors.data.arrow import ParquetSource

    from bench.data_files import write_parquet
    from bench.report import emit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768, help="samples in each set")
    ap.add_argument("--batch", type=int, default=256, help="one step's share")
    ap.add_argument("--steps", type=int, default=96, help="steps per measurement")
    ap.add_argument("--step-ms", type=float, default=20.0, help="a step's device time")
    ap.add_argument(
        "--worker-cpus",
        type=float,
        default=float(os.cpu_count() or 1),
        help="CPUs given to the worker (sets the default thread count)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    threads = default_threads(args.worker_cpus)
    x, y = images(args.n)
    res: dict[str, Any] = {
        "machine": f"{os.cpu_count()} cores",
        "torch": torch.__version__,
        "worker_cpus": args.worker_cpus,
        "default_threads": threads,
        "batch": args.batch,
        "steps": args.steps,
        "step_ms": args.step_ms,
        "n": args.n,
        # Readers only help where CPUs are idle: a loaded machine's figures say little.
        "load_average_before": round(os.getloadavg()[0], 1),
    }
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_parquet(tmp, x, y, row_group_size=1024)
        res["parquet_write_s"] = round(time.perf_counter() - t0, 1)
        opts = {"shape": [3, 32, 32]}
        res["parquet"] = side_by_side(
            lambda: ParquetSource(tmp, opts), threads, args.batch, args.steps, args.step_ms / 1e3
        )
    res["map_style"] = side_by_side(
        partial(open_images, args.n), threads, args.batch, args.steps, args.step_ms / 1e3
    )
    res["load_average_after"] = round(os.getloadavg()[0], 1)
    emit(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The loader's feed (actors/data/loader.py): a share is read once, straight into a reused
staging buffer (page-locked on a GPU node, so its copy to the device is asynchronous), the
default number of readers follows the CPUs given to the worker, and a map-style dataset
(Python per sample, holding the GIL) is read by worker processes.

Pinned memory needs a GPU: the CPU tests run the same staging path with ordinary buffers
(``staging=True``); the GPU test checks the buffers are page-locked and the batches right.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from dynabatch.actors.data.loader import MAX_THREADS, Loader, default_threads
from dynabatch.actors.data.mapstyle import MapSource
from dynabatch.actors.data.source import ArraySource, DataError, Meta, SampleError
from dynabatch.actors.spec import DatasetSpec


class _Recording(ArraySource):
    """An in-memory source that records the buffers it was asked to write into."""

    def __init__(self, n: int = 200, bad: int | None = None):
        x = np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3)
        y = np.arange(n, dtype=np.int64) * 7
        super().__init__(x, y, Meta("rec", (2, 3), 10))
        self.outs: list[tuple[np.ndarray, np.ndarray] | None] = []
        self.bad = bad

    def read(self, ids, keys=None, out=None):
        self.outs.append(out)
        if self.bad is not None and self.bad in ids:
            raise SampleError(self.bad, "broken")
        return super().read(ids, keys, out)


def _in(t: torch.Tensor, buf: torch.Tensor) -> bool:
    """``t`` lies inside ``buf``'s memory (a view of it, not a copy)."""
    lo = buf.data_ptr()
    return lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= lo + buf.nbytes


def _buffers(loader: Loader) -> list:
    return list(loader.pool._free) + [
        b for b in (loader._last[1][2] if loader._last else None,) if b is not None
    ]


def test_a_share_is_read_once_into_a_reused_staging_buffer():
    src = _Recording()
    order = np.random.default_rng(3).permutation(len(src))
    loader = Loader(src, torch.device("cpu"), seed=0, depth=2, threads=2, staging=True)
    loader.set_order("e0", order, 0)
    for k in range(20):  # twenty steps, each share taken in two micro-batches
        lo, hi = 8 * k, 8 * k + 8
        loader.plan([(lo, hi), (hi + 1, hi + 9)])  # the second is never trained: dropped
        mid = (lo + hi) // 2
        for a, b in ((lo, mid), (mid, hi)):
            xb, yb = loader.gather(a, b)
            ids = torch.from_numpy(order[a:b])
            assert torch.equal(xb, torch.from_numpy(src.x)[ids])
            assert torch.equal(yb, torch.from_numpy(src.y)[ids])
            # The batch is a view of the staging buffer the source wrote into: the read
            # was the one host copy (no second copy to pin it).
            last = loader._last[1][2] if loader._last and loader._last[0][1] == b else None
            if last is not None:
                assert _in(xb, last.x) and _in(yb, last.y)
    assert all(out is not None for out in src.outs)  # every read went into a buffer
    # Reused: no more buffers than are ever held at once (the planned reads done, one
    # running per thread, the share being trained), whatever the number of reads.
    assert len(src.outs) >= 20
    assert loader.pool.allocated <= loader.depth + loader.threads + 1
    loader.close()


def test_a_failed_read_gives_its_buffer_back_and_names_the_position():
    src = _Recording(bad=5)
    loader = Loader(src, torch.device("cpu"), seed=0, staging=True)
    loader.set_order("e0", np.arange(len(src)), 0)
    with pytest.raises(DataError, match=r"sample 5 \(epoch 0, order position 5\): broken"):
        loader.gather(0, 10)
    assert loader.pool.allocated == 1 and len(loader.pool._free) == 1
    loader.close()


def test_without_staging_a_cpu_loader_returns_the_source_arrays():
    src = _Recording()
    loader = Loader(src, torch.device("cpu"), seed=0)
    assert loader.pool is None
    loader.set_order("e0", np.arange(len(src)), 0)
    xb, _ = loader.gather(0, 4)
    assert src.outs == [None] and torch.equal(xb, torch.from_numpy(src.x[:4]))
    loader.close()


def test_the_default_threads_follow_the_worker_cpus():
    assert DatasetSpec().loader_threads is None  # not a constant: chosen per worker
    assert default_threads(0.5) == 1 and default_threads(1) == 1
    assert default_threads(6) == 6 and default_threads(6.7) == 6
    assert default_threads(128) == MAX_THREADS


def test_parquet_read_by_many_threads_is_the_same_as_by_one(tmp_path):
    """Threads read row groups at once (a file handle each, one decode per group): the
    batches are those one thread reads."""
    from dynabatch.actors.data.arrow import ParquetSource
    from dynabatch.actors.data.order import block_order

    from bench.data_files import write_parquet

    rng = np.random.default_rng(0)
    write_parquet(
        str(tmp_path),
        rng.integers(0, 256, (700, 4, 4), dtype=np.uint8),
        rng.integers(0, 5, 700),
        row_group_size=50,
        rows_per_file=300,
    )
    ranges = [(k, k + 35) for k in range(0, 700, 35)]
    got = []
    for threads in (1, 4):
        src = ParquetSource(str(tmp_path), {"cache_groups": 3})
        ld = Loader(src, torch.device("cpu"), seed=0, depth=8, threads=threads, staging=True)
        ld.set_order("e", block_order(1, 0, len(src), src.block), 0)
        ld.plan(ranges)
        got.append([tuple(t.clone() for t in ld.gather(a, b)) for a, b in ranges])
        ld.close()
    for (xa, ya), (xb, yb) in zip(*got, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


class _Noisy:
    """A map-style dataset: sample i is (i, a draw from numpy's global RNG, the reading
    process's id); sample 13 raises."""

    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int):
        if i == 13:
            raise KeyError("thirteen")
        return np.array([i, np.random.random(), os.getpid()], np.float32), i % 3


def _open_noisy() -> MapSource:
    return MapSource(_Noisy(), "noisy", num_classes=3)


def test_a_map_style_dataset_is_read_by_worker_processes():
    """With more than one reader, a GIL-bound source's shares are split across reader
    processes (opened from the recipe): the same samples and augmentation draws (seeded
    per position) as a read in the worker, into the staging buffer; a bad sample still
    names its position."""
    order = np.random.default_rng(1).permutation(60)
    order = order[order != 13]
    ref = Loader(_open_noisy(), torch.device("cpu"), seed=4)
    procs = Loader(
        _open_noisy(), torch.device("cpu"), seed=4, threads=2, staging=True, opener=_open_noisy
    )
    assert ref._procs is None and procs._procs is not None
    try:
        for ld in (ref, procs):
            ld.set_order("e0", order, 2)
        procs.plan([(0, 20), (20, 40)])
        for lo, hi in ((0, 20), (20, 40)):
            xa, ya = ref.gather(lo, hi)
            xb, yb = procs.gather(lo, hi)
            assert torch.equal(xa[:, :2], xb[:, :2]) and torch.equal(ya, yb)
            assert set(xb[:, 2].tolist()) - {float(os.getpid())}  # read elsewhere
            assert xb.data_ptr() == procs._last[1][2].x.data_ptr()  # into the buffer
        procs.set_order("e1", np.arange(60), 0)
        with pytest.raises(
            DataError,
            match=r"sample 13 \(epoch 0, order position 13\): "
            r"__getitem__ raised KeyError",
        ):
            procs.gather(10, 20)
    finally:
        ref.close()
        procs.close()


_PARENT = """
import time, torch
from dynabatch.actors.data.loader import Loader
from tests.unit.test_loader_staging import _open_noisy
ld = Loader(_open_noisy(), torch.device("cpu"), seed=0, threads=2, opener=_open_noisy)
ld.start()
print(*[p.pid for p in ld._procs._processes.values()], flush=True)
time.sleep(600)
"""


def test_reader_processes_exit_when_their_worker_dies():
    """A worker killed outright (a lost node, ray.kill) leaves no reader behind."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], cwd=root, stdout=subprocess.PIPE, text=True
    )
    try:
        kids = [int(p) for p in parent.stdout.readline().split()]
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert len(kids) == 2

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 60  # a bound for a loaded machine, not a measurement
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [k for k in kids if alive(k)]
    for k in left:  # do not leak them from a failing run either
        os.kill(k, signal.SIGKILL)
    assert not left


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_staging_on_a_gpu_is_page_locked_and_reused():
    src = _Recording()
    order = np.random.default_rng(3).permutation(len(src))
    loader = Loader(src, torch.device("cuda", 0), seed=0, depth=2, threads=2)
    loader.set_order("e0", order, 0)
    outs = []
    for k in range(20):
        lo, hi = 9 * k, 9 * k + 9
        loader.plan([(lo, hi), (hi, hi + 9)])
        outs.append((lo, hi, *loader.gather(lo, hi)))
    torch.cuda.synchronize()
    for lo, hi, xb, yb in outs:
        ids = torch.from_numpy(order[lo:hi])
        assert xb.is_cuda and torch.equal(xb.cpu(), torch.from_numpy(src.x)[ids])
        assert torch.equal(yb.cpu(), torch.from_numpy(src.y)[ids])
    assert all(b.x.is_pinned() and b.y.is_pinned() for b in _buffers(loader))
    assert loader.pool.allocated <= loader.depth + loader.threads + 1
    loader.close()

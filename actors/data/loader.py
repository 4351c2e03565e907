"""A worker's loader: reads the order positions it will train, ahead of time.

The worker gives the loader the epoch's order (:meth:`Loader.set_order`) and, each segment,
the share ranges of its planned steps (:meth:`Loader.plan`); reader threads, or processes for
a GIL-bound map-style source, read them into a bounded queue, and the time a step's gather
blocks is its *data wait*. Readers and staging: docs/spec.md ("Data read by position").

A read that raises fails the step that gathers it, with the field, the sample, its order
position and the cause's first line (:class:`~dynabatch.actors.data.source.DataError`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import torch
from dynabatch.actors.batch import Tree, rows, to_device
from dynabatch.actors.data.source import (
    DataError,
    SampleError,
    Source,
    augment_keys,
    batch_arrays,
)
from dynabatch.actors.errors import first_line

Range = tuple[int, int]
# (x, y, its staging buffer): x and y tensors, or dicts or tuples of them (structured).
Batch = tuple[Tree, Tree, "_Buffer | None"]
MAX_THREADS = 16  # more threads than this contend on one source's caches and files


def default_threads(worker_cpus: float) -> int:
    """The loader's threads when ``dataset.loader_threads`` is not set: one per CPU given to
    the worker (``worker_cpus``, at least one, at most :data:`MAX_THREADS`). Reads release
    the GIL, so they use those CPUs; a GPU worker's own thread mostly waits on the device."""
    return max(1, min(MAX_THREADS, int(worker_cpus)))


_CHILD: Source | None = None  # a reader process's own view of the source


def _child_open(opener: Callable[[], Source]) -> None:
    global _CHILD
    # A reader outlives no worker: when the worker dies (a lost node, a killed actor) its
    # end of the parent's sentinel closes, and the reader exits.
    parent = multiprocessing.parent_process()
    if parent is not None:
        def orphaned() -> None:
            multiprocessing.connection.wait([parent.sentinel])
            os._exit(0)

        threading.Thread(target=orphaned, daemon=True, name="dynabatch-orphan").start()
    _CHILD = opener()
    # One sample read at start-up, so the imports its reading needs (torch, for the
    # augmentation's seeding) and the dataset's lazy set-up are not the first share's cost.
    # A bad sample 0 fails the step that trains it instead, with its position.
    with contextlib.suppress(DataError):
        one = np.zeros(1, dtype=np.int64)
        _CHILD.read(one, one)


def _child_read(ids: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _CHILD.read(ids, keys)


def _child_samples(ids: np.ndarray, keys: np.ndarray) -> list[object]:
    return _CHILD.read_samples(ids, keys)


class _Buffer:
    """One staging buffer pair of ``rows`` samples shaped like ``x`` and ``y``'s (page-locked
    on a GPU node: allocated once, reused for many shares, so pinning's cost is paid once)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, rows: int, pin: bool):
        self.x = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, pin_memory=pin)
        self.y = torch.empty((rows, *y.shape[1:]), dtype=y.dtype, pin_memory=pin)
        self.copied: torch.cuda.Event | None = None  # recorded after its last device copy

    @property
    def rows(self) -> int:
        return self.x.shape[0]


class StagingPool:
    """Reused staging buffers for samples shaped like ``x`` and ``y``'s rows. ``take(rows)``
    hands out a free buffer of at least ``rows`` (waiting for its last device copy), else a
    new one, grown geometrically since shares change size; ``give`` returns one. At most
    ``keep`` free buffers are kept."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, pin: bool, keep: int):
        self.x, self.y, self.pin, self.keep = x, y, pin, keep
        self._free: list[_Buffer] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers created (tests: reuse means this stays small)

    def take(self, rows: int) -> _Buffer:
        with self._lock:
            fits = [b for b in self._free if b.rows >= rows]
            buf = min(fits, key=lambda b: b.rows) if fits else None
            if buf is not None:
                self._free.remove(buf)
            elif self._free:  # none large enough: replace the largest with a larger one
                rows = max(rows, 2 * self._free.pop(
                    max(range(len(self._free)), key=lambda i: self._free[i].rows)).rows)
            if buf is None:
                self.allocated += 1
        if buf is None:
            return _Buffer(self.x, self.y, rows, self.pin)
        if buf.copied is not None:
            buf.copied.synchronize()  # the device's copies out of it are done
            buf.copied = None
        return buf

    def give(self, buf: _Buffer) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.keep:
                self._free.remove(min(self._free, key=lambda b: b.rows))


class Loader:
    def __init__(self, source: Source, device: torch.device, seed: int, depth: int = 4,
                 threads: int = 1, staging: bool | None = None,
                 opener: Callable[[], Source] | None = None):
        """``threads``: parallel readers. ``staging``: read into reused buffers (default:
        on a CUDA device, where they are page-locked; tests turn it on for the CPU, where
        they are ordinary memory). ``opener``: a picklable recipe of the source (the
        worker's DataRef), with which reader processes open their own view of a GIL-bound
        source when ``threads`` > 1."""
        self.source, self.device, self.seed = source, device, seed
        self.depth = max(1, depth)
        cuda = device.type == "cuda"
        self.threads = max(1, threads)
        # At most this many buffers are ever held at once: the planned reads done
        # (``depth``), the reads running (one per thread, dropped ones included) and the
        # share being trained; keeping as many free means a new one only for a larger share.
        # A structured source's shares are tensors collated per share: no fixed-shape buffer.
        self.structured = source.meta.structured
        self.pool = StagingPool(*map(torch.from_numpy, batch_arrays(source.meta, 0)), pin=cuda,
                                keep=self.depth + self.threads + 1) \
            if (cuda if staging is None else staging) and not self.structured else None
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dynabatch-data")
        # spawn, not fork: the worker has threads (and maybe CUDA) that a fork would copy
        # half-way. Started by start() (the worker calls it as it is built) or a first read.
        self._procs = ProcessPoolExecutor(
            self.threads, mp_context=multiprocessing.get_context("spawn"),
            initializer=_child_open, initargs=(opener,),
        ) if opener is not None and self.threads > 1 and source.gil_bound else None
        self._order: np.ndarray | None = None
        self._key: object = None
        self._epoch = 0
        self._inflight: OrderedDict[Range, Future] = OrderedDict()
        self._queue: deque[Range] = deque()
        self._last: tuple[Range, Batch] | None = None
        self._stats = threading.Lock()
        self.wait_s = 0.0  # blocked in gather since take_stats
        self.read_s = 0.0  # the threads' time reading, since take_stats
        self.read_n = 0  # samples read, since take_stats

    # --- planning ----------------------------------------------------------------------
    def set_order(self, key: object, order: np.ndarray, epoch: int = 0) -> None:
        """Train ``order`` (sample ids by position) of ``epoch`` until another key."""
        if key == self._key:
            return
        self._drop_all()
        self._order, self._key, self._epoch = order, key, epoch

    def plan(self, ranges: Sequence[Range]) -> None:
        """The share ranges coming next, in order: read ahead; drop what is not planned."""
        want = [(int(a), int(b)) for a, b in ranges if b > a]
        keep = set(want)
        for r in [r for r in self._inflight if r not in keep]:
            self._drop(self._inflight.pop(r))
        self._queue = deque(r for r in want if r not in self._inflight)
        self._fill()

    def _drop_all(self) -> None:
        for f in self._inflight.values():
            self._drop(f)
        self._inflight.clear()
        self._queue.clear()
        self._set_last(None)

    def _drop(self, fut: Future) -> None:
        """A read no longer planned: cancelled, or its buffer back to the pool once read."""
        if not fut.cancel() and self.pool is not None:
            fut.add_done_callback(self._recycle)

    def _recycle(self, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is None and fut.result()[2] is not None:
            self.pool.give(fut.result()[2])

    def _set_last(self, last: tuple[Range, Batch] | None) -> None:
        """The share micro-batches are being taken from; the one before it is consumed,
        so its buffer goes back (after the device copies recorded on it)."""
        old, self._last = self._last, last
        if old is not None and old[1][2] is not None and (
                last is None or old[1][2] is not last[1][2]):
            self.pool.give(old[1][2])

    def _fill(self) -> None:
        while self._queue and len(self._inflight) < self.depth:
            r = self._queue.popleft()
            self._inflight[r] = self._pool.submit(self._read, r, self._order, self._epoch)

    # --- reading -----------------------------------------------------------------------
    def _read(self, r: Range, order: np.ndarray, epoch: int) -> Batch:
        t0 = time.perf_counter()
        lo, hi = r
        ids = order[lo:hi]
        keys = augment_keys(self.seed, epoch, np.arange(lo, hi))
        buf = self.pool.take(hi - lo) if self.pool is not None else None
        try:
            if self.structured and self._procs is not None:  # the share collated as a whole
                parts = self._in_processes(_child_samples, ids, keys)
                xb, yb = self.source.collate([s for _, got in parts for s in got], ids)
            elif self.structured:
                xb, yb = self.source.read(ids, keys)
            elif self._procs is not None:
                x, y = (batch_arrays(self.source.meta, hi - lo) if buf is None
                        else (buf.x[:hi - lo].numpy(), buf.y[:hi - lo].numpy()))
                for p, (px, py) in self._in_processes(_child_read, ids, keys):
                    x[p[0]:p[-1] + 1], y[p[0]:p[-1] + 1] = px, py
                xb, yb = torch.from_numpy(x), torch.from_numpy(y)
            elif buf is None:
                x, y = self.source.read(ids, keys)
                xb, yb = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(
                    np.ascontiguousarray(y))
            else:  # straight into the staging buffer: the batch's one host copy
                xb, yb = buf.x[:hi - lo], buf.y[:hi - lo]
                self.source.read(ids, keys, (xb.numpy(), yb.numpy()))
        except BaseException as err:
            if buf is not None:
                self.pool.give(buf)
            if isinstance(err, SampleError):
                where = np.flatnonzero(ids == err.sample)
                pos = lo + int(where[0]) if len(where) else "?"
                raise DataError(f"{self.source.field}: sample {err.sample} (epoch {epoch}, "
                                f"order position {pos}): {err.problem}") from err
            if isinstance(err, DataError) or not isinstance(err, Exception):
                raise
            raise DataError(f"{self.source.field}: reading positions {lo}..{hi - 1} of epoch "
                            f"{epoch} failed: {first_line(err)}") from err
        with self._stats:
            self.read_s += time.perf_counter() - t0
            self.read_n += hi - lo
        return xb, yb, buf

    def start(self) -> None:
        """Start the reader processes now (a worker does it as it is built), so their
        start-up is not the first step's data wait. No-op for thread readers."""
        if self._procs is not None:
            none = np.zeros(0, dtype=np.int64)
            for fut in [self._procs.submit(_child_read, none, none)
                        for _ in range(self.threads)]:
                fut.result()

    def _in_processes(self, fn: Callable[[np.ndarray, np.ndarray], object], ids: np.ndarray,
                      keys: np.ndarray) -> list[tuple[np.ndarray, object]]:
        """A share split across the reader processes: ``(positions in the share, fn of
        their ids)`` per part, in order."""
        parts = [p for p in np.array_split(np.arange(len(ids)), self.threads) if len(p)]
        futs = [self._procs.submit(fn, ids[p], keys[p]) for p in parts]
        try:
            return [(p, fut.result()) for p, fut in zip(parts, futs, strict=True)]
        finally:
            for fut in futs:
                fut.cancel()

    def gather(self, lo: int, hi: int) -> tuple[Tree, Tree]:
        """The samples at order positions ``[lo, hi)`` on the device: from a planned share
        read ahead (blocking for it if it is not in yet), else read now."""
        t0 = time.perf_counter()
        r, batch = self._find(lo, hi)
        self.wait_s += time.perf_counter() - t0
        xb, yb = rows(batch[0], lo - r[0], hi - r[0]), rows(batch[1], lo - r[0], hi - r[0])
        if self.device.type != "cpu":
            # Asynchronous from page-locked staging; the event keeps the buffer out of the
            # pool's hands until this copy is done.
            xb = to_device(xb, self.device, non_blocking=True)
            yb = to_device(yb, self.device, non_blocking=True)
            if batch[2] is not None and self.device.type == "cuda":
                batch[2].copied = torch.cuda.Event()
                batch[2].copied.record()
        return xb, yb

    def _find(self, lo: int, hi: int) -> tuple[Range, Batch]:
        if self._last is not None and self._last[0][0] <= lo and hi <= self._last[0][1]:
            return self._last
        for r in list(self._inflight):
            if r[0] <= lo and hi <= r[1]:
                fut = self._inflight[r]
                try:
                    batch = fut.result()
                finally:
                    if hi == r[1] or fut.exception() is not None:
                        self._inflight.pop(r, None)
                        self._fill()
                if hi == r[1]:
                    self._set_last((r, batch))
                return r, batch
        batch = self._read((lo, hi), self._order, self._epoch)  # not planned: read now
        self._set_last(((lo, hi), batch))
        return (lo, hi), batch

    def take_stats(self) -> tuple[float, float | None]:
        """(seconds gather blocked, the loader's own samples per second) since the last
        call; the rate is None when nothing was read."""
        with self._stats:
            wait, rate = self.wait_s, (self.read_n / self.read_s if self.read_s > 0 else None)
            self.wait_s = self.read_s = 0.0
            self.read_n = 0
        return wait, rate

    def close(self) -> None:
        self._drop_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._procs is not None:
            self._procs.shutdown(wait=False, cancel_futures=True)
        self.source.close()


def read_batches(source: Source, lo: int, hi: int, batch: int, pool: ThreadPoolExecutor
                 ) -> object:
    """Batches of ``source`` ids ``[lo, hi)`` in order, one read ahead (evaluation: no
    augmentation)."""
    starts = list(range(lo, hi, batch))
    nxt = pool.submit(source.read, np.arange(starts[0], min(starts[0] + batch, hi))) \
        if starts else None
    for k, _s in enumerate(starts):
        cur = nxt
        if k + 1 < len(starts):
            s2 = starts[k + 1]
            nxt = pool.submit(source.read, np.arange(s2, min(s2 + batch, hi)))
        try:
            yield cur.result()
        except SampleError as err:
            raise DataError(f"{source.field}: held-out sample {err.sample}: "
                            f"{err.problem}") from err

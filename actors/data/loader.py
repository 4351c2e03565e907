"""A worker's loader: reads the order positions it will train, ahead of time.

The worker tells the loader the epoch's order (:meth:`Loader.set_order`) and, at the start
of every segment, the share ranges ``[lo, hi)`` of its planned steps (:meth:`Loader.plan`),
plus the range the next step would train if the allocation stays. Background threads read
them (``source.read`` of the ids at those positions, with augmentation keys from (job
seed, epoch, position)) into a bounded queue of ``depth`` shares; on a GPU the batches are
pinned, so their copy to the device is asynchronous. A step's gather takes its share (or
a micro-batch of it) from the queue; the time it blocked is the step's *data wait*, 0 when
the read was hidden. A re-plan or a membership change only changes which ranges are read
next: reads that are no longer planned are dropped.

A read that raises (a ``__getitem__`` error, a corrupt file, a sample of another shape)
fails the step that gathers it, with the field, the sample, its order position and the
cause's first line (:class:`~dynabatch.actors.data.source.DataError`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from dynabatch.actors.data.source import DataError, SampleError, Source, augment_keys
from dynabatch.actors.errors import first_line

Range = tuple[int, int]


class Loader:
    def __init__(self, source: Source, device: torch.device, seed: int, depth: int = 4,
                 threads: int = 1):
        self.source, self.device, self.seed = source, device, seed
        self.depth = max(1, depth)
        self.pin = device.type == "cuda"
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="dynabatch-data")
        self._order: np.ndarray | None = None
        self._key: object = None
        self._epoch = 0
        self._inflight: OrderedDict[Range, Future] = OrderedDict()
        self._queue: deque[Range] = deque()
        self._last: tuple[Range, tuple[torch.Tensor, torch.Tensor]] | None = None
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
            self._inflight.pop(r).cancel()
        self._queue = deque(r for r in want if r not in self._inflight)
        self._fill()

    def _drop_all(self) -> None:
        for f in self._inflight.values():
            f.cancel()
        self._inflight.clear()
        self._queue.clear()
        self._last = None

    def _fill(self) -> None:
        while self._queue and len(self._inflight) < self.depth:
            r = self._queue.popleft()
            self._inflight[r] = self._pool.submit(self._read, r, self._order, self._epoch)

    # --- reading -----------------------------------------------------------------------
    def _read(self, r: Range, order: np.ndarray, epoch: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        lo, hi = r
        ids = order[lo:hi]
        keys = augment_keys(self.seed, epoch, np.arange(lo, hi))
        try:
            x, y = self.source.read(ids, keys)
        except SampleError as err:
            where = np.flatnonzero(ids == err.sample)
            pos = lo + int(where[0]) if len(where) else "?"
            raise DataError(f"{self.source.field}: sample {err.sample} (epoch {epoch}, order "
                            f"position {pos}): {err.problem}") from err
        except DataError:
            raise
        except Exception as err:
            raise DataError(f"{self.source.field}: reading positions {lo}..{hi - 1} of epoch "
                            f"{epoch} failed: {first_line(err)}") from err
        xb, yb = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(
            np.ascontiguousarray(y))
        if self.pin:
            xb, yb = xb.pin_memory(), yb.pin_memory()
        with self._stats:
            self.read_s += time.perf_counter() - t0
            self.read_n += hi - lo
        return xb, yb

    def gather(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at order positions ``[lo, hi)`` on the device: from a planned share
        read ahead (blocking for it if it is not in yet), else read now."""
        t0 = time.perf_counter()
        r, batch = self._find(lo, hi)
        self.wait_s += time.perf_counter() - t0
        xb, yb = batch[0][lo - r[0]:hi - r[0]], batch[1][lo - r[0]:hi - r[0]]
        if self.device.type != "cpu":
            xb = xb.to(self.device, non_blocking=True)
            yb = yb.to(self.device, non_blocking=True)
        return xb, yb

    def _find(self, lo: int, hi: int) -> tuple[Range, tuple[torch.Tensor, torch.Tensor]]:
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
                    self._last = (r, batch)
                return r, batch
        batch = self._read((lo, hi), self._order, self._epoch)  # not planned: read now
        self._last = ((lo, hi), batch)
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

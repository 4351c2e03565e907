"""The asynchronous ledger: which samples of an epoch were *applied*, exactly once. Pure:
numpy only.

A sample is trained when the gradient that contains it is applied by the server, not when a
learner computed it. The epoch's order positions form a queue of ranges; a learner takes a
chunk, which is then applied or re-queued at the front (its gradient refused, or its learner
lost with it in flight). :meth:`AsyncLedger.verify` rebuilds the per-position count from the
applied chunks: a problem is reported, never silently fixed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from dynabatch.scheduler.core.ledger import Verification

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Chunk:
    id: int
    epoch: int
    worker: str
    ranges: Ranges  # order positions [lo, hi), in the order they were handed out

    @property
    def samples(self) -> int:
        return sum(hi - lo for lo, hi in self.ranges)


class AsyncLedger:
    def __init__(self) -> None:
        self.epoch: int | None = None
        self.dataset_size = 0
        self._queue: deque[tuple[int, int]] = deque()
        self._out: dict[int, Chunk] = {}
        self._applied: list[Chunk] = []
        self._next_id = 0
        self._retried = 0
        self._problems: list[str] = []

    def begin_epoch(self, epoch: int, dataset_size: int) -> None:
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be at least 1, got {dataset_size}")
        self.epoch = epoch
        self.dataset_size = dataset_size
        self._queue = deque([(0, dataset_size)])
        self._out = {}
        self._applied = []
        self._retried = 0
        self._problems = []

    # --- views ------------------------------------------------------------------------
    @property
    def queued_samples(self) -> int:
        return sum(hi - lo for lo, hi in self._queue)

    @property
    def complete(self) -> bool:
        return self.epoch is not None and not self._queue and not self._out

    # --- events -----------------------------------------------------------------------
    def take(self, worker: str, k: int) -> Chunk | None:
        """The next ``k`` queued positions (fewer at the end of the epoch) for ``worker``;
        None when nothing is queued."""
        if self.epoch is None:
            raise ValueError("begin_epoch first")
        if k < 1:
            raise ValueError(f"a chunk needs at least one sample, got {k}")
        if not self._queue:
            return None
        ranges = []
        while k and self._queue:
            lo, hi = self._queue.popleft()
            take = min(k, hi - lo)
            ranges.append((lo, lo + take))
            if lo + take < hi:
                self._queue.appendleft((lo + take, hi))
            k -= take
        self._next_id += 1
        chunk = Chunk(self._next_id, self.epoch, worker, tuple(ranges))
        self._out[chunk.id] = chunk
        return chunk

    def applied(self, chunk_id: int) -> Chunk | None:
        chunk = self._out.pop(chunk_id, None)
        if chunk is None:
            self._problems.append(f"chunk {chunk_id} applied but not outstanding")
            return None
        self._applied.append(chunk)
        return chunk

    def requeue(self, chunk_id: int) -> Chunk | None:
        """The chunk's gradient will never be applied: its positions go back to the front."""
        chunk = self._out.pop(chunk_id, None)
        if chunk is None:
            self._problems.append(f"chunk {chunk_id} re-queued but not outstanding")
            return None
        self._queue.extendleft(reversed(chunk.ranges))
        self._retried += chunk.samples
        return chunk

    def verify(self) -> Verification:
        n = self.dataset_size
        counts = np.zeros(n, dtype=np.int64)
        problems = list(self._problems)
        by_worker: dict[str, int] = {}
        for c in self._applied:
            for lo, hi in c.ranges:
                if not 0 <= lo < hi <= n:
                    problems.append(f"chunk {c.id}: positions [{lo}, {hi}) outside [0, {n})")
                    continue
                counts[lo:hi] += 1
            by_worker[c.worker] = by_worker.get(c.worker, 0) + c.samples
        if self._out:
            problems.append(f"{len(self._out)} chunks still outstanding")
        return Verification.from_counts(self.epoch, counts, self._retried, problems, by_worker)

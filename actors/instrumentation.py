"""Measurement and fault hooks on a worker, for benchmarks and fault tests only.

Training never calls them: a benchmark calls them on a worker's actor handle (``bench/``
profiles step times and the all-reduce to compute a cluster's best achievable epoch, and
makes a worker hang to test the driver's timeout). They are kept apart from the worker's
training code, in one interface the :class:`~dynabatch.actors.worker.Worker` inherits, so
the training path reads without them; the worker checks only :attr:`stall_s` before a
step's compute.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from dynabatch.actors.emulation import slowdown_at
from dynabatch.actors.step import held


class Instrumentation:
    """The hooks; the worker's data, step math, reducer, clock and device are the host's."""

    # Seconds the next step hangs before its compute (0: none): see :meth:`stall`.
    stall_s: float = 0.0

    data: Any
    math: Any
    reducer: Any
    device: torch.device
    ordinal: int
    spec: Any
    _clock: Any
    _n_params: int

    def stall(self, seconds: float) -> None:
        """Make the next step hang for ``seconds`` before its all-reduce (a hung worker)."""
        self.stall_s = seconds

    def profile(
        self, batches: list[int], repeats: int = 5, wall: bool = False, lockstep: bool = False
    ) -> dict[int, float]:
        """Median compute seconds of one step at each batch size (emulation applied).
        Gradients are computed and discarded; the model is not updated. ``wall``: the wall
        time of the (emulated) step, which is what an epoch pays when workers profiled
        side by side share a machine; otherwise the compute clock's account.
        ``lockstep``: every member profiles at once, with a barrier before each repetition
        (all members pass lists of the same length), so each step is timed while the
        others compute, as in training; the j-th batch of every member's list runs
        together, so members can profile around their own share."""
        out: dict[int, float] = {}
        n = len(self.data)
        rng = np.random.default_rng(self.ordinal)
        for b in batches:
            times = []
            for _ in range(repeats + 1):  # the first run warms caches up
                idx = rng.integers(0, n, size=b)
                if lockstep:
                    dist.barrier()
                t_wall = time.perf_counter()
                self._clock.start()
                self.reducer.zero_()
                xb, yb = self.data.sample(idx)
                self.math.share(held(xb, yb), 0, b, b)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                factor = slowdown_at(self.spec.emulation, self.ordinal, 0, 0)
                took = self._clock.finish(factor)
                times.append(time.perf_counter() - t_wall if wall else took)
            self.reducer.zero_()
            out[b] = float(np.median(times[1:]))
        return out

    def time_allreduce(self, repeats: int = 10) -> float:
        """Median seconds of the gradient all-reduce when every member is ready."""
        times = []
        buf = torch.zeros(self._n_params, device=self.device)
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

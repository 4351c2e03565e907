"""Probes a benchmark runs inside a training worker, through Ray's ``__ray_call__``.

``handle.__ray_call__.remote(fn, *args)`` runs ``fn(worker, *args)`` on the worker actor,
in order with its other calls, so the product's :class:`~dynabatch.actors.worker.Worker`
carries no benchmark or fault-injection code: ``bench/hetero.py`` profiles step times and
the all-reduce to compute a cluster's best achievable epoch; ``bench/faults.py`` makes a
worker hang to test the driver's collective timeout, and it and the fault tests make a
worker raise on every step (:func:`fail_from`; the job spec injects no faults).

    ray.get(handle.__ray_call__.remote(profile, [16, 64], 5, True, True))
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from dynabatch.actors.emulation import slowdown_at
from dynabatch.actors.step import held


def stall(worker: Any, seconds: float) -> None:
    """Make the worker's next step hang for ``seconds`` before its compute (a hung worker).
    Before compute: backward's hooks send the gradient buckets, so a stall after it would
    come after this worker's share of the all-reduce went out."""
    step = worker._step

    def stalled(*args: Any, **kwargs: Any) -> Any:
        del worker._step  # once: the class's step again from the next one
        time.sleep(seconds)
        return step(*args, **kwargs)

    worker._step = stalled


class InjectedFault(RuntimeError):
    """The error :func:`fail_from` makes a worker raise."""


def fail_from(worker: Any, epoch: int, step: int) -> None:
    """Make the worker raise :class:`InjectedFault` in the compute phase of every step from
    (``epoch``, ``step``) on, where a bug in the user's model raises: the worker reports it
    as its own compute error and leaves the group, and the driver retries the step, then
    fails the job with it."""
    take = worker._step

    def failing(e: int, sp: Any, *args: Any, **kwargs: Any) -> Any:
        if (e, sp.step) < (epoch, step):
            return take(e, sp, *args, **kwargs)

        def share(*_args: Any, **_kwargs: Any) -> Any:
            raise InjectedFault(f"injected error at epoch {e} step {sp.step}")

        worker.math.share = share  # this step's forward and backward only
        try:
            return take(e, sp, *args, **kwargs)
        finally:
            del worker.math.share

    worker._step = failing


def fail_when_spawned(runtime: Any, ordinal: int, epoch: int, step: int) -> None:
    """Arm :func:`fail_from` on the worker of ``ordinal`` as the job's Ray runtime spawns
    it: the probe is the worker's next call after its start, before any segment reaches
    it (an actor runs its calls in order)."""
    spawn = runtime.spawn

    def spawned(s: Any) -> None:
        spawn(s)
        if s.ordinal == ordinal:
            runtime._handles[s.worker_id].__ray_call__.remote(fail_from, epoch, step)

    runtime.spawn = spawned


def profile(worker: Any, batches: list[int], repeats: int = 5, wall: bool = False,
            lockstep: bool = False) -> dict[int, float]:
    """Median compute seconds of one step at each batch size (emulation applied).
    Gradients are computed and discarded; the model is not updated. ``wall``: the wall
    time of the (emulated) step, which is what an epoch pays when workers profiled
    side by side share a machine; otherwise the compute clock's account.
    ``lockstep``: every member profiles at once, with a barrier before each repetition
    (all members pass lists of the same length), so each step is timed while the
    others compute, as in training; the j-th batch of every member's list runs
    together, so members can profile around their own share."""
    out: dict[int, float] = {}
    n = len(worker.data)
    rng = np.random.default_rng(worker.ordinal)
    clock, reducer = worker._clock, worker.reducer
    for b in batches:
        times = []
        for _ in range(repeats + 1):  # the first run warms caches up
            idx = rng.integers(0, n, size=b)
            if lockstep:
                dist.barrier()
            t_wall = time.perf_counter()
            clock.start()
            reducer.zero_()
            xb, yb = worker.data.sample(idx)
            worker.math.share(held(xb, yb), 0, b, b)
            if worker.device.type == "cuda":
                torch.cuda.synchronize(worker.device)
            factor = slowdown_at(worker.spec.emulation, worker.ordinal, 0, 0)
            took = clock.finish(factor)
            times.append(time.perf_counter() - t_wall if wall else took)
        reducer.zero_()
        out[b] = float(np.median(times[1:]))
    return out


def time_allreduce(worker: Any, repeats: int = 10) -> float:
    """Median seconds of the gradient all-reduce when every member is ready."""
    times = []
    buf = torch.zeros(worker.reducer.n_params, device=worker.device)
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if worker.device.type == "cuda":
            torch.cuda.synchronize(worker.device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))

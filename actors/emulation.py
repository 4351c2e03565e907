"""Heterogeneity emulation for clusters whose nodes are equal (CI, one laptop).

A worker with slowdown f stretches each compute phase to f × its measured compute, by
sleeping. Disturbances change f from a given epoch and step on. Off unless the job spec
sets it; reports label such runs as emulated.

Emulated nodes usually share one machine's cores (CI has two), so their wall-clock times
depend on each other: a worker preempted by its neighbours looks slow. In emulated runs
compute is therefore measured as the thread's CPU time (on the CPU, torch runs forward
and backward in the calling thread with one intra-op thread), which is what the phase
would take on a core of its own. Real runs use the wall clock.

Where the slowdown is applied. A slow node is slow *before* its gradient leaves: with the
bucketed all-reduce, buckets go out from backward's hooks, so the stretch cannot all come
after backward (a slowed worker's buckets would leave at full speed, and its peers' waits
would not show its slowness). The reducer therefore calls :meth:`ComputeClock.pace` before
it launches a bucket, which sleeps until the phase has taken f × its compute so far, and
:meth:`ComputeClock.finish` sleeps what is left at the end. Every bucket then leaves when
a node f times slower would have sent it.
"""

from __future__ import annotations

import time

from dynabatch.actors.spec import EmulationSpec


def slowdown_at(emulation: EmulationSpec, ordinal: int, epoch: int, step: int) -> float:
    """The slowdown factor of the worker with this ordinal at (epoch, step)."""
    f = emulation.slowdowns[ordinal] if ordinal < len(emulation.slowdowns) else 1.0
    # Later-starting disturbances override earlier ones.
    for d in sorted(emulation.disturbances, key=lambda d: (d.epoch, d.step)):
        if d.worker == ordinal and (epoch, step) >= (d.epoch, d.step):
            f = d.factor
    return f


class ComputeClock:
    """Times one compute phase: wall clock, or thread CPU time when emulating."""

    def __init__(self, emulated: bool):
        self.emulated = emulated
        self._wall0 = self._cpu0 = 0.0
        self.slept = 0.0  # seconds slept for the emulation since start()

    def start(self) -> None:
        self._wall0 = time.perf_counter()
        self._cpu0 = time.thread_time()
        self.slept = 0.0

    def pace(self, factor: float) -> float:
        """Sleep until the phase so far has taken ``factor`` × its compute so far (emulated
        runs only; the calling thread must be the one that started the clock). Returns that
        stretched compute time."""
        wall = time.perf_counter() - self._wall0
        if not self.emulated:
            return wall
        target = factor * (time.thread_time() - self._cpu0)
        if target > wall:
            time.sleep(target - wall)
            self.slept += target - wall
        return target

    def finish(self, factor: float) -> float:
        """End the phase, stretched to ``factor`` × its compute; return the compute time."""
        return self.pace(factor)


def error_at(emulation: EmulationSpec, ordinal: int, epoch: int, step: int) -> bool:
    """Whether the worker with this ordinal has an injected error at (epoch, step)."""
    return any(e.worker == ordinal and (epoch, step) >= (e.epoch, e.step)
               for e in emulation.errors)

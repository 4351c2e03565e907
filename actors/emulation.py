"""Heterogeneity emulation for clusters whose nodes are equal (CI, one laptop).

A worker with slowdown f stretches each compute phase to f × its measured compute, by
sleeping. Disturbances change f from a given epoch and step on. Off unless the job spec
sets it; reports label such runs as emulated.

Emulated nodes usually share one machine's cores (CI has two), so their wall-clock times
depend on each other: a worker preempted by its neighbours looks slow. In emulated runs
compute is therefore measured as the thread's CPU time (on the CPU, torch runs forward
and backward in the calling thread with one intra-op thread), which is what the phase
would take on a core of its own. Real runs use the wall clock.
"""

from __future__ import annotations

import time

from actors.spec import EmulationSpec


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

    def start(self) -> None:
        self._wall0 = time.perf_counter()
        self._cpu0 = time.thread_time()

    def finish(self, factor: float) -> float:
        """End the phase, stretched to ``factor`` × its compute; return the compute time."""
        wall = time.perf_counter() - self._wall0
        if not self.emulated:
            return wall
        target = factor * (time.thread_time() - self._cpu0)
        if target > wall:
            time.sleep(target - wall)
        return target



def error_at(emulation: EmulationSpec, ordinal: int, epoch: int, step: int) -> bool:
    """Whether the worker with this ordinal has an injected error at (epoch, step)."""
    return any(e.worker == ordinal and (epoch, step) >= (e.epoch, e.step)
               for e in emulation.errors)

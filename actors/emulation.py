"""Heterogeneity emulation for clusters whose nodes are equal (CI, one laptop): a worker with
slowdown f stretches each compute phase to f × its measured compute, by sleeping. Which clock
measures compute, and why, and node slowdowns: docs/spec.md ("Heterogeneity emulation"); the
reducer paces each bucket before it leaves (:meth:`ComputeClock.pace`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

from dynabatch.actors.spec import EmulationSpec

# A node's own emulated slowdown, from its environment (``ray start`` or
# ``cluster_utils.Cluster.add_node(env_vars=...)`` sets it on the raylet, whose worker
# processes inherit it). It makes a node slow for whichever job's worker lands there, which a
# per-ordinal slowdown cannot: the cluster scheduler moves jobs between nodes.
NODE_SLOWDOWN_ENV = "DYNABATCH_EMULATED_NODE_SLOWDOWN"


def node_slowdown(environ: Mapping[str, str] = os.environ) -> float:
    """This node's emulated slowdown factor (1.0 when unset). Raises ``ValueError`` naming
    the variable for a value that is not a number in [1, 1000]."""
    raw = environ.get(NODE_SLOWDOWN_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        f = float(raw)
    except ValueError:
        raise ValueError(f"{NODE_SLOWDOWN_ENV}={raw!r}: not a number") from None
    if not 1.0 <= f <= 1000.0:
        raise ValueError(f"{NODE_SLOWDOWN_ENV}={raw!r}: must be between 1 and 1000")
    return f


def slowdown_at(emulation: EmulationSpec, ordinal: int, epoch: int, step: int) -> float:
    """The slowdown factor of the worker with this ordinal at (epoch, step)."""
    f = emulation.slowdowns[ordinal] if ordinal < len(emulation.slowdowns) else 1.0
    # Later-starting disturbances override earlier ones.
    for d in sorted(emulation.disturbances, key=lambda d: (d.epoch, d.step)):
        if d.worker == ordinal and (epoch, step) >= (d.epoch, d.step):
            f = d.factor
    return f


class ComputeClock:
    """Times one compute phase: wall clock, or thread CPU time when emulating on the CPU;
    ``sync`` (a GPU's synchronisation): the wall clock after it, also when emulating."""

    def __init__(self, emulated: bool, sync: Callable[[], object] | None = None):
        self.emulated = emulated
        self.sync = sync
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
        if not self.emulated:
            return time.perf_counter() - self._wall0
        if self.sync is not None:  # a device: its queued work done, the wall clock is it
            self.sync()
            wall = time.perf_counter() - self._wall0
            target = factor * (wall - self.slept)
        else:
            wall = time.perf_counter() - self._wall0
            target = factor * (time.thread_time() - self._cpu0)
        if target > wall:
            time.sleep(target - wall)
            self.slept += target - wall
        return target

    @property
    def cpu_time(self) -> bool:
        """Whether compute is the thread's CPU time (emulating on the CPU), which leaves out
        a wait for data."""
        return self.emulated and self.sync is None

    # End the phase, stretched to ``factor`` × its compute; returns the compute time.
    finish = pace

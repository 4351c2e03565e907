"""Heterogeneity emulation for clusters whose nodes are equal (CI, one laptop).

A worker with slowdown f sleeps (f − 1) × its measured compute after each compute phase,
so its reported compute time is f × the real one. Disturbances change f from a given
epoch and step on. Off unless the job spec sets it; reports label such runs as emulated.
"""

from __future__ import annotations

import time

from service.spec import EmulationSpec


def slowdown_at(emulation: EmulationSpec, ordinal: int, epoch: int, step: int) -> float:
    """The slowdown factor of the worker with this ordinal at (epoch, step)."""
    f = emulation.slowdowns[ordinal] if ordinal < len(emulation.slowdowns) else 1.0
    # Later-starting disturbances override earlier ones.
    for d in sorted(emulation.disturbances, key=lambda d: (d.epoch, d.step)):
        if d.worker == ordinal and (epoch, step) >= (d.epoch, d.step):
            f = d.factor
    return f


def stretch(compute_s: float, factor: float) -> float:
    """Sleep so that a phase that took ``compute_s`` takes ``factor`` times as long."""
    extra = (factor - 1.0) * compute_s
    if extra > 0:
        time.sleep(extra)
    return compute_s + max(extra, 0.0)

"""Allocations: how a global batch and an epoch's samples are split over workers, and the
values a rebalancing policy (:mod:`dynabatch.scheduler.core.sync.policy`) reads and returns.
Pure: no Ray, no torch, no clock.

An :class:`Allocation` splits a global batch B over workers (``batches``, summing to B) and
N samples over them (``partitions``, summing to N): ``ceil(N / B)`` steps of B samples but
the last, which trains the remainder split in proportion to the batches. Step ``s`` trains
``order[s·B : s·B + B_s]``, cut into the workers' shares in worker order, so the sequence of
global batches never depends on the allocation: the same SGD as one process with batch B.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from dynabatch.scheduler.core.sync.steptime import StepTimeStats, round_to_total


@dataclass(frozen=True, slots=True)
class WorkerTelemetry:
    """What the policy knows of one worker.

    ``samples`` and ``compute_s``: the window since the last decision (DBS); ``stats``: the
    decayed (batch, step compute) observations, per micro-batch (affine). ``cap`` bounds
    the batch; ``micro`` caps one micro-batch, not the share (it is accumulated:
    ``steptime.accumulation_slope``); ``capacity``: a resource hint for a worker without
    telemetry. ``slowed``: its last change of speed was a slowdown. ``previous``: (batch,
    mean step compute) of its window under the plan before (DBS's second point). ``se``,
    ``previous_se``: the relative standard errors of both (0: taken as exact).
    """

    worker: str
    batch: int = 0
    samples: int = 0
    compute_s: float = 0.0
    cap: int | None = None
    capacity: float = 1.0
    stats: StepTimeStats = field(default_factory=StepTimeStats)
    micro: int | None = None
    slowed: bool = False
    previous: tuple[int, float] | None = None
    se: float = 0.0
    previous_se: float = 0.0


@dataclass(frozen=True, slots=True)
class Allocation:
    workers: tuple[str, ...]
    batches: tuple[int, ...]
    partitions: tuple[int, ...]
    global_batch: int
    dataset_size: int

    @property
    def steps(self) -> int:
        return math.ceil(self.dataset_size / self.global_batch) if self.dataset_size else 0

    def step_shares(self, step: int) -> tuple[int, ...]:
        """Each worker's number of samples in ``step``; IndexError if out of range."""
        steps = self.steps
        if not 0 <= step < steps:
            raise IndexError(f"step {step} is outside the epoch's {steps} steps")
        if step < steps - 1:
            return self.batches
        full = steps - 1
        return tuple(p - full * b for p, b in zip(self.partitions, self.batches, strict=True))

    def worker_ranges(self, first_step: int, num_steps: int) -> list[list[tuple[int, int]]]:
        """Per worker, the [start, end) offsets into the order for steps in the window."""
        if first_step < 0 or num_steps < 0:
            raise ValueError("first_step and num_steps must be non-negative")
        out: list[list[tuple[int, int]]] = [[] for _ in self.workers]
        for s in range(first_step, min(first_step + num_steps, self.steps)):
            pos = s * self.global_batch
            for i, share in enumerate(self.step_shares(s)):
                out[i].append((pos, pos + share))
                pos += share
        return out


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's verdict, shared by the scheduler actor, its logs and its metrics."""

    allocation: Allocation
    rebalanced: bool
    reason: str
    predicted_step_s: float | None = None
    current_step_s: float | None = None


class Policy(Protocol):
    name: str

    def decide(
        self,
        telemetry: Sequence[WorkerTelemetry],
        global_batch: int,
        dataset_size: int,
        current: Allocation | None = None,
    ) -> Decision: ...


def check_sizes(global_batch: int, dataset_size: int) -> None:
    if global_batch < 1:
        raise ValueError(f"global_batch must be at least 1, got {global_batch}")
    if dataset_size < 0:
        raise ValueError(f"dataset_size must be non-negative, got {dataset_size}")


def make_allocation(
    workers: Sequence[str], batches: np.ndarray, global_batch: int, dataset_size: int
) -> Allocation:
    """Partitions from batches: (steps−1) full steps plus the remainder split ∝ batches."""
    b = np.asarray(batches, dtype=np.int64)
    workers = tuple(workers)
    if b.ndim != 1 or len(b) != len(workers):
        raise ValueError(f"{len(workers)} workers but {b.size} batches")
    check_sizes(global_batch, dataset_size)
    if (b < 0).any():
        raise ValueError("batches must be non-negative")
    if int(b.sum()) != global_batch:
        raise ValueError(f"batches sum to {int(b.sum())}, not global_batch {global_batch}")
    steps = math.ceil(dataset_size / global_batch) if dataset_size else 0
    full = max(steps - 1, 0)
    last = dataset_size - full * global_batch if steps else 0
    if last == global_batch:
        tail = b
    elif last == 0:
        tail = np.zeros_like(b)
    else:
        tail = round_to_total(b * (last / global_batch), last, np.zeros_like(b), b)
    parts = full * b + tail
    return Allocation(
        workers=workers,
        batches=tuple(b.tolist()),
        partitions=tuple(parts.tolist()),
        global_batch=global_batch,
        dataset_size=dataset_size,
    )

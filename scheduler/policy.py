"""Rebalancing policies: telemetry in, allocation out. Pure: no Ray, no torch, no clock.

An :class:`Allocation` splits a global batch ``B`` over workers (``batches``, summing to B
exactly) and ``N`` samples over workers (``partitions``, summing to N exactly). The N
samples take ``steps = ceil(N / B)`` steps: every step but the last trains B samples, and
the last trains the remainder ``r = N − (steps−1)·B``, split in proportion to the batches.
Nothing is dropped.

Step ``s`` trains ``order[s·B : s·B + B_s]`` of the epoch's sample order, cut into the
workers' shares in worker order (:meth:`Allocation.step_shares`). So the sequence of global
batches depends on the order alone, never on the allocation: training is the same SGD as
one process with batch B, whatever the policy decides.

Policies:

* ``static``: equal shares.
* ``dbs`` (Ye et al. 2020): ``share_i ∝ old_share_i / compute_time_i``, i.e. proportional to
  measured throughput ``v_i = samples_i / compute_s_i``, renormalised to B.
* ``affine``: fits ``t_i(b) = a_i + c_i·b`` (see :mod:`scheduler.model`) and solves for
  equal finish times; keeps the current allocation unless the predicted step time improves
  by more than ``min_gain`` (hysteresis), so noise does not churn the plan.

A worker without telemetry yet (a new member) is sized from its ``capacity`` hint, scaled
by the measured speed per unit capacity of the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Literal, Protocol

import numpy as np

from scheduler.model import StepTimeStats, equal_finish, fit_arrays, round_to_total


@dataclass(frozen=True, slots=True)
class WorkerTelemetry:
    """What the policy knows of one worker.

    ``samples`` and ``compute_s`` cover the window since the last decision (for DBS);
    ``stats`` holds the decayed (batch, step compute time) observations (for the affine
    model). ``cap`` bounds the worker's batch (memory); ``capacity`` is a resource hint
    (e.g. CPUs) for a worker that has no telemetry yet.
    """

    worker: str
    batch: int = 0
    samples: int = 0
    compute_s: float = 0.0
    cap: int | None = None
    capacity: float = 1.0
    stats: StepTimeStats = field(default_factory=StepTimeStats)

    @property
    def measured(self) -> bool:
        return self.samples > 0 and self.compute_s > 0.0


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

    def step_batch(self, step: int) -> int:
        """Global batch of ``step`` (the last step may be partial)."""
        if step < self.steps - 1:
            return self.global_batch
        return self.dataset_size - (self.steps - 1) * self.global_batch

    def step_shares(self, step: int) -> tuple[int, ...]:
        """Each worker's number of samples in ``step``."""
        if step < self.steps - 1:
            return self.batches
        full = self.steps - 1
        return tuple(p - full * b for p, b in zip(self.partitions, self.batches, strict=True))

    def worker_ranges(self, first_step: int, num_steps: int) -> list[list[tuple[int, int]]]:
        """Per worker, the [start, end) offsets into the order for steps in the window."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.workers]
        for s in range(first_step, min(first_step + num_steps, self.steps)):
            pos = s * self.global_batch
            for i, share in enumerate(self.step_shares(s)):
                out[i].append((pos, pos + share))
                pos += share
        return out

    def index(self, worker: str) -> int:
        return self.workers.index(worker)


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's verdict, shared by the scheduler actor, its logs and its metrics."""

    allocation: Allocation
    rebalanced: bool
    reason: str
    predicted_step_s: float | None = None
    current_step_s: float | None = None

    @property
    def predicted_gain(self) -> float | None:
        if self.predicted_step_s is None or not self.current_step_s:
            return None
        return 1.0 - self.predicted_step_s / self.current_step_s


class Policy(Protocol):
    name: str

    def decide(
        self,
        telemetry: Sequence[WorkerTelemetry],
        global_batch: int,
        dataset_size: int,
        current: Allocation | None = None,
    ) -> Decision: ...


# --------------------------------------------------------------------------------------
# Shared pieces


def _bounds(telemetry: Sequence[WorkerTelemetry], global_batch: int) -> tuple[np.ndarray, ...]:
    n = len(telemetry)
    if n == 0:
        raise ValueError("no workers to allocate to")
    if n > global_batch:
        raise ValueError(f"global_batch ({global_batch}) is smaller than the {n} workers")
    caps = np.fromiter(
        (global_batch if t.cap is None else min(t.cap, global_batch) for t in telemetry),
        dtype=np.int64, count=n,
    )
    if (caps < 1).any():
        raise ValueError("every worker cap must be at least 1")
    if caps.sum() < global_batch:
        raise ValueError(f"worker caps sum to {caps.sum()}, below global_batch {global_batch}")
    return np.ones(n, dtype=np.int64), caps


def _speeds(telemetry: Sequence[WorkerTelemetry]) -> np.ndarray:
    """Samples per compute-second; unmeasured workers from their capacity hint."""
    n = len(telemetry)
    samples = np.fromiter(map(attrgetter("samples"), telemetry), dtype=np.float64, count=n)
    secs = np.fromiter(map(attrgetter("compute_s"), telemetry), dtype=np.float64, count=n)
    cap = np.fromiter(map(attrgetter("capacity"), telemetry), dtype=np.float64, count=n)
    measured = (samples > 0) & (secs > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(measured, samples / secs, np.nan)
    return _fill_unmeasured(v, measured, cap)


def _fill_unmeasured(v: np.ndarray, measured: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    if measured.all():
        return v
    cap = np.maximum(capacity, 1e-9)
    per_unit = float(np.median(v[measured] / cap[measured])) if measured.any() else 1.0
    return np.where(measured, v, per_unit * cap)


def _split(
    weights: np.ndarray, global_batch: int, lo: np.ndarray, hi: np.ndarray
) -> np.ndarray:
    """Integer batches ∝ weights within bounds, summing to global_batch."""
    w = np.maximum(weights, 1e-12)
    # Proportional split with caps is equal finish under t_i(b) = b / w_i.
    real, _ = equal_finish(np.zeros_like(w), 1.0 / w, float(global_batch), lo.astype(float),
                           hi.astype(float))
    return round_to_total(real, global_batch, lo, hi)


def make_allocation(
    workers: Sequence[str], batches: np.ndarray, global_batch: int, dataset_size: int
) -> Allocation:
    """Partitions from batches: (steps−1) full steps plus the remainder split ∝ batches."""
    b = np.asarray(batches, dtype=np.int64)
    if int(b.sum()) != global_batch:
        raise ValueError(f"batches sum to {int(b.sum())}, not global_batch {global_batch}")
    if dataset_size < 0:
        raise ValueError("dataset_size must be non-negative")
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
        workers=tuple(workers),
        batches=tuple(int(x) for x in b),
        partitions=tuple(int(x) for x in parts),
        global_batch=global_batch,
        dataset_size=dataset_size,
    )


def _same_members(current: Allocation | None, telemetry: Sequence[WorkerTelemetry]) -> bool:
    return current is not None and current.workers == tuple(t.worker for t in telemetry)


def _keep(current: Allocation, global_batch: int, dataset_size: int) -> Allocation:
    return make_allocation(current.workers, np.array(current.batches), global_batch, dataset_size)


# --------------------------------------------------------------------------------------
# Policies


@dataclass(frozen=True)
class StaticPolicy:
    """Equal shares (within caps), whatever the telemetry says."""

    name: Literal["static"] = "static"

    def decide(self, telemetry, global_batch, dataset_size, current=None) -> Decision:
        lo, hi = _bounds(telemetry, global_batch)
        if _same_members(current, telemetry) and current.global_batch == global_batch:
            return Decision(_keep(current, global_batch, dataset_size), False, "static")
        b = _split(np.ones(len(telemetry)), global_batch, lo, hi)
        alloc = make_allocation([t.worker for t in telemetry], b, global_batch, dataset_size)
        return Decision(alloc, current is not None, "equal shares")


@dataclass(frozen=True)
class DBSPolicy:
    """Ye et al.: new share ∝ old share / compute time, i.e. ∝ measured throughput."""

    name: Literal["dbs"] = "dbs"

    def decide(self, telemetry, global_batch, dataset_size, current=None) -> Decision:
        lo, hi = _bounds(telemetry, global_batch)
        if not any(t.measured for t in telemetry):
            if _same_members(current, telemetry):
                return Decision(_keep(current, global_batch, dataset_size), False, "no telemetry")
            cap = np.array([t.capacity for t in telemetry], dtype=float)
            b = _split(cap, global_batch, lo, hi)
            alloc = make_allocation([t.worker for t in telemetry], b, global_batch, dataset_size)
            return Decision(alloc, current is not None, "shares from capacity hints")
        v = _speeds(telemetry)
        b = _split(v, global_batch, lo, hi)
        alloc = make_allocation([t.worker for t in telemetry], b, global_batch, dataset_size)
        changed = current is None or alloc.batches != current.batches or not _same_members(
            current, telemetry)
        return Decision(alloc, changed and current is not None, "shares proportional to throughput")


@dataclass(frozen=True)
class AffinePolicy:
    """Equal finish under the fitted model t_i(b) = a_i + c_i·b, with hysteresis.

    ``min_gain``: keep the current allocation unless the predicted step time falls by more
    than this fraction (changes of membership always re-plan).
    """

    name: Literal["affine"] = "affine"
    min_gain: float = 0.03

    def decide(self, telemetry, global_batch, dataset_size, current=None) -> Decision:
        lo, hi = _bounds(telemetry, global_batch)
        n = len(telemetry)
        g = attrgetter("stats")
        stats = [g(t) for t in telemetry]
        cols = [
            np.fromiter(map(attrgetter(k), stats), dtype=np.float64, count=n)
            for k in ("n", "sb", "st", "sbb", "sbt")
        ]
        a, c = fit_arrays(*cols)
        known = ~np.isnan(c)
        workers = [t.worker for t in telemetry]
        same = _same_members(current, telemetry)
        if not known.any():
            if same:
                return Decision(_keep(current, global_batch, dataset_size), False, "no telemetry")
            cap = np.array([t.capacity for t in telemetry], dtype=float)
            b = _split(cap, global_batch, lo, hi)
            return Decision(make_allocation(workers, b, global_batch, dataset_size),
                            current is not None, "shares from capacity hints")
        if not known.all():
            # New members: per-sample cost from capacity relative to the measured ones,
            # overhead as the median of theirs. Telemetry corrects it after a few steps.
            cap = np.maximum(np.array([t.capacity for t in telemetry], dtype=float), 1e-9)
            per_unit = float(np.median(c[known] * cap[known]))
            c = np.where(known, c, per_unit / cap)
            a = np.where(known, a, float(np.median(a[known])))
        real, _t_new = equal_finish(a, c, float(global_batch), lo.astype(float), hi.astype(float))
        b = round_to_total(real, global_batch, lo, hi)
        predicted = float(np.max(a + c * b))
        if same and current.global_batch == global_batch:
            cur_b = np.array(current.batches, dtype=float)
            current_s = float(np.max(a + c * cur_b))
            if current_s <= 0 or 1.0 - predicted / current_s <= self.min_gain:
                return Decision(_keep(current, global_batch, dataset_size), False,
                                "predicted gain below threshold", predicted, current_s)
            alloc = make_allocation(workers, b, global_batch, dataset_size)
            return Decision(alloc, True, "equal finish under fitted step-time model",
                            predicted, current_s)
        alloc = make_allocation(workers, b, global_batch, dataset_size)
        return Decision(alloc, current is not None, "equal finish under fitted step-time model",
                        predicted, None)


def make_policy(name: str, **options: float) -> Policy:
    if name == "static":
        return StaticPolicy()
    if name == "dbs":
        return DBSPolicy()
    if name == "affine":
        return AffinePolicy(**options)
    raise ValueError(f"unknown policy {name!r}: use static, dbs or affine")

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
* ``affine``: fits ``t_i(b) = a_i + c_i·b`` (see :mod:`dynabatch.scheduler.core.sync.steptime`) and
solves for
  equal finish times; keeps the current allocation unless the predicted step time improves
  by more than ``min_gain`` (hysteresis), so noise does not churn the plan.

A worker without telemetry yet (a new member) is sized from its ``capacity`` hint, scaled
by the measured speed per unit capacity of the others.

Every policy keeps ``current`` (returns it with ``rebalanced=False``) only when the
membership, the global batch and the workers' caps still admit it; otherwise it re-plans.
Cost is O(n) numpy per decision: per-worker Python work is limited to reading the
telemetry fields (a few C-level ``attrgetter`` passes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Literal, Protocol

import numpy as np
from dynabatch.scheduler.core.sync.steptime import (
    StepTimeStats,
    accumulation_slope,
    equal_finish,
    fit_arrays,
    round_to_total,
    shared_overhead_fit,
)


@dataclass(frozen=True, slots=True)
class WorkerTelemetry:
    """What the policy knows of one worker.

    ``samples`` and ``compute_s`` cover the window since the last decision (for DBS);
    ``stats`` holds the decayed (batch, step compute time) observations (for the affine
    model). ``cap`` bounds the worker's batch; ``micro`` is its memory cap on one
    micro-batch, which does not bound the share (it is accumulated, and the affine model
    plans with :func:`dynabatch.scheduler.core.sync.steptime.accumulation_slope`); ``capacity`` is
    a resource
    hint (e.g. CPUs) for a worker that has no telemetry yet. ``stats`` are per
    micro-batch when the worker accumulates.
    """

    worker: str
    batch: int = 0
    samples: int = 0
    compute_s: float = 0.0
    cap: int | None = None
    capacity: float = 1.0
    stats: StepTimeStats = field(default_factory=StepTimeStats)
    micro: int | None = None

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

    def _check_step(self, step: int) -> int:
        steps = self.steps
        if not 0 <= step < steps:
            raise IndexError(f"step {step} is outside the epoch's {steps} steps")
        return steps

    def step_batch(self, step: int) -> int:
        """Global batch of ``step`` (the last step may be partial); IndexError if out of range."""
        steps = self._check_step(step)
        if step < steps - 1:
            return self.global_batch
        return self.dataset_size - (steps - 1) * self.global_batch

    def step_shares(self, step: int) -> tuple[int, ...]:
        """Each worker's number of samples in ``step``; IndexError if out of range."""
        steps = self._check_step(step)
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

_WORKER = attrgetter("worker")
_CAP = attrgetter("cap")
_CAPACITY = attrgetter("capacity")
_SAMPLES = attrgetter("samples")
_COMPUTE = attrgetter("compute_s")
_STATS = attrgetter("stats")
_STAT_FIELDS = attrgetter("n", "sb", "st", "sbb", "sbt")


def _column(telemetry: Sequence[WorkerTelemetry], get: attrgetter, n: int) -> np.ndarray:
    return np.fromiter(map(get, telemetry), dtype=np.float64, count=n)


def _check_sizes(global_batch: int, dataset_size: int) -> None:
    if global_batch < 1:
        raise ValueError(f"global_batch must be at least 1, got {global_batch}")
    if dataset_size < 0:
        raise ValueError(f"dataset_size must be non-negative, got {dataset_size}")


def _bounds(telemetry: Sequence[WorkerTelemetry], global_batch: int) -> tuple[np.ndarray, ...]:
    """(lo, hi) integer batch bounds per worker: 1 and min(cap, global_batch)."""
    n = len(telemetry)
    if n == 0:
        raise ValueError("no workers to allocate to")
    if n > global_batch:
        raise ValueError(f"global_batch ({global_batch}) is smaller than the {n} workers")
    caps = list(map(_CAP, telemetry))
    if caps.count(None) == n:
        hi = np.full(n, global_batch, dtype=np.int64)
    else:
        raw = np.array([global_batch if x is None else x for x in caps], dtype=np.float64)
        raw = np.minimum(np.floor(raw), global_batch)
        if not (raw >= 1).all():  # also rejects NaN
            raise ValueError("every worker cap must be at least 1")
        hi = raw.astype(np.int64)
        if int(hi.sum()) < global_batch:
            raise ValueError(
                f"worker caps sum to {int(hi.sum())}, below global_batch {global_batch}"
            )
    return np.ones(n, dtype=np.int64), hi


def _fill_unmeasured(v: np.ndarray, measured: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    if measured.all():
        return v
    cap = np.maximum(np.nan_to_num(capacity, nan=1.0), 1e-9)
    per_unit = float(np.median(v[measured] / cap[measured])) if measured.any() else 1.0
    return np.where(measured, v, per_unit * cap)


def _speeds(telemetry: Sequence[WorkerTelemetry]) -> tuple[np.ndarray, np.ndarray]:
    """(speed, measured): samples per compute-second, from the capacity hint if unmeasured."""
    n = len(telemetry)
    samples = _column(telemetry, _SAMPLES, n)
    secs = _column(telemetry, _COMPUTE, n)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        v = samples / secs
    measured = (samples > 0) & (secs > 0) & np.isfinite(v)
    if measured.all():
        return v, measured
    return _fill_unmeasured(v, measured, _column(telemetry, _CAPACITY, n)), measured


def _capacity_weights(telemetry: Sequence[WorkerTelemetry]) -> np.ndarray:
    cap = _column(telemetry, _CAPACITY, len(telemetry))
    return np.where(np.isfinite(cap), cap, 1.0)


def _proportional(
    weights: np.ndarray, global_batch: int, lo: np.ndarray, hi: np.ndarray
) -> np.ndarray:
    """Real batches ∝ weights within bounds, summing to global_batch."""
    w = np.clip(weights, 1e-12, 1e12)
    # Proportional split with caps is equal finish under t_i(b) = b / w_i.
    real, _ = equal_finish(np.zeros_like(w), 1.0 / w, float(global_batch), lo, hi)
    return real


def _split(weights: np.ndarray, global_batch: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Integer batches ∝ weights within bounds, summing to global_batch."""
    return round_to_total(_proportional(weights, global_batch, lo, hi), global_batch, lo, hi)


def make_allocation(
    workers: Sequence[str], batches: np.ndarray, global_batch: int, dataset_size: int
) -> Allocation:
    """Partitions from batches: (steps−1) full steps plus the remainder split ∝ batches."""
    b = np.asarray(batches, dtype=np.int64)
    workers = tuple(workers)
    if b.ndim != 1 or len(b) != len(workers):
        raise ValueError(f"{len(workers)} workers but {b.size} batches")
    _check_sizes(global_batch, dataset_size)
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


def _current_batches(
    current: Allocation | None,
    workers: tuple[str, ...],
    global_batch: int,
    lo: np.ndarray,
    hi: np.ndarray,
) -> np.ndarray | None:
    """The current batches if ``current`` can be kept as is (same members, same global
    batch, within every worker's bounds), else None."""
    if current is None or current.workers != workers or current.global_batch != global_batch:
        return None
    cur = np.fromiter(current.batches, dtype=np.int64, count=len(workers))
    if int(cur.sum()) != global_batch or (cur < lo).any() or (cur > hi).any():
        return None
    return cur


def _same_members(current: Allocation | None, telemetry: Sequence[WorkerTelemetry]) -> bool:
    return current is not None and current.workers == tuple(map(_WORKER, telemetry))


def _keep(current: Allocation, global_batch: int, dataset_size: int) -> Allocation:
    if current.global_batch == global_batch and current.dataset_size == dataset_size:
        return current  # frozen: safe to share
    return make_allocation(current.workers, np.array(current.batches), global_batch, dataset_size)


def _replan_reason(current: Allocation | None, workers: tuple[str, ...], global_batch: int) -> str:
    if current is None:
        return ""
    if current.workers != workers:
        return "membership changed; "
    if current.global_batch != global_batch:
        return "global batch changed; "
    return ""


# --------------------------------------------------------------------------------------
# Policies


@dataclass(frozen=True)
class StaticPolicy:
    """Equal shares (within caps), whatever the telemetry says."""

    name: Literal["static"] = "static"

    def decide(self, telemetry, global_batch, dataset_size, current=None) -> Decision:
        _check_sizes(global_batch, dataset_size)
        lo, hi = _bounds(telemetry, global_batch)
        workers = tuple(map(_WORKER, telemetry))
        real = _proportional(np.ones(len(workers)), global_batch, lo, hi)
        cur = _current_batches(current, workers, global_batch, lo, hi)
        # Keep a current plan that already is an equal split (any rounding of it).
        if cur is not None and (np.abs(cur - real) < 1.0).all():
            return Decision(_keep(current, global_batch, dataset_size), False, "static")
        b = round_to_total(real, global_batch, lo, hi)
        alloc = make_allocation(workers, b, global_batch, dataset_size)
        reason = _replan_reason(current, workers, global_batch) + "equal shares"
        return Decision(alloc, current is not None, reason)


@dataclass(frozen=True)
class DBSPolicy:
    """Ye et al.: new share ∝ old share / compute time, i.e. ∝ measured throughput."""

    name: Literal["dbs"] = "dbs"

    def decide(self, telemetry, global_batch, dataset_size, current=None) -> Decision:
        _check_sizes(global_batch, dataset_size)
        lo, hi = _bounds(telemetry, global_batch)
        workers = tuple(map(_WORKER, telemetry))
        v, measured = _speeds(telemetry)
        if not measured.any():
            if _current_batches(current, workers, global_batch, lo, hi) is not None:
                return Decision(_keep(current, global_batch, dataset_size), False, "no telemetry")
            b = _split(_capacity_weights(telemetry), global_batch, lo, hi)
            alloc = make_allocation(workers, b, global_batch, dataset_size)
            reason = _replan_reason(current, workers, global_batch) + "shares from capacity hints"
            return Decision(alloc, current is not None, reason)
        b = _split(v, global_batch, lo, hi)
        alloc = make_allocation(workers, b, global_batch, dataset_size)
        changed = current is None or alloc.batches != current.batches or current.workers != workers
        return Decision(alloc, changed and current is not None, "shares proportional to throughput")


@dataclass(frozen=True)
class AffinePolicy:
    """Equal finish under the fitted model t_i(b) = a_i + c_i·b, with hysteresis.

    ``min_gain``: keep the current allocation unless the predicted step time falls by more
    than this fraction (changes of membership, of the global batch, or caps the current
    plan violates always re-plan).
    """

    name: Literal["affine"] = "affine"
    min_gain: float = 0.05
    # Pool the per-step overhead across workers (see model.shared_overhead_fit); False
    # fits a_i and c_i per worker, better when workers differ in kind (GPU beside CPU).
    shared_overhead: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")

    def decide(self, telemetry, global_batch, dataset_size, current=None) -> Decision:
        _check_sizes(global_batch, dataset_size)
        lo, hi = _bounds(telemetry, global_batch)
        n = len(telemetry)
        workers = tuple(map(_WORKER, telemetry))
        cols = np.fromiter(
            chain.from_iterable(map(_STAT_FIELDS, map(_STATS, telemetry))),
            dtype=np.float64,
            count=5 * n,
        ).reshape(n, 5)
        if self.shared_overhead:
            a, c, _k = shared_overhead_fit(*cols.T, k_max=global_batch / n)
        else:
            a, c = fit_arrays(*cols.T)
        micro = np.array([np.nan if t.micro is None else t.micro for t in telemetry])
        c = accumulation_slope(a, c, micro)
        known = ~np.isnan(c)
        cur = _current_batches(current, workers, global_batch, lo, hi)
        if not known.any():
            if cur is not None:
                return Decision(_keep(current, global_batch, dataset_size), False, "no telemetry")
            b = _split(_capacity_weights(telemetry), global_batch, lo, hi)
            reason = _replan_reason(current, workers, global_batch) + "shares from capacity hints"
            return Decision(
                make_allocation(workers, b, global_batch, dataset_size), current is not None, reason
            )
        if not known.all():
            # New members: per-sample cost from capacity relative to the measured ones,
            # overhead as the median of theirs. Telemetry corrects it after a few steps.
            cap = np.maximum(_capacity_weights(telemetry), 1e-9)
            per_unit = float(np.median(c[known] * cap[known]))
            c = np.where(known, c, per_unit / cap)
            a = np.where(known, a, float(np.median(a[known])))
        real, _t_new = equal_finish(a, c, float(global_batch), lo, hi)
        b = round_to_total(real, global_batch, lo, hi)
        predicted = float(np.max(a + c * b))
        if cur is not None:
            current_s = float(np.max(a + c * cur))
            if current_s <= 0 or 1.0 - predicted / current_s <= self.min_gain:
                return Decision(
                    _keep(current, global_batch, dataset_size),
                    False,
                    "predicted gain below threshold",
                    predicted,
                    current_s,
                )
            alloc = make_allocation(workers, b, global_batch, dataset_size)
            return Decision(
                alloc, True, "equal finish under fitted step-time model", predicted, current_s
            )
        alloc = make_allocation(workers, b, global_batch, dataset_size)
        reason = _replan_reason(current, workers, global_batch)
        if current is not None and not reason:
            reason = "current plan violates a worker cap; "
        return Decision(
            alloc,
            current is not None,
            reason + "equal finish under fitted step-time model",
            predicted,
            None,
        )


def make_policy(name: str, **options: float) -> Policy:
    if name == "static":
        return StaticPolicy()
    if name == "dbs":
        return DBSPolicy()
    if name == "affine":
        return AffinePolicy(**options)
    raise ValueError(f"unknown policy {name!r}: use static, dbs or affine")

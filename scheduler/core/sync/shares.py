"""What the rebalancing policies (:mod:`dynabatch.scheduler.core.sync.policy`) share. Pure:
numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np
from dynabatch.scheduler.core.sync.allocation import (
    Allocation,
    Decision,
    WorkerTelemetry,
    make_allocation,
)
from dynabatch.scheduler.core.sync.steptime import equal_finish, round_to_total

_CAP = attrgetter("cap")
_CAPACITY = attrgetter("capacity")
_SAMPLES = attrgetter("samples")
_COMPUTE = attrgetter("compute_s")


def _column(telemetry: Sequence[WorkerTelemetry], get: attrgetter, n: int) -> np.ndarray:
    return np.fromiter(map(get, telemetry), dtype=np.float64, count=n)


def batch_bounds(telemetry: Sequence[WorkerTelemetry], global_batch: int) -> tuple[np.ndarray, ...]:
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


def measured_speeds(telemetry: Sequence[WorkerTelemetry]) -> tuple[np.ndarray, np.ndarray]:
    """(speed, measured): samples per compute-second, from the capacity hint if unmeasured."""
    n = len(telemetry)
    samples = _column(telemetry, _SAMPLES, n)
    secs = _column(telemetry, _COMPUTE, n)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        v = samples / secs
    measured = (samples > 0) & (secs > 0) & np.isfinite(v)
    if measured.all():
        return v, measured
    cap = np.maximum(np.nan_to_num(_column(telemetry, _CAPACITY, n), nan=1.0), 1e-9)
    per_unit = float(np.median(v[measured] / cap[measured])) if measured.any() else 1.0
    return np.where(measured, v, per_unit * cap), measured


def capacity_weights(telemetry: Sequence[WorkerTelemetry]) -> np.ndarray:
    cap = _column(telemetry, _CAPACITY, len(telemetry))
    return np.where(np.isfinite(cap), cap, 1.0)


def proportional(
    weights: np.ndarray, global_batch: int, lo: np.ndarray, hi: np.ndarray
) -> np.ndarray:
    """Real batches ∝ weights within bounds, summing to global_batch."""
    w = np.clip(weights, 1e-12, 1e12)
    # Proportional split with caps is equal finish under t_i(b) = b / w_i.
    real, _ = equal_finish(np.zeros_like(w), 1.0 / w, float(global_batch), lo, hi)
    return real


def split(weights: np.ndarray, global_batch: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Integer batches ∝ weights within bounds, summing to global_batch."""
    return round_to_total(proportional(weights, global_batch, lo, hi), global_batch, lo, hi)


def current_batches(
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


def kept(current: Allocation, global_batch: int, dataset_size: int, why: str,
         predicted: float | None = None, current_s: float | None = None) -> Decision:
    """The verdict that keeps ``current`` (re-cut over ``dataset_size`` when that changed)."""
    if current.global_batch != global_batch or current.dataset_size != dataset_size:
        current = make_allocation(current.workers, np.array(current.batches), global_batch,
                                  dataset_size)
    return Decision(current, False, why, predicted, current_s)  # frozen: safe to share


def replan_reason(current: Allocation | None, workers: tuple[str, ...], global_batch: int) -> str:
    if current is None:
        return ""
    if current.workers != workers:
        return "membership changed; "
    if current.global_batch != global_batch:
        return "global batch changed; "
    return ""


def replanned(current: Allocation | None, workers: tuple[str, ...], b: np.ndarray,
              global_batch: int, dataset_size: int, why: str) -> Decision:
    """The verdict that adopts batches ``b`` (a rebalance when it replaces a plan), ``why``
    after what changed."""
    return Decision(make_allocation(workers, b, global_batch, dataset_size), current is not None,
                    replan_reason(current, workers, global_batch) + why)


def speed_floor(a: np.ndarray, c: np.ndarray, global_batch: int, fraction: float
                ) -> np.ndarray:
    """Each worker's least batch: 1 plus ``fraction`` of its speed-proportional share of the
    other ``B − n`` samples, its speed taken at an equal split (where it does not depend on
    the share it was given). The floors sum to at most ``B``."""
    n = len(a)
    if fraction <= 0.0 or n == 0:
        return np.ones(n, dtype=np.int64)
    even = global_batch / n
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        v = even / (np.maximum(a, 0.0) + np.maximum(c, 0.0) * even)
    v = np.where(np.isfinite(v) & (v > 0), v, 0.0)
    if v.sum() <= 0:
        return np.ones(n, dtype=np.int64)
    return 1 + np.floor(fraction * (global_batch - n) * v / v.sum()).astype(np.int64)


def beyond_noise(t: np.ndarray, se: np.ndarray, z: float) -> np.ndarray:
    """Per worker, the factor that takes its measured step time ``t`` towards the workers'
    median, in logs, by firm thresholding with ``λ = z·√(se² + median(se)²)``: a deviation
    within λ is noise, one beyond 2λ is kept whole, a ramp between (a soft threshold would
    shrink every real correction). Ones when ``z`` is 0 or no error is known."""
    se = np.asarray(se, dtype=np.float64)
    if z <= 0.0 or not (se > 0.0).any():
        return np.ones(len(se))
    log_t = np.log(t)
    d = log_t - np.median(log_t)
    # The median is measured too: a worker's long, exact window against another's two
    # noisy steps deviates by the other's noise, not its own.
    lam = z * np.hypot(se, np.median(se))
    with np.errstate(invalid="ignore", divide="ignore"):
        ramp = np.where(lam > 0, (np.abs(d) - lam) / np.where(lam > 0, lam, 1.0), 1.0)
        kept = d * np.clip(np.nan_to_num(ramp, nan=0.0, neginf=0.0), 0.0, 1.0)
    return np.exp(kept - d)


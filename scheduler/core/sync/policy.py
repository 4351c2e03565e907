"""Rebalancing policies: telemetry in, allocation out. Pure: no Ray, no torch, no clock.

* ``static``: equal shares.
* ``dbs`` (Ye et al. 2020): shares proportional to measured throughput.
* ``affine``: equal finish under fitted ``t_i(b) = a_i + c_i·b``
  (:mod:`dynabatch.scheduler.core.sync.steptime`), with hysteresis (``min_gain``).

A worker without telemetry yet is sized from its ``capacity`` hint. A policy keeps
``current`` only while the membership, the global batch and the caps admit it. Cost is
O(n) numpy per decision (per-worker Python work is a few ``attrgetter`` passes).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Literal

import numpy as np
from dynabatch.scheduler.core.sync.allocation import (
    Decision,
    Policy,
    check_sizes,
    make_allocation,
)
from dynabatch.scheduler.core.sync.shares import (
    batch_bounds,
    beyond_noise,
    capacity_weights,
    current_batches,
    kept,
    measured_speeds,
    proportional,
    replan_reason,
    replanned,
    speed_floor,
    split,
)
from dynabatch.scheduler.core.sync.steptime import (
    accumulation_slope,
    equal_finish,
    fit_arrays,
    round_to_total,
    shared_overhead_fit,
    two_point_fit,
)

_WORKER = attrgetter("worker")
_STATS = attrgetter("stats")
_STAT_FIELDS = attrgetter("n", "sb", "st", "sbb", "sbt")
_SLOWED = attrgetter("slowed")
_SE = attrgetter("se")
# DBS's secant step needs its two batch sizes this far apart (larger / smaller; nearby sizes
# give a slope of noise), and its two times this many standard errors apart (below
# ``DBSPolicy.z``: noise makes no far move, and a far move leaves few steps to measure).
SECANT_RATIO = 1.5
SECANT_Z = 1.0


# --------------------------------------------------------------------------------------
# Policies


@dataclass(frozen=True)
class StaticPolicy:
    """Equal shares (within caps), whatever the telemetry says."""

    name: Literal["static"] = "static"

    def decide(self, telemetry, global_batch, dataset_size, current=None) -> Decision:
        check_sizes(global_batch, dataset_size)
        lo, hi = batch_bounds(telemetry, global_batch)
        workers = tuple(map(_WORKER, telemetry))
        real = proportional(np.ones(len(workers)), global_batch, lo, hi)
        cur = current_batches(current, workers, global_batch, lo, hi)
        # Keep a current plan that already is an equal split (any rounding of it).
        if cur is not None and (np.abs(cur - real) < 1.0).all():
            return kept(current, global_batch, dataset_size, "static")
        b = round_to_total(real, global_batch, lo, hi)
        return replanned(current, workers, b, global_batch, dataset_size, "equal shares")


@dataclass(frozen=True)
class DBSPolicy:
    """Ye et al.: new share ∝ old share / compute time, i.e. ∝ measured throughput.

    ``min_gain``: keep the current allocation unless the step time DBS's own model predicts
    (``max_i b_i / v_i``) falls by more than this fraction (0: every change applies, the
    paper's per-epoch re-sizing); a new batch size costs its first step the kernels'
    per-shape setup, so moving on noise is not free.

    ``secant``: the proportional step closes only ``c·b / (a + c·b)`` of the gap where a
    worker's fixed cost a dominates. A worker measured at two batch sizes ``SECANT_RATIO``
    apart since its last change of speed (``WorkerTelemetry.previous`` and the current
    window) is planned on the line through them, reaching the same fixed point at once.
    ``min_share``: the floor of :func:`speed_floor` (a line through a large fixed cost
    could starve a worker).

    ``z``: a share moves only by what stands out of its worker's noise by more than ``z``
    standard errors (:func:`beyond_noise`); a slowed worker (``WorkerTelemetry.slowed``)
    and a secant line are taken whole. Without it, noise drifts equal workers apart where
    a per-step overhead dominates. 0: every measured difference moves the split.
    Measured: docs/benchmarks.md, "Equal workers under noise".
    """

    name: Literal["dbs"] = "dbs"
    min_gain: float = 0.0
    secant: bool = True
    min_share: float = 0.25
    z: float = 3.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if not 0.0 <= self.min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {self.min_share}")
        if not self.z >= 0.0:
            raise ValueError(f"z must be at least 0, got {self.z}")

    def decide(self, telemetry, global_batch, dataset_size, current=None) -> Decision:
        check_sizes(global_batch, dataset_size)
        lo, hi = batch_bounds(telemetry, global_batch)
        workers = tuple(map(_WORKER, telemetry))
        v, measured = measured_speeds(telemetry)
        cur = current_batches(current, workers, global_batch, lo, hi)
        if not measured.all() and cur is not None:
            # The rule corrects each share by its own measurement under it: without one
            # for every worker, a correction would mix plans (or capacity guesses).
            return kept(current, global_batch, dataset_size,
                        "no telemetry" if not measured.any() else
                        "waiting for every worker's steps under the current plan")
        if not measured.any():
            b = split(capacity_weights(telemetry), global_batch, lo, hi)
            return replanned(current, workers, b, global_batch, dataset_size,
                             "shares from capacity hints")
        if cur is None:
            alloc = make_allocation(workers, split(v, global_batch, lo, hi), global_batch,
                                    dataset_size)
            changed = current is not None and (alloc.batches, alloc.workers) != (
                current.batches, current.workers)
            return Decision(alloc, changed, "shares proportional to throughput")
        a, c = np.zeros_like(v), 1.0 / v  # the proportional model: t_i(b) = b / v_i
        se = np.fromiter(map(_SE, telemetry), dtype=np.float64, count=len(telemetry))
        # Each worker's model scaled to keep only what stands out of the noise. A slowed
        # worker keeps all of it: shrunk, its correction stopped part of the way, and the
        # rest sat within the noise of the short window the move restarted.
        scale = beyond_noise(c * cur, se, self.z)
        slowed = np.fromiter(map(_SLOWED, telemetry), bool, count=len(telemetry))
        scale = np.where(slowed, 1.0, scale)
        lines = self._secant_rows(telemetry, cur, c, se, SECANT_Z) if self.secant else None
        if lines is None:
            c = c * scale
            b = split(v / scale, global_batch, lo, hi)
            reason = "shares proportional to throughput"
        else:
            rows, a_l, c_l = lines
            # A line is planned as measured: it joins two windows, and its equal finish
            # lies where the current plan's deviation says little (a fixed cost makes a
            # large change of batch a small change of time).
            scale = np.where(rows, 1.0, scale)
            a, c = np.where(rows, a_l, a) * scale, np.where(rows, c_l, c) * scale
            lo = np.minimum(np.maximum(lo, speed_floor(a, c, global_batch, self.min_share)), hi)
            real, _ = equal_finish(a, c, float(global_batch), lo, hi)
            b = round_to_total(real, global_batch, lo, hi)
            reason = (f"equal finish, {int(rows.sum())} worker(s) through two measured "
                      "batch sizes (secant)")
        predicted = float(np.max(a + c * b))
        current_s = float(np.max(a + c * cur))
        if (b == cur).all() or (current_s > 0 and 1.0 - predicted / current_s <= self.min_gain):
            within = (scale != 1.0).any() and np.ptp(a + c * cur) <= 1e-9 * current_s
            why = ("step times equal within their noise" if within
                   else "predicted gain below threshold")
            return kept(current, global_batch, dataset_size, why, predicted, current_s)
        return Decision(make_allocation(workers, b, global_batch, dataset_size), True,
                        reason, predicted, current_s)

    @staticmethod
    def _secant_rows(telemetry, cur: np.ndarray, c: np.ndarray, se: np.ndarray, z: float
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(rows, a, c) of the workers with a trusted line through their previous and
        current windows (times ``z`` standard errors apart); None when no worker has one."""
        if all(t.previous is None for t in telemetry):
            return None
        prev = [t.previous or (np.nan, np.nan) for t in telemetry]
        b1, t1 = np.array(prev, dtype=np.float64).T
        se1 = np.array([t.previous_se for t in telemetry], dtype=np.float64)
        a_l, c_l = two_point_fit(b1, t1, cur, c * cur, SECANT_RATIO, se1, se, z)
        rows = ~np.isnan(c_l)
        return (rows, a_l, c_l) if rows.any() else None


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
    # No starvation: every worker keeps at least this fraction of its speed-proportional
    # share (:func:`speed_floor`); a share it never trains cannot be measured back up.
    min_share: float = 0.25
    # A worker measured at one batch size since it slowed down is planned cautiously
    # (_cautious) until its own batch sizes spread this much (std / mean).
    own_spread: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if not 0.0 <= self.min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {self.min_share}")

    def decide(self, telemetry, global_batch, dataset_size, current=None) -> Decision:
        check_sizes(global_batch, dataset_size)
        lo, hi = batch_bounds(telemetry, global_batch)
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
        cur = current_batches(current, workers, global_batch, lo, hi)
        if not known.any():
            if cur is not None:
                return kept(current, global_batch, dataset_size, "no telemetry")
            b = split(capacity_weights(telemetry), global_batch, lo, hi)
            return replanned(current, workers, b, global_batch, dataset_size,
                             "shares from capacity hints")
        if not known.all():
            # New members: per-sample cost from capacity relative to the measured ones,
            # overhead as the median of theirs. Telemetry corrects it after a few steps.
            cap = np.maximum(capacity_weights(telemetry), 1e-9)
            per_unit = float(np.median(c[known] * cap[known]))
            c = np.where(known, c, per_unit / cap)
            a = np.where(known, a, float(np.median(a[known])))
        slowed = np.fromiter(map(_SLOWED, telemetry), bool, count=n)
        if slowed.any():
            a, c = _cautious(a, c, cols, slowed, float(global_batch), lo, hi,
                             global_batch / n, self.own_spread)
        lo = np.minimum(np.maximum(lo, speed_floor(a, c, global_batch, self.min_share)), hi)
        starved = cur is not None and bool((cur < lo).any())  # re-planned, whatever the gain
        real, _t_new = equal_finish(a, c, float(global_batch), lo, hi)
        b = round_to_total(real, global_batch, lo, hi)
        predicted = float(np.max(a + c * b))
        if cur is not None:
            current_s = float(np.max(a + c * cur))
            if not starved and (current_s <= 0 or 1.0 - predicted / current_s <= self.min_gain):
                return kept(current, global_batch, dataset_size, "predicted gain below threshold",
                            predicted, current_s)
            alloc = make_allocation(workers, b, global_batch, dataset_size)
            why = "a worker below its share floor; " if starved else ""
            return Decision(alloc, True, why + "equal finish under fitted step-time model",
                            predicted, current_s)
        alloc = make_allocation(workers, b, global_batch, dataset_size)
        reason = replan_reason(current, workers, global_batch)
        if current is not None and not reason:
            reason = "current plan violates a worker cap; "
        return Decision(
            alloc,
            current is not None,
            reason + "equal finish under fitted step-time model",
            predicted,
            None,
        )


def _cautious(a: np.ndarray, c: np.ndarray, cols: np.ndarray, slowed: np.ndarray,
              total: float, lo: np.ndarray, hi: np.ndarray, k_max: float,
              own_spread: float) -> tuple[np.ndarray, np.ndarray]:
    """The model of a worker that just slowed down, for the worst case of its overhead.

    Measured at one batch size b0 since the slowdown, its curve ``t(b) = t0·(k + b)/(k + b0)``
    is known but for its overhead k (in samples). Below b0 a batch takes longest when k is
    largest, so a worker the plan moves down is planned with ``k = k_max``: if pessimistic,
    its next measurements give it more back; guessing low overloads the one slow worker,
    and every step waits for it. (Moved up, the proportional guess is already cautious.)
    """
    n, sb, st, sbb, sbt = cols.T
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_b = sb / n
        one_size = (sbb / n - mean_b * mean_b) < (own_spread * mean_b) ** 2
        rows = slowed & one_size & (n > 0) & (sb > 0) & (st > 0) & ~np.isnan(c)
        if not rows.any() or not np.isfinite(k_max) or np.isnan(c).any():
            return a, c
        plain, _ = equal_finish(a, c, total, lo, hi)
        rows &= plain < mean_b
        if not rows.any():
            return a, c
        k = k_max
        c_k = (k * st + sbt) / (k * k * n + 2 * k * sb + sbb)
    return np.where(rows, c_k * k, a), np.where(rows, c_k, c)


def policy_for(name: str, min_gain: float | None = None) -> Policy:
    """Policy ``name`` with ``min_gain`` (None: its own default), as a job spec gives them:
    ``spec.policy`` and ``spec.rebalance.min_gain(spec.policy)``
    (:meth:`~dynabatch.actors.spec.sections.RebalanceSpec.min_gain` states when the
    threshold applies)."""
    options = {} if min_gain is None else {"min_gain": min_gain}
    if name == "static":
        return StaticPolicy()
    if name == "dbs":
        return DBSPolicy(**options)
    if name == "affine":
        return AffinePolicy(**options)
    raise ValueError(f"unknown policy {name!r}: use static, dbs or affine")

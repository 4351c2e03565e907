"""The step-time model: how long worker i takes to compute one step at local batch b.

Pure (numpy only). The model is affine, ``t_i(b) = a_i + c_i·b``: ``a_i`` the fixed
per-step overhead, ``c_i`` the per-sample cost. Because ``a_i > 0`` a throughput measured
at one batch size mispredicts another, so plain DBS (``t_i(b) = c_i·b``) needs several
epochs to settle where this model can settle in one.

Fitting: weighted least squares over exponentially decayed sufficient statistics
(``n = Σw, Sb = Σw·b, St = Σw·t, Sbb = Σw·b², Sbt = Σw·b·t``), so a disturbed worker's
model follows its new speed. Without a spread of batch sizes the slope is unidentifiable
and the fit falls back to DBS's proportional model ``a = 0, c = St / Sb``.

Equal finish: real batches ``b_i(T) = clip((T − a_i) / c_i, lo_i, hi_i)`` with
``Σ b_i(T) = B``, so that every worker finishes at the same time T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Batch sizes whose spread (std / mean) is below this cannot separate overhead from slope.
MIN_SPREAD = 0.05
# shared_overhead_fit: a worker whose own batch sizes spread this much keeps its own fit, and
# the shared overhead is estimated from at most K_ROWS workers (those that varied most).
OWN_SPREAD = 0.25
K_ROWS = 512


@dataclass(frozen=True, slots=True)
class StepTimeStats:
    """Decayed sufficient statistics of (batch, compute seconds) observations."""

    n: float = 0.0
    sb: float = 0.0
    st: float = 0.0
    sbb: float = 0.0
    sbt: float = 0.0

    def add(self, batch: float, seconds: float, decay: float = 1.0) -> StepTimeStats:
        """Fold in one observation; older ones are multiplied by ``decay`` first."""
        return StepTimeStats(
            n=self.n * decay + 1.0,
            sb=self.sb * decay + batch,
            st=self.st * decay + seconds,
            sbb=self.sbb * decay + batch * batch,
            sbt=self.sbt * decay + batch * seconds,
        )

    @property
    def empty(self) -> bool:
        return self.n <= 0.0 or self.sb <= 0.0


@dataclass(frozen=True, slots=True)
class AffineFit:
    a: float
    c: float


def fit(stats: StepTimeStats) -> AffineFit | None:
    """Least-squares fit of t = a + c·b; proportional fallback; None without usable data
    (one row of :func:`fit_arrays`)."""
    a, c = fit_arrays(*([x] for x in (stats.n, stats.sb, stats.st, stats.sbb, stats.sbt)))
    return None if math.isnan(c[0]) else AffineFit(float(a[0]), float(c[0]))


def accumulation_slope(a: np.ndarray, c: np.ndarray, micro: np.ndarray) -> np.ndarray:
    """Per-sample cost to plan a share computed in micro-batches of at most m with (each pays
    the overhead): ceil(b/m)·a + c·b ≤ a + (c + a/m)·b, so ``c + a/m`` (NaN or inf ``micro``:
    uncapped, ``c``)."""
    m = np.where(np.isfinite(micro) & (micro > 0), micro, np.inf)
    return c + a / m


def fit_arrays(
    n: np.ndarray,
    sb: np.ndarray,
    st: np.ndarray,
    sbb: np.ndarray,
    sbt: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the least-squares fit of t = a + c·b: the proportional fit ``a = 0`` below
    ``MIN_SPREAD`` or for a slope that is not positive; a negative overhead (noise) refits
    through the origin. NaN in rows without usable data."""
    n, sb, st, sbb, sbt = (np.asarray(x, dtype=np.float64) for x in (n, sb, st, sbb, sbt))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mean_b = sb / n
        var_b = sbb / n - mean_b * mean_b
        c_prop = st / sb
        c = (n * sbt - sb * st) / (n * sbb - sb * sb)
        a = (st - c * sb) / n
        spread_ok = var_b > (MIN_SPREAD * mean_b) ** 2
        use_prop = ~spread_ok | ~(c > 0.0)
        a = np.where(use_prop, 0.0, a)
        c = np.where(use_prop, c_prop, c)
        neg = a < 0.0
        a = np.where(neg, 0.0, a)
        c = np.where(neg, sbt / sbb, c)
        ok = (n > 0.0) & (sb > 0.0) & (c > 0.0) & np.isfinite(c) & (a >= 0.0) & np.isfinite(a)
        c = np.where(ok, c, np.nan)
        a = np.where(ok, a, np.nan)
    return a, c


def two_point_fit(
    b1: np.ndarray, t1: np.ndarray, b2: np.ndarray, t2: np.ndarray, min_ratio: float,
    se1: np.ndarray | float = 0.0, se2: np.ndarray | float = 0.0, z: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the line ``t = a + c·b`` through (b1, t1) and (b2, t2); NaN where noise may
    have drawn it: a point missing, batches less than ``min_ratio`` apart (larger over
    smaller), ``c <= 0`` or ``a < 0``, or times within ``z`` standard errors of their
    difference (``se1``, ``se2``: relative; a nearly flat line would move whole shares)."""
    b1, t1, b2, t2 = (np.asarray(x, dtype=np.float64) for x in (b1, t1, b2, t2))
    with np.errstate(divide="ignore", invalid="ignore"):
        c = (t2 - t1) / (b2 - b1)
        a = t2 - c * b2
        far = np.maximum(b1, b2) >= min_ratio * np.minimum(b1, b2)
        apart = np.abs(t2 - t1) > z * np.hypot(t1 * se1, t2 * se2)
    ok = (far & apart & (b1 > 0) & (b2 > 0) & (c > 0) & (a >= 0) & np.isfinite(a)
          & np.isfinite(c))
    return np.where(ok, a, np.nan), np.where(ok, c, np.nan)


def equal_finish(
    a: np.ndarray,
    c: np.ndarray,
    total: float,
    lo: np.ndarray,
    hi: np.ndarray,
) -> tuple[np.ndarray, float]:
    """Real batches b_i in [lo_i, hi_i] summing to ``total`` that equalise a_i + c_i·b_i,
    and T, the common finish time of the unclipped workers. Requires Σlo ≤ total ≤ Σhi,
    lo ≤ hi and every c_i > 0 (finite).

    f(T) = Σ clip((T − a_i)/c_i, lo_i, hi_i) is piecewise linear and non-decreasing: a
    Newton step on the linear piece through a trial T is exact once the unclipped set is
    final, and steps that leave the bracket or fail to halve it fall back to bisection.
    """
    a = np.asarray(a, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    sum_lo = float(lo.sum())
    sum_hi = float(hi.sum())
    slack = 1e-9 * max(1.0, abs(total))
    if sum_lo > total + slack or sum_hi < total - slack:
        raise ValueError(f"no split of {total} fits the bounds (sum lo={sum_lo}, hi={sum_hi})")
    if (lo > hi).any():
        raise ValueError("every lower bound must be at most its upper bound")
    if not (np.isfinite(c).all() and (c > 0.0).all() and np.isfinite(a).all()):
        raise ValueError("every c must be positive and finite, every a finite")
    w = 1.0 / c
    t_lo = float((a + c * lo).min())
    t_hi = float((a + c * hi).max())
    if total <= sum_lo:
        return lo.copy(), t_lo
    if total >= sum_hi:
        return hi.copy(), t_hi
    # First guess: nobody clipped (exact when no bound binds).
    t = (total + float(a @ w)) / float(w.sum())
    width = t_hi - t_lo
    slow = 0
    b = lo
    for _ in range(100):  # bounds the work; a bisection halves the bracket
        if not t_lo < t < t_hi:
            t = 0.5 * (t_lo + t_hi)
        x = (t - a) * w
        b = np.clip(x, lo, hi)
        err = total - float(b.sum())
        if abs(err) <= slack:
            break
        if err > 0.0:
            t_lo = t
        else:
            t_hi = t
        new_width = t_hi - t_lo
        if new_width <= 4e-16 * max(abs(t_hi), abs(t_lo)):
            break
        # Two passes in a row that fail to halve the bracket: bisect (bounds the work).
        slow = slow + 1 if new_width > 0.5 * width else 0
        width = new_width
        slope = float(w @ ((x > lo) & (x < hi)))
        if slope > 0.0 and slow < 2:
            t = t + err / slope  # exact if the clipped set is final; bisected if outside
        else:
            t = 0.5 * (t_lo + t_hi)
            slow = 0
    b = np.array(b, dtype=np.float64)  # own the buffer (b may alias lo)
    resid = total - float(b.sum())
    if resid:
        free = (b > lo) & (b < hi)
        if free.any():
            wf = w[free]
            step = resid / float(wf.sum())  # a last Newton step on the final free set
            b[free] += step * wf
            np.clip(b, lo, hi, out=b)
            t += step
    return b, float(t)


def round_to_total(x: np.ndarray, total: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Integers in [lo, hi] (Σlo ≤ total ≤ Σhi) summing to ``total``, nearest to real ``x``
    by largest remainder: within 1 of clip(x, lo, hi) when that sums to ``total``."""
    lo = np.asarray(lo, dtype=np.int64)
    hi = np.asarray(hi, dtype=np.int64)
    total = int(total)
    if int(lo.sum()) > total:
        raise ValueError("total is below the sum of lower bounds")
    if int(hi.sum()) < total:
        raise ValueError("total exceeds the sum of upper bounds")
    x = np.clip(np.asarray(x, dtype=np.float64), lo, hi)
    out = np.clip(np.floor(x).astype(np.int64), lo, hi)
    deficit = total - int(out.sum())
    while deficit > 0:
        room = out < hi
        eligible = int(room.sum())
        if eligible == 0:
            raise ValueError("total exceeds the sum of upper bounds")
        k = min(deficit, eligible)
        if k == eligible:
            out[room] += 1
        else:
            # Largest remainders first; another pass only if float error left a gap.
            frac = np.where(room, x - out, -np.inf)
            out[np.argpartition(frac, -k)[-k:]] += 1
        deficit -= k
    while deficit < 0:
        room = out > lo
        eligible = int(room.sum())
        if eligible == 0:
            raise ValueError("total is below the sum of lower bounds")
        k = min(-deficit, eligible)
        if k == eligible:
            out[room] -= 1
        else:
            frac = np.where(room, x - out, np.inf)
            out[np.argpartition(frac, k - 1)[:k]] -= 1
        deficit += k
    return out


def shared_overhead_fit(
    n: np.ndarray, sb: np.ndarray, st: np.ndarray, sbb: np.ndarray, sbt: np.ndarray,
    k_max: float = np.inf,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Refit every worker as ``t_i(b) = c_i·(k + b)`` with one overhead ``k`` for all.

    Per-worker fits need each worker's own batch sizes to vary, and their slopes are noisy
    (equal workers get unequal fits, and the plan churns). When heterogeneity scales a whole
    step, the overhead in samples ``k = a_i / c_i`` is common to all workers, so it is
    estimated from all observations at once. For fixed k each worker's scale is::

        c_i(k) = (k·St_i + Sbt_i) / (k²·n_i + 2k·Sb_i + Sbb_i)

    and its residual is ``Stt_i − (k·St_i + Sbt_i)² / (k²·n_i + 2k·Sb_i + Sbb_i)``, so k
    maximises the explained part, each worker normalised by its mean step time squared::

        F(k) = Σ_i (n_i / St_i)² · (k·St_i + Sbt_i)² / (k²·n_i + 2k·Sb_i + Sbb_i)

    by golden-section search on [0, k_max] (the sensitivity of b_i to timing noise grows as
    1 + k/b_i). With no worker whose batch size varied, k = 0: DBS's proportional model.
    A worker whose own sizes spread ``OWN_SPREAD`` or more keeps its own affine fit.
    Returns (a, c, k); rows without data get NaN.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        has = (n > 0) & (sb > 0) & (st > 0)
        mean_b = np.where(has, sb / np.where(has, n, 1), 0.0)
        var_b = np.where(has, sbb / np.where(has, n, 1) - mean_b * mean_b, 0.0)
        spread = has & (var_b > (MIN_SPREAD * mean_b) ** 2)
        k = 0.0
        if spread.any() and k_max > 0:
            rows = np.flatnonzero(has)
            if rows.size > K_ROWS:  # keeps a decision over 10,000 workers within milliseconds
                rel = (var_b / np.where(mean_b > 0, mean_b * mean_b, 1.0))[rows]
                rows = rows[np.argpartition(-rel, K_ROWS - 1)[:K_ROWS]]
            nn, b1, t1, b2, bt = n[rows], sb[rows], st[rows], sbb[rows], sbt[rows]
            w = (nn / t1) ** 2

            def explained(kk: float) -> float:
                return float(np.sum(w * (kk * t1 + bt) ** 2 / (kk * kk * nn + 2 * kk * b1 + b2)))

            hi = float(min(k_max, 10.0 * float(np.max(mean_b[has]))))
            lo = 0.0
            g = (np.sqrt(5.0) - 1.0) / 2.0
            x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
            f1, f2 = explained(x1), explained(x2)
            for _ in range(25):
                if f1 >= f2:
                    hi, x2, f2 = x2, x1, f1
                    x1 = hi - g * (hi - lo)
                    f1 = explained(x1)
                else:
                    lo, x1, f1 = x1, x2, f2
                    x2 = lo + g * (hi - lo)
                    f2 = explained(x2)
            k = 0.5 * (lo + hi)
            if explained(0.0) >= explained(k):
                k = 0.0
        c = (k * st + sbt) / (k * k * n + 2 * k * sb + sbb)
        a = c * k
        # A worker whose own batch sizes varied a lot (a newcomer tried at its capacity
        # share, then at its fitted one) has a well-determined fit of its own; keep it,
        # since its overhead may differ from the others' (e.g. memory-bound steps).
        denom = n * sbb - sb * sb
        c_own = (n * sbt - sb * st) / denom
        a_own = (st - c_own * sb) / n
        own = has & (var_b >= (OWN_SPREAD * mean_b) ** 2) & np.isfinite(c_own) & (
            c_own > 0) & (a_own >= 0)
        a = np.where(own, a_own, a)
        c = np.where(own, c_own, c)
        bad = ~(has & np.isfinite(c) & (c > 0))
        c = np.where(bad, np.nan, c)
        a = np.where(bad, np.nan, a)
    return a, c, k

"""The step-time model: how long worker i takes to compute one step at local batch b.

Pure (numpy only). The model is affine::

    t_i(b) = a_i + c_i * b

``a_i`` is the fixed per-step overhead (Python, kernel launches, optimizer) and ``c_i`` the
per-sample cost. Because ``a_i > 0``, per-sample cost falls as b grows, so a throughput
measured at one batch size mispredicts another. That is why plain DBS, which assumes
``t_i(b) = c_i * b``, needs several epochs to settle and this model can settle in one.

Fitting: weighted least squares over exponentially-decayed sufficient statistics, so old
observations fade (weight ``decay**age``) and a disturbed worker's model follows its new
speed. With statistics ``n = Σw, Sb = Σw·b, St = Σw·t, Sbb = Σw·b², Sbt = Σw·b·t``::

    c = (n·Sbt − Sb·St) / (n·Sbb − Sb²)
    a = (St − c·Sb) / n

When every observation has the same b the slope is unidentifiable; the fit then falls back
to the proportional model ``a = 0, c = St / Sb`` (exactly DBS's assumption).

Equal finish: for a global batch B, choose real batches b_i in [lo_i, hi_i] so that every
worker finishes at the same time T::

    b_i(T) = clip((T − a_i) / c_i, lo_i, hi_i),   Σ b_i(T) = B

Σ b_i(T) is monotone in T, so T is found by bisection, vectorised over workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

    def predict(self, batch: float) -> float:
        return self.a + self.c * batch


def fit(stats: StepTimeStats, min_relative_spread: float = 0.05) -> AffineFit | None:
    """Least-squares fit of t = a + c·b; proportional fallback; None without data."""
    if stats.empty:
        return None
    n = stats.n
    mean_b = stats.sb / n
    var_b = stats.sbb / n - mean_b * mean_b
    proportional = AffineFit(0.0, stats.st / stats.sb)
    # A spread of batch sizes below a few percent cannot separate overhead from slope.
    if var_b <= (min_relative_spread * mean_b) ** 2:
        return proportional
    c = (n * stats.sbt - stats.sb * stats.st) / (n * stats.sbb - stats.sb * stats.sb)
    a = (stats.st - c * stats.sb) / n
    if c <= 0.0:
        return proportional
    if a < 0.0:
        # Noise gave a negative overhead: refit through the origin.
        return AffineFit(0.0, stats.sbt / stats.sbb)
    return AffineFit(a, c)


def fit_arrays(
    n: np.ndarray, sb: np.ndarray, st: np.ndarray, sbb: np.ndarray, sbt: np.ndarray,
    min_relative_spread: float = 0.05,
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised :func:`fit` over many workers. Rows without data get c = NaN."""
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_b = sb / n
        var_b = sbb / n - mean_b * mean_b
        c_prop = st / sb
        denom = n * sbb - sb * sb
        c = (n * sbt - sb * st) / denom
        a = (st - c * sb) / n
        spread_ok = var_b > (min_relative_spread * mean_b) ** 2
        use_prop = ~spread_ok | ~(c > 0.0)
        a = np.where(use_prop, 0.0, a)
        c = np.where(use_prop, c_prop, c)
        neg = a < 0.0
        a = np.where(neg, 0.0, a)
        c = np.where(neg, sbt / sbb, c)
        no_data = ~((n > 0) & (sb > 0))
        c = np.where(no_data, np.nan, c)
        a = np.where(no_data, np.nan, a)
    return a, c


def equal_finish(
    a: np.ndarray, c: np.ndarray, total: float, lo: np.ndarray, hi: np.ndarray,
    iterations: int = 100,
) -> tuple[np.ndarray, float]:
    """Real batches b_i in [lo_i, hi_i] summing to ``total`` that equalise a_i + c_i·b_i.

    Returns (b, T): T is the common finish time of the unclipped workers.
    Requires Σlo ≤ total ≤ Σhi and every c_i > 0.
    """
    if lo.sum() > total + 1e-9 or hi.sum() < total - 1e-9:
        raise ValueError(f"no split of {total} fits the bounds (sum lo={lo.sum()}, hi={hi.sum()})")
    t_lo = float(np.min(a + c * lo))
    t_hi = float(np.max(a + c * hi))
    for _ in range(iterations):
        t = 0.5 * (t_lo + t_hi)
        s = np.clip((t - a) / c, lo, hi).sum()
        if s < total:
            t_lo = t
        else:
            t_hi = t
        if t_hi - t_lo <= 1e-12 * max(t_hi, 1e-12):
            break
    b = np.clip((t_hi - a) / c, lo, hi)
    # Put the bisection's residual on the workers that are not clipped.
    resid = total - b.sum()
    free = (b > lo) & (b < hi) if resid else np.zeros_like(b, dtype=bool)
    if resid and free.any():
        b[free] += resid * (1.0 / c[free]) / (1.0 / c[free]).sum()
        b = np.clip(b, lo, hi)
    return b, t_hi


def round_to_total(x: np.ndarray, total: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Integers in [lo, hi] summing to ``total``, nearest to real ``x`` (largest remainder).

    ``lo``/``hi`` are integer arrays with Σlo ≤ total ≤ Σhi.
    """
    x = np.clip(np.asarray(x, dtype=np.float64), lo, hi)
    out = np.floor(x).astype(np.int64)
    out = np.clip(out, lo, hi)
    deficit = int(total - out.sum())
    while deficit > 0:
        room = hi - out
        eligible = int((room > 0).sum())
        if eligible == 0:
            raise ValueError("total exceeds the sum of upper bounds")
        frac = np.where(room > 0, x - out, -np.inf)
        k = min(deficit, eligible)
        # Largest remainders first; a second pass only if float error left a gap.
        pick = np.argpartition(-frac, k - 1)[:k]
        out[pick] += 1
        deficit -= k
    while deficit < 0:
        room = out - lo
        eligible = int((room > 0).sum())
        if eligible == 0:
            raise ValueError("total is below the sum of lower bounds")
        frac = np.where(room > 0, x - out, np.inf)
        k = min(-deficit, eligible)
        pick = np.argpartition(frac, k - 1)[:k]
        out[pick] -= 1
        deficit += k
    return out

"""Goodput-driven global batch (Pollux / AdaptDL, AdaScale). Pure (numpy only).

**Gradient noise from unequal batches.** For a batch of b samples drawn without replacement
from the N training samples, the mean gradient g_b satisfies::

    E|g_b|² = |∇L|² + tr(Σ)·φ(b),    φ(b) = (1/b − 1/N)·N/(N − 1)

(Σ the per-sample gradient covariance; φ is the finite-population correction: φ(b) → 1/b
when b ≪ N, and φ(N) = 0, the full batch being exact). Under DBS the workers train
*unequal* batches, so every step gives points ``(x, y) = (φ(b_i), |g_i|²)`` for each worker's
local mean gradient and ``(φ(B), |G|²)`` for the all-reduced one. Since
``E[y] = |∇L|² + tr(Σ)·x`` for every point, a least-squares line through them has an
intercept and a slope that are unbiased (linear in y) estimates of |∇L|² and tr(Σ).

The line is fitted once per epoch from *all* of the epoch's steps, pooled, not per step and
smoothed: one step has only n + 1 points whose x spread is small (the shares differ by the
workers' speed ratios), so a per-step slope is mostly noise, and an average of per-step fits
weights a step with almost no spread like one with much. The pooled fit is the fixed-effects
one: the slope from the deviations of every step's points from *that step's* means,
``tr(Σ) = Σ_s Σ_i (x_si − x̄_s)(y_si − ȳ_s) / Σ_s Σ_i (x_si − x̄_s)²`` (each step weighted by
its own spread), and ``|∇L|² = mean(y − tr(Σ)·x)`` over all points. Within-step contrasts
keep it unbiased while |∇L|² drifts over the epoch (it grows tenfold as a model leaves its
first plateau): a line through all points at once would confound that drift with x, since
the short last step of an epoch has small shares (large x) and comes last. The epoch's fit is
the estimate for the next epoch's decision; an unusable fit (|∇L|² ≤ 0: the noise swamped
the signal) keeps the previous one. The gradient noise scale is ``B_noise = tr(Σ)/|∇L|²``.

**Statistical efficiency** of batch B relative to the first batch B_0 (AdaScale's gain
``r = (|∇L|² + tr(Σ)·φ(B_0)) / (|∇L|² + tr(Σ)·φ(B))``, s = B/B_0)::

    E(B) = r/s = (B_0/B) · (1 + B_noise·φ(B_0)) / (1 + B_noise·φ(B))

which is ``(B_noise + B_0)/(B_noise + B)`` when N is large.

**Throughput** (:class:`StepTimeModel`). Worker i computes a share b in
``t_i(b) = a_i + c_i·b`` seconds (its fixed per-step cost a_i and per-sample cost c_i,
least squares over its step reports; :mod:`dynabatch.scheduler.core.sync.steptime`). The policy
splits B so that
the workers finish together (DBS/affine), so a step takes::

    T(B) = T*(B) + o,   T*: Σ_i clip((T* − a_i)/c_i, 0, B) = B   (equal finish)

with o the measured rest of a step (the all-reduce that is not hidden behind compute, and
the optimizer). When no worker's batch sizes varied yet (a fixed B), a_i and c_i cannot be
told apart; as AdaptDL does, the fit then takes half of the mean step time as fixed cost
(``a_i = t̄_i/2, c_i = t̄_i/(2·b̄_i)``), which is optimistic about larger batches, so goodput
tries one and the next epoch's fit has the spread it needs. Because T* is concave and
increasing in B (workers join the split as T* grows) with T*(0) ≥ 0, the predicted
throughput ``B/T(B)`` never decreases in B.

**Goodput** ``G(B) = B/T(B) · E(B)``: progress per second in B_0-equivalent samples. The
chosen B maximises G over a geometric grid of ``[B_min, min(B_max, N)]``; its learning rate is
``lr_0 · r(B)`` (AdaScale).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
from dynabatch.scheduler.core.sync.steptime import (
    MIN_SPREAD,
    AffineFit,
    StepTimeStats,
    equal_finish,
    fit,
)

GRID = 24


def fpc(batch: float, population: int | None) -> float:
    """φ(b) = (1/b − 1/N)·N/(N − 1); 1/b without a population (or N ≤ 1)."""
    if population is None or population <= 1:
        return 1.0 / batch
    n = float(population)
    return max(0.0, (1.0 / batch - 1.0 / n) * n / (n - 1.0))


@dataclass(frozen=True, slots=True)
class NoiseEstimate:
    """|∇L|² and tr(Σ) from the last closed epoch's pooled fit, and the open epoch's
    sufficient statistics: points ``n``, ``Σx``, ``Σy`` and the within-step sums
    ``wxx = Σ_s Σ_i (x − x̄_s)²``, ``wxy = Σ_s Σ_i (x − x̄_s)(y − ȳ_s)``."""

    grad_sq: float = 0.0
    trace: float = 0.0
    epochs: int = 0  # epochs whose fit was usable
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    wxx: float = 0.0
    wxy: float = 0.0

    @property
    def noise_scale(self) -> float | None:
        if self.epochs == 0 or self.grad_sq <= 0:
            return None
        return max(self.trace, 0.0) / self.grad_sq

    def observe(self, points: Sequence[tuple[int, float]],
                population: int | None = None) -> NoiseEstimate:
        """Fold in one step's ``(batch, |mean gradient|²)`` points (the workers' and the
        global one) into the open epoch's statistics."""
        pts = [(fpc(b, population), y) for b, y in points if b > 0 and math.isfinite(y)]
        if not pts:
            return self
        k = len(pts)
        mx = sum(x for x, _ in pts) / k
        my = sum(y for _, y in pts) / k
        return replace(self, n=self.n + k, sx=self.sx + mx * k, sy=self.sy + my * k,
                       wxx=self.wxx + sum((x - mx) ** 2 for x, _ in pts),
                       wxy=self.wxy + sum((x - mx) * (y - my) for x, y in pts))

    def fit(self) -> tuple[float, float] | None:
        """(|∇L|², tr Σ) of the open epoch's steps; None when no step had two distinct
        batch sizes."""
        if self.n < 2 or self.wxx <= 1e-12 * (self.sx / self.n) ** 2:
            return None
        slope = self.wxy / self.wxx
        return (self.sy - slope * self.sx) / self.n, slope

    def close(self) -> NoiseEstimate:
        """End the epoch: its pooled fit becomes the estimate (an unusable one keeps the
        previous), and the statistics start over."""
        f = self.fit()
        out = replace(self, n=0.0, sx=0.0, sy=0.0, wxx=0.0, wxy=0.0)
        if f is None or not (f[0] > 0 and math.isfinite(f[0]) and math.isfinite(f[1])):
            return out
        return replace(out, grad_sq=f[0], trace=max(f[1], 0.0), epochs=self.epochs + 1)

    def to_state(self) -> list[float]:
        return [self.grad_sq, self.trace, self.epochs, self.n, self.sx, self.sy, self.wxx,
                self.wxy]

    @classmethod
    def from_state(cls, state: Sequence[float]) -> NoiseEstimate:
        vals = [float(v) for v in state]
        if len(vals) != 8:  # an older checkpoint: no usable estimate
            return cls()
        return cls(vals[0], vals[1], int(vals[2]), *vals[3:])


def efficiency(batch: float, base: float, noise_scale: float,
               population: int | None = None) -> float:
    """E(B) = (B_0/B)·(1 + B_noise·φ(B_0))/(1 + B_noise·φ(B))."""
    return (base / batch) * (1.0 + noise_scale * fpc(base, population)) / (
        1.0 + noise_scale * fpc(batch, population))


def gain(batch: float, base: float, noise_scale: float,
         population: int | None = None) -> float:
    """AdaScale's r = s·E(B), s = B/B_0: the learning-rate factor at B."""
    return batch / base * efficiency(batch, base, noise_scale, population)


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """T(B) = T*(B) + overhead, T* the equal-finish time of workers ``a_i + c_i·b_i``
    (see the module docstring)."""

    a: tuple[float, ...]
    c: tuple[float, ...]
    overhead: float = 0.0

    def throughput(self, batch: float) -> float:
        """B/T(B), T* the finish time of the real shares that finish together."""
        a = np.asarray(self.a, dtype=np.float64)
        c = np.asarray(self.c, dtype=np.float64)
        n = len(a)
        # No share can exceed B; an upper bound above it never binds (one at B would, when a
        # single worker takes everything, and T would no longer be its finish time).
        _, t = equal_finish(a, c, float(batch), np.zeros(n), np.full(n, 2.0 * batch))
        return batch / (t + self.overhead)


def worker_fit(stats: StepTimeStats) -> AffineFit | None:
    """A worker's ``t(b) = a + c·b`` from its step reports; with no spread of batch sizes,
    AdaptDL's optimistic prior ``a = t̄/2, c = t̄/(2·b̄)`` (see the module docstring)."""
    if stats.empty:
        return None
    mean_b = stats.sb / stats.n
    var_b = stats.sbb / stats.n - mean_b * mean_b
    if var_b <= (MIN_SPREAD * mean_b) ** 2:
        mean_t = stats.st / stats.n
        if not (mean_t > 0 and math.isfinite(mean_t)):
            return None
        return AffineFit(mean_t / 2.0, mean_t / (2.0 * mean_b))
    return fit(stats)


def step_time_model(stats: Mapping[str, StepTimeStats], overhead: float
                    ) -> StepTimeModel | None:
    """The step-time model of the workers whose statistics are given; None when one of them
    has no usable fit."""
    fits = [worker_fit(s) for s in stats.values()]
    if not fits or any(f is None for f in fits):
        return None
    return StepTimeModel(tuple(f.a for f in fits), tuple(f.c for f in fits),
                         max(overhead, 0.0))


def grid(lo: int, hi: int, n: int = GRID) -> list[int]:
    if hi <= lo:
        return [lo]
    r = (hi / lo) ** (1.0 / (n - 1))
    return sorted({min(hi, max(lo, round(lo * r ** i))) for i in range(n)})


def choose_batch(lo: int, hi: int, base: int, noise_scale: float | None,
                 timing: StepTimeModel | None, population: int | None = None
                 ) -> tuple[int, float]:
    """(B, goodput) maximising throughput × efficiency over ``[lo, min(hi, N)]``; ``base``
    (clipped into the range) while nothing is measured."""
    top = min(hi, population) if population else hi
    top = max(top, lo)
    start = min(max(base, lo), top)
    if noise_scale is None or timing is None:
        return start, 0.0
    best = (start, -1.0)
    for b in grid(lo, top):
        g = timing.throughput(b) * efficiency(b, base, noise_scale, population)
        if g > best[1]:
            best = (b, g)
    return best

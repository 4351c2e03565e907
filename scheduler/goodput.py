"""Goodput-driven global batch (Pollux / AdaptDL, AdaScale). Pure.

**Gradient noise from unequal batches.** For a batch of b samples drawn from the data, the
mean gradient g_b satisfies ``E|g_b|² = |∇L|² + tr(Σ)/b`` (Σ the per-sample gradient
covariance). Under DBS the workers train *unequal* batches, so every step gives points
``(x, y) = (1/b_i, |g_i|²)`` for each worker's local mean gradient and ``(1/B, |G|²)`` for
the all-reduced one. Since ``E[y] = |∇L|² + tr(Σ)·x`` for every point, the least-squares line
through them has intercept and slope that are unbiased (linear in y) estimates of
``|∇L|²`` and ``tr(Σ)``. They are smoothed by exponential moving averages (weight
``ema``), and the gradient noise scale is ``B_noise = tr(Σ)/|∇L|²``.

**Statistical efficiency** of batch B relative to the first batch B_0 (AdaScale gain
``r = (σ² + |∇L|²)/(σ²/s + |∇L|²)`` with s = B/B_0 and σ² = tr(Σ)/B_0)::

    E(B) = r/s = (B_noise + B_0) / (B_noise + B)

**Throughput**: a step at B takes ``T(B) = α + B/v`` with v the workers' summed rate
(samples per compute-second, from the step reports) and α the rest of the measured step
time (all-reduce, coordination). **Goodput** ``G(B) = B/T(B) · E(B)``: progress per second
in B_0-equivalent samples. The chosen B maximises G over a geometric grid of
``[B_min, B_max]``; its learning rate is ``lr_0 · r(B)`` (AdaScale).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

GRID = 24


@dataclass(frozen=True, slots=True)
class NoiseEstimate:
    grad_sq: float = 0.0  # |∇L|² (EMA)
    trace: float = 0.0  # tr(Σ) (EMA)
    samples: int = 0  # steps folded in
    ema: float = 0.9

    @property
    def noise_scale(self) -> float | None:
        if self.samples == 0 or self.grad_sq <= 0:
            return None
        return max(self.trace, 0.0) / self.grad_sq

    def observe(self, points: Sequence[tuple[int, float]]) -> NoiseEstimate:
        """Fold in one step's ``(batch, |mean gradient|²)`` points (the workers' and the
        global one). Needs at least two distinct batch sizes; otherwise unchanged."""
        pts = [(1.0 / b, y) for b, y in points if b > 0 and math.isfinite(y)]
        if len({x for x, _ in pts}) < 2:
            return self
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        my = sum(y for _, y in pts) / n
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
        intercept = my - slope * mx
        if self.samples == 0:
            return replace(self, grad_sq=intercept, trace=slope, samples=1)
        k = self.ema
        return replace(self, grad_sq=k * self.grad_sq + (1 - k) * intercept,
                       trace=k * self.trace + (1 - k) * slope, samples=self.samples + 1)


def efficiency(batch: float, base: float, noise_scale: float) -> float:
    """E(B) = (B_noise + B_0)/(B_noise + B)."""
    return (noise_scale + base) / (noise_scale + batch)


def gain(batch: float, base: float, noise_scale: float) -> float:
    """AdaScale's r = s·E(B), s = B/B_0: the learning-rate factor at B."""
    return batch / base * efficiency(batch, base, noise_scale)


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """T(B) = overhead + B/rate."""

    overhead: float
    rate: float

    def seconds(self, batch: float) -> float:
        return self.overhead + batch / self.rate


def grid(lo: int, hi: int, n: int = GRID) -> list[int]:
    if hi <= lo:
        return [lo]
    r = (hi / lo) ** (1.0 / (n - 1))
    return sorted({min(hi, max(lo, round(lo * r ** i))) for i in range(n)})


def choose_batch(lo: int, hi: int, base: int, noise_scale: float | None,
                 timing: StepTimeModel | None) -> tuple[int, float]:
    """(B, goodput) maximising throughput × efficiency; ``base`` while nothing is measured."""
    if noise_scale is None or timing is None or timing.rate <= 0:
        return base, 0.0
    best = (base, -1.0)
    for b in grid(lo, hi):
        g = b / timing.seconds(b) * efficiency(b, base, noise_scale)
        if g > best[1]:
            best = (b, g)
    return best

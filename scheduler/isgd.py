"""ISGD's control chart (Wang et al., arXiv 1603.05544): which batches are under-trained. Pure.

The chart keeps the global losses ψ of the last ``window`` batches (a FIFO). Its upper
control limit is

    limit = mean(ψ) + σ · std(ψ)        (std: the population standard deviation)

and a batch whose loss is above it is under-trained. The coordinator puts the limit into
every step of the next segment as an :class:`~actors.contracts.IsgdRule`; the workers
compare the step's all-reduced loss with it and run the conservative sub-problem
(:mod:`actors.optim`). The chart is ``None`` (no rule) until the window is full and the
first epoch is over (losses of an untrained model say nothing about batches).

With ISGD on, the coordinator plans one step per segment (:meth:`scheduler.regime.Regime.stamp`)
so that every batch is judged against the limit of the batches just before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from actors.contracts import IsgdRule


@dataclass(frozen=True, slots=True)
class ControlChart:
    window: int
    sigma: float
    losses: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"window must be at least 2, got {self.window}")
        if len(self.losses) > self.window:
            raise ValueError("more losses than the window holds")

    def push(self, loss: float) -> ControlChart:
        """The chart after one more batch loss (non-finite losses are not charted)."""
        if not math.isfinite(loss):
            return self
        return ControlChart(self.window, self.sigma, (*self.losses, loss)[-self.window:])

    @property
    def full(self) -> bool:
        return len(self.losses) == self.window

    @property
    def limit(self) -> float | None:
        if not self.full:
            return None
        n = len(self.losses)
        mean = sum(self.losses) / n
        var = sum((x - mean) ** 2 for x in self.losses) / n
        return mean + self.sigma * math.sqrt(var)

    def rule(self, epoch: int, epsilon: float, max_extra: int) -> IsgdRule | None:
        """The rule for steps of ``epoch``; None while monitoring has not started."""
        lim = self.limit
        if epoch < 1 or lim is None:
            return None
        return IsgdRule(limit=lim, epsilon=epsilon, max_extra=max_extra)

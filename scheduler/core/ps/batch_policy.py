"""Performance-aware per-learner batch sizes for asynchronous SGD (Ji, Zhang, Fu, Gao, Li;
J. Comp. Res. & Dev. 2019). Pure: no ray, no torch, no clock.

Each learner's speed is an exponential moving average of its throughput,
``v_i ← β·v_i + (1−β)·b_i/t_i``. Every ``every_pushes`` pushes (or at each epoch when 0) the
batches are re-planned, ``b_i = clip(round(B · v_i / Σ_j v_j), b_min, b_max)`` with
``B = λ·b0``, so every learner's iteration takes about the same time and each gradient is
about λ−1 versions old. With ``scale_lr`` (the default) a gradient's learning rate is scaled
by its own sample count over b0, so each sample gets the step it has under ASGD
(docs/parameter-server.md, "Ji et al.: the default").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class JiConfig:
    b0: int
    b_min: int = 1
    b_max: int | None = None
    ema: float = 0.5  # β
    every_pushes: int = 0  # 0: re-plan at each epoch
    scale_lr: bool = True  # α × b_i/b0 (the best variant measured; False: the plain reading)


def ji_batches(total: int, speeds: dict[str, float], b_min: int = 1,
               b_max: int | None = None) -> dict[str, int]:
    """``b_i = clip(round(total·v_i/Σv), b_min, b_max)`` for every worker in ``speeds``."""
    s = sum(speeds.values())
    out = {}
    for w, v in speeds.items():
        b = round(total * v / s) if s > 0 else round(total / len(speeds))
        b = max(b_min, b)
        out[w] = min(b, b_max) if b_max is not None else b
    return out


class PerfAwareBatches:
    """Fixed batches when ``config`` is None (plain ASGD / softsync), Ji et al.'s otherwise."""

    def __init__(self, b0: int, config: JiConfig | None = None):
        self.b0 = b0
        self.config = config
        self.speeds: dict[str, float] = {}
        self._batches: dict[str, int] = {}
        self._since = 0

    def batch(self, worker: str) -> int:
        return self._batches.get(worker, self.b0)

    def lr_scale(self, samples: int) -> float:
        """The factor on α of a gradient over ``samples`` samples: ``samples/b0`` with
        ``scale_lr``, else 1."""
        c = self.config
        return samples / self.b0 if c is not None and c.scale_lr else 1.0

    def observe(self, worker: str, samples: int, compute_s: float,
                members: Iterable[str] | None = None) -> bool:
        """One push's measurement. Every ``every_pushes`` measured pushes the batches are
        re-planned over ``members`` (default: the learners with a speed); True when it did."""
        if self.config is None or compute_s <= 0 or samples < 1:
            return False
        v = samples / compute_s
        old = self.speeds.get(worker)
        beta = self.config.ema
        self.speeds[worker] = v if old is None else beta * old + (1 - beta) * v
        self._since += 1
        if self.config.every_pushes and self._since >= self.config.every_pushes:
            self._since = 0
            self.replan(self.speeds if members is None else members)
            return True
        return False

    def replan(self, workers: Iterable[str]) -> dict[str, int]:
        """Re-plan over ``workers`` (those without a speed are sized from the mean speed)."""
        c = self.config
        workers = list(workers)
        if c is None or not workers:
            return dict(self._batches)
        known = [self.speeds[w] for w in workers if w in self.speeds]
        if not known:
            return dict(self._batches)
        mean = sum(known) / len(known)
        speeds = {w: self.speeds.get(w, mean) for w in workers}
        self._batches = ji_batches(len(workers) * c.b0, speeds, c.b_min, c.b_max)
        return dict(self._batches)

    def forget(self, worker: str) -> None:
        self.speeds.pop(worker, None)
        self._batches.pop(worker, None)

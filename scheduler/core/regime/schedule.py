"""The job's schedule: the global batch and the learning rate at every step. Pure.

A :class:`Schedule` sits beside the policy
(:class:`~dynabatch.scheduler.core.sync.allocation.Policy`): the policy splits a
global batch over the workers, the schedule says what that global batch is and which
learning rate each step uses. The coordinator asks it and writes the answer into every
:class:`~dynabatch.actors.contracts.StepPlan`; workers never compute a schedule.

Time is the fractional epoch ``t = e + (s + 1)/S`` at step ``s`` of epoch ``e`` with ``S``
steps (the position *after* the step, so a warm-up's first step is not wasted at 0).

The learning rate of a step is ``lr = lr_0 · f_sched(t) · f_warm(t) · f_batch(e, t)``:

* ``f_sched``: ``constant`` 1; ``multistep`` γ^(number of milestones m ≤ e); ``cosine``
  ``m + (1 − m)·½·(1 + cos(π·t/E))`` with ``m = min_factor`` and E the job's epochs; or,
  given ``epoch_factors`` (a ``torch.optim.lr_scheduler`` stepped once per epoch, computed
  by :func:`dynabatch.actors.optim.lr_schedule` outside this pure module), the
  factor of epoch e (the last one for any epoch past them).
* ``f_warm``: ``min(1, t / w)`` for the LR schedule's ``warmup_epochs`` w (1 when w = 0).
* ``f_batch`` (batch stages, Hu et al. 2022 / Goyal et al. 2017): stage k trains at B_k;
  its target factor relative to the first stage is ``ρ_k = B_k/B_0`` (``linear``),
  ``√(B_k/B_0)`` (``sqrt``) or 1 (``none``). After a jump at epoch E_k the factor ramps
  linearly from ρ_{k−1} to ρ_k: ``ρ_{k−1} + (ρ_k − ρ_{k−1})·min(1, (t − E_k)/w_b)`` over the
  batch schedule's ``warmup_epochs`` w_b (a step when w_b = 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Stage:
    """``lr_factor`` replaces ρ_k (the scaling rule's factor) and ``warmup_epochs`` the
    schedule's w_b for this stage, when given (tuned stages)."""

    epochs: int
    global_batch: int
    lr_factor: float | None = None
    warmup_epochs: float | None = None


@dataclass(frozen=True, slots=True)
class LrRule:
    """The learning-rate schedule (a factor of ``base_lr``)."""

    base_lr: float
    name: str = "constant"
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    min_factor: float = 0.0
    warmup_epochs: float = 0.0
    total_epochs: int = 1
    epoch_factors: tuple[float, ...] = ()  # an LR scheduler's factor per epoch, if any
    # An LR scheduler stepped per optimizer step: its factor after k steps (pure in k).
    step_factors: Callable[[int], float] | None = None

    def factor(self, epoch: int, t: float) -> float:
        if self.epoch_factors:
            f = self.epoch_factors[min(max(epoch, 0), len(self.epoch_factors) - 1)]
        elif self.name == "multistep":
            f = self.gamma ** sum(1 for m in self.milestones if epoch >= m)
        elif self.name == "cosine":
            x = min(max(t / self.total_epochs, 0.0), 1.0)
            f = self.min_factor + (1.0 - self.min_factor) * 0.5 * (1.0 + math.cos(math.pi * x))
        else:
            f = 1.0
        if self.warmup_epochs > 0:
            f *= min(1.0, t / self.warmup_epochs)
        return f


def scale_factor(rule: str, ratio: float) -> float:
    """The LR factor for a batch ``ratio`` = B/B_0 times the first stage's."""
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    return 1.0  # "none"


@dataclass(frozen=True, slots=True)
class Schedule:
    """Stages of global batch and the LR rule. ``stages`` add up to the job's epochs (the
    last stage also covers any epoch past them)."""

    stages: tuple[Stage, ...]
    lr: LrRule
    lr_scaling: str = "linear"
    batch_warmup_epochs: float = 0.0

    @classmethod
    def fixed(cls, global_batch: int, epochs: int, lr: LrRule) -> Schedule:
        return cls((Stage(epochs, global_batch),), lr, "none", 0.0)

    @classmethod
    def from_spec(cls, spec, epoch_factors: Any = ()) -> Schedule:
        """The schedule of a :class:`~dynabatch.actors.spec.JobSpec` (fixed or stages; goodput mode
        starts at ``global_batch`` and overrides the batch each epoch). ``epoch_factors``:
        the spec's ``optimizer.lr_scheduler`` as a factor per epoch, when it has one."""
        o = spec.optimizer
        r = o.schedule
        per_step = callable(epoch_factors)  # optimizer.lr_scheduler.interval: step
        lr = LrRule(o.lr, r.name, tuple(r.milestones), r.gamma, r.min_factor, r.warmup_epochs,
                    spec.epochs, () if per_step else tuple(epoch_factors),
                    epoch_factors if per_step else None)
        b = spec.schedule
        if b.mode == "stages":
            return cls(tuple(Stage(s.epochs, s.global_batch, s.lr_factor, s.warmup_epochs)
                             for s in b.stages), lr,
                       b.lr_scaling, b.warmup_epochs)
        return cls.fixed(spec.global_batch, spec.epochs, lr)

    @property
    def epochs(self) -> int:
        return sum(st.epochs for st in self.stages)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """The first epoch of every stage."""
        out, e = [], 0
        for st in self.stages:
            out.append(e)
            e += st.epochs
        return tuple(out)

    def stage_index(self, epoch: int) -> int:
        k = 0
        for i, start in enumerate(self.boundaries):
            if epoch >= start:
                k = i
        return k

    def batch_at(self, epoch: int) -> int:
        return self.stages[self.stage_index(epoch)].global_batch

    def stage_factor(self, k: int) -> float:
        """ρ_k: stage k's target LR factor relative to the first stage."""
        st = self.stages[k]
        if st.lr_factor is not None:
            return st.lr_factor
        return scale_factor(self.lr_scaling, st.global_batch / self.stages[0].global_batch)

    def batch_factor(self, epoch: int, t: float) -> float:
        """``f_batch``: the stage's LR factor relative to the first stage, ramped after a
        jump (see the module docstring)."""
        k = self.stage_index(epoch)
        target = self.stage_factor(k)
        st = self.stages[k]
        warm = self.batch_warmup_epochs if st.warmup_epochs is None else st.warmup_epochs
        if k == 0 or warm <= 0:
            return target
        prev = self.stage_factor(k - 1)
        frac = min(1.0, max(0.0, (t - self.boundaries[k]) / warm))
        return prev + (target - prev) * frac

    def lr_at(self, epoch: int, step: int, steps_per_epoch: int,
              batch_factor: float | None = None) -> float:
        """The learning rate of step ``step`` of ``epoch``. ``batch_factor`` replaces
        ``f_batch`` (goodput mode's AdaScale gain)."""
        t = epoch + (step + 1) / max(steps_per_epoch, 1)
        fb = self.batch_factor(epoch, t) if batch_factor is None else batch_factor
        if self.lr.step_factors is not None:
            # The job's k-th optimizer step (a fixed batch: every epoch has as many).
            k = epoch * steps_per_epoch + step
            return self.lr.base_lr * self.lr.step_factors(k) * fb
        return self.lr.base_lr * self.lr.factor(epoch, t) * fb

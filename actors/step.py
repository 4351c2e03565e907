"""The one implementation of a training step's math, for every model replica that trains:
the worker (its gradients are views of the reducer's flat buffer), the simulator's
real-gradient mode (:mod:`dynabatch.scheduler.sim.gradients`) and the parameter-server
learner (whose chunk is a step of its own, ``B = b``).

Weighting. A share of ``b_i`` of the step's ``B`` samples back-propagates
``Σ_{j ∈ b_i} ℓ_j / B``, so the SUM over the shares is the global batch's mean gradient
whatever the split; micro-batches of a share add into ``p.grad`` in place, and only the last
one's backward completes the gradient (an ``arm`` callback runs just before it). fp16's
overflow is decided on the all-reduced gradient, so every worker skips the same step
(docs/spec.md, "Precision").

The all-reduce itself and the timing are the caller's; :class:`PhaseLog` only records the
marks the caller's clock gives it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from dynabatch.actors.accumulate import micro_ranges
from dynabatch.actors.batch import Tree, rows
from dynabatch.actors.contracts import IsgdRule, StepPlan
from dynabatch.actors.optim import isgd_extras, set_lr
from dynabatch.actors.precision import (
    LossScaler,
    SpeedOptions,
    autocast_dtype,
    call_model,
    forward_of,
    prepare_input,
    set_matmul_precision,
)

if TYPE_CHECKING:
    from dynabatch.actors.workloads.objective import Objective

# (inputs, targets): each a tensor, or a dict or tuple of tensors (dynabatch.actors.batch).
Batch = tuple[Tree, Tree]
# Samples at order positions [lo, hi), on the replica's device.
Gather = Callable[[int, int], Batch]


def held(x: Tree, y: Tree) -> Gather:
    """A gather from samples already in hand: positions are rows of ``x`` and ``y``."""
    return lambda lo, hi: (rows(x, lo, hi), rows(y, lo, hi))


def cover(cov: torch.Tensor, sp: StepPlan) -> None:
    """Mark the share's positions in the step's coverage slots (``cov[k]`` is position
    ``sp.start + k``). Written before backward: the reducer's first bucket carries them."""
    lo = sp.own_start - sp.start
    cov[lo:lo + sp.own_size] = 1.0


def mean_loss(loss_sum: float, step_size: int) -> float:
    """The global batch's mean loss ψ from the all-reduced summed loss (what ISGD judges)."""
    return loss_sum / step_size


def share_sqnorm(scaled_sq: float | None, step_size: int, own_size: int) -> float | None:
    """|g_i|² of the mean gradient over a share from |(b_i/B)·g_i|², the squared norm of
    what the share back-propagated (goodput); None for an empty share or no measurement."""
    if not own_size or scaled_sq is None:
        return None
    return scaled_sq * (step_size / own_size) ** 2


def sqnorm(tensors: Iterable[torch.Tensor]) -> float:
    """Σ |t|² over the tensors, on the host."""
    return sum(float(t.square().sum()) for t in tensors)


@dataclass
class PhaseLog:
    """Per micro-batch: the marks before the gather, after it, after forward and after
    backward, and the seconds the emulation slept inside backward (a bucket's pace, see
    :mod:`dynabatch.actors.emulation`). ``mark`` is the caller's clock: host seconds, or
    CUDA events read only after the step's synchronisation."""

    mark: Callable[[], Any]
    slept: Callable[[], float] = lambda: 0.0
    records: list[tuple[Any, Any, Any, Any, float]] = field(default_factory=list)

    def breakdown(self, seconds: Callable[[Any], float]) -> tuple[float, float, float]:
        """(gather, forward, backward) seconds over the micro-batches; backward without the
        emulated sleep (the step's compute time carries the slowdown)."""
        gather = forward = backward = 0.0
        for m0, m1, m2, m3, slept in self.records:
            gather += seconds(m1) - seconds(m0)
            forward += seconds(m2) - seconds(m1)
            backward += seconds(m3) - seconds(m2) - slept
        return gather, forward, backward


@dataclass(frozen=True, slots=True)
class Share:
    """What one share's pass leaves besides the gradient in ``p.grad``."""

    loss: torch.Tensor | None  # Σ ℓ_j over the share, detached, on the device; None if empty
    micro_batches: int  # as reported: at least 1, also for an empty share


@dataclass(frozen=True, slots=True)
class Update:
    flagged: bool  # ISGD judged the batch under-trained
    extra_iters: int  # conservative updates applied before the ordinary step
    extra_s: float  # wall seconds of those iterations and their passes
    overflow: bool = False  # fp16: the all-reduced gradient was not finite: no update


class ExtraPassFailed(Exception):
    """An ISGD extra iteration failed (in practice its pass's collective: a peer) after
    ``update.extra_iters`` conservative updates were applied; the ordinary step was not
    taken. The original error is ``__cause__``."""

    def __init__(self, err: BaseException, update: Update):
        super().__init__(str(err))
        self.update = update


class StepMath:
    """A replica's step: the model, the job's per-sample loss (``objective.loss_sum``) and
    the parameters whose ``.grad`` receives the gradient."""

    def __init__(self, model: torch.nn.Module, objective: Objective,
                 params: Sequence[torch.nn.Parameter], precision: str = "fp32",
                 speed: SpeedOptions | None = None, clip_grad_norm: float | None = None):
        self.model = model
        # optimizer.clip_grad_norm: the L2 norm the ordinary step's gradient is clipped to.
        self.clip_grad_norm = clip_grad_norm
        # channels_last and torch.compile (dynabatch.actors.precision); ``model`` stays the
        # module whose state is saved, broadcast and evaluated.
        self.speed = speed or SpeedOptions()
        self._forward = forward_of(model, self.speed)
        self.objective = objective
        self.params = list(params)
        device = self.params[0].device if self.params else torch.device("cpu")
        set_matmul_precision(precision, device)
        self._autocast = autocast_dtype(precision)
        self._device_type = device.type
        # fp16 only: the loss scale (None: gradients are back-propagated unscaled).
        self.scaler = LossScaler() if precision == "fp16" else None

    def share(self, gather: Gather, lo: int, hi: int, step_size: int, cap: int | None = None,
              *, arm: Callable[[], None] | None = None, log: PhaseLog | None = None,
              loss_slot: torch.Tensor | None = None) -> Share:
        """Forward and backward of the share at positions ``[lo, hi)`` of a step of
        ``step_size`` samples, in micro-batches of at most ``cap``: adds
        ``(b_i/B)·g_i`` into every ``p.grad`` (the caller zeroes it first). ``arm`` runs
        before the last micro-batch's backward; ``log`` receives the phase marks;
        ``loss_slot`` (one element) receives the share's summed loss before that backward."""
        ranges = micro_ranges(hi - lo, cap)
        losses: list[torch.Tensor] = []

        def last(loss: torch.Tensor) -> None:
            if loss_slot is not None:
                total = loss if not losses else torch.stack([*losses, loss]).sum()
                loss_slot.copy_(total.reshape(1))
            if arm is not None:
                arm()
        for j, (a, b) in enumerate(ranges):
            losses.append(self._micro(gather, lo + a, lo + b, step_size,
                                      last if j == len(ranges) - 1 else None, log))
        # One micro-batch: its loss as it is (no extra kernel on a GPU).
        loss = (losses[0] if len(losses) == 1 else torch.stack(losses).sum()
                if losses else None)
        return Share(loss, max(1, len(ranges)))

    def _micro(self, gather: Gather, lo: int, hi: int, step_size: int,
               arm: Callable[[torch.Tensor], None] | None,
               log: PhaseLog | None) -> torch.Tensor:
        m0 = log.mark() if log is not None else None
        xb, yb = gather(lo, hi)
        xb = prepare_input(xb, self.speed)
        m1 = log.mark() if log is not None else None
        with torch.autocast(self._device_type, dtype=self._autocast,
                            enabled=self._autocast is not None):
            loss = self.objective.loss_sum(call_model(self._forward, xb), yb).float()
        m2 = log.mark() if log is not None else None
        if arm is not None:
            arm(loss.detach())
        slept = log.slept() if log is not None else 0.0
        scale = self.scaler.scale if self.scaler is not None else 1.0
        (loss * (scale / step_size) if scale != 1.0 else loss / step_size).backward()
        if log is not None:
            log.records.append((m0, m1, m2, log.mark(), log.slept() - slept))
        return loss.detach()

    def update(self, optimizer: torch.optim.Optimizer, lr: float | None,
               rule: IsgdRule | None, psi: float | None,
               again: Callable[[], float]) -> Update:
        """Apply the step whose global mean gradient is in every ``p.grad`` and whose mean
        loss is ``psi``: the plan's ``lr``, ISGD's extra iterations when ``rule`` flags the
        batch (``again()`` redoes the pass at the current weights, all-reduced, and returns
        the new ψ), then the ordinary optimizer step. Raises :class:`ExtraPassFailed` when an
        extra iteration fails (the ordinary step is then skipped). fp16: the gradient is
        unscaled first, or, when it overflowed, no update is made and the scale halves.
        ``clip_grad_norm``: the ordinary step's gradient is clipped to that global L2 norm
        (ISGD's conservative updates are not: their gradient is the sub-problem's)."""
        if self.scaler is not None:
            grads = [p.grad for p in self.params if p.grad is not None]
            overflow = self.scaler.overflowed(grads)
            if not overflow:  # by the scale this step's backward was multiplied by
                self.scaler.unscale(grads)
            self.scaler.update(overflow)
            if overflow:
                return Update(False, 0, 0.0, overflow=True)
        set_lr(optimizer, lr)
        flagged = rule is not None and rule.flagged(psi)
        extra, extra_s = 0, 0.0
        if flagged:
            t0 = time.perf_counter()
            done = [0]

            def updated(k: int) -> None:
                done[0] = k
            try:
                extra = isgd_extras(rule, psi, self.params, optimizer, again, updated)
            except Exception as err:
                raise ExtraPassFailed(err, Update(True, done[0], time.perf_counter() - t0)
                                      ) from err
            extra_s = time.perf_counter() - t0
        if self.clip_grad_norm is not None:
            # The all-reduced (and unscaled) gradient is the global batch's, bit for bit the
            # same in every worker: each computes the same global norm and the same scale.
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
        optimizer.step()
        return Update(flagged, extra, extra_s)

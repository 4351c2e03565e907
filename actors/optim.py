"""The worker's optimizer and what it does with a step plan's learning rate and ISGD rule.

Workers never compute schedules: the coordinator's pure schedule
(:mod:`dynabatch.scheduler.core.regime.schedule`)
puts the learning rate of every step in its :class:`~dynabatch.actors.contracts.StepPlan`, and a
segment's plan carries ISGD's control chart (:class:`~dynabatch.actors.contracts.IsgdPlan`), which
every
worker updates with each step's all-reduced loss; the worker applies them.

ISGD's conservative sub-problem (Wang et al., arXiv 1603.05544), for a batch ``d`` whose loss
ψ_w(d) is above the control limit::

    min_w  ½·(ψ_w(d) − limit)² + ε/(2·n_w)·‖w − w_prev‖²

with gradient ``(ψ_w(d) − limit)·∇ψ_w(d) + (ε/n_w)·(w − w_prev)``, where ``n_w`` is the
number of weights and ``w_prev`` the weights at which the batch was judged.

The order of a step (:func:`isgd_extras`). The batch is judged by its loss ψ_0 before any
update: the loss of the step's own pass, all-reduced, which also goes into the chart. A batch
above the limit is under-trained, and it *keeps training* on the sub-problem until its loss
is at or below the limit or ``max_extra`` extra iterations are spent. Each extra iteration
is one conservative update from the gradient in hand followed by one pass (forward,
backward, all-reduce) at the new weights, which gives the loss the loop checks and the
gradient of the next update. The batch's ordinary SGD step comes last, on the gradient of
the last pass. So every pass is used by an update and none is left uncounted: a step costs
``1 + extra`` passes, and a flagged batch always gets at least one extra iteration (its
loss was above the limit). Every worker sees the same all-reduced losses, so all stop at
the same iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from dynabatch.actors.contracts import IsgdRule
from dynabatch.actors.spec import JobSpec


def build_optimizer(spec: JobSpec, params) -> torch.optim.Optimizer:
    o = spec.optimizer
    if o.name == "adam":
        return torch.optim.Adam(params, lr=o.lr, weight_decay=o.weight_decay)
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
    return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov,
                           weight_decay=o.weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float | None) -> None:
    """Use the plan's learning rate for the next step (None: leave it as it is)."""
    if lr is None:
        return
    for group in optimizer.param_groups:
        group["lr"] = lr


def isgd_extras(
    rule: IsgdRule,
    psi: float,
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    global_loss_and_grad: Callable[[], float],
    on_update: Callable[[int], None] | None = None,
) -> int:
    """Run the conservative sub-problem's extra iterations on a batch whose loss is ``psi``
    and whose global mean gradient is in every ``p.grad``; returns how many ran.

    ``global_loss_and_grad()`` fills every ``p.grad`` with the global batch's mean gradient
    at the current weights and returns its mean loss ψ (the caller does the all-reduce).
    On return ``p.grad`` holds the gradient of the last pass, for the batch's ordinary step.
    ``on_update(k)`` is told after the k-th conservative update (a caller whose pass then
    fails still knows how many updates it applied).
    """
    w_prev = [p.detach().clone() for p in params]
    n_w = sum(p.numel() for p in params)
    done = 0
    while rule.more(psi, done):
        with torch.no_grad():
            for p, p0 in zip(params, w_prev, strict=True):
                p.grad.mul_(psi - rule.limit).add_(p - p0, alpha=rule.epsilon / n_w)
        optimizer.step()
        done += 1
        if on_update is not None:
            on_update(done)
        psi = global_loss_and_grad()
    return done

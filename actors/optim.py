"""The worker's optimizer and what it does with a step plan's learning rate and ISGD rule.

Workers never compute schedules: the coordinator's pure schedule (:mod:`scheduler.schedule`)
puts the learning rate of every step in its :class:`~actors.contracts.StepPlan`, and the ISGD
monitor (:mod:`scheduler.isgd`) puts the control limit there; the worker applies them.

ISGD's conservative sub-problem (Wang et al., arXiv 1603.05544), for a batch ``d`` whose loss
ψ_w(d) is above the control limit::

    min_w  ½·(ψ_w(d) − limit)² + ε/(2·n_w)·‖w − w_prev‖²

with gradient ``(ψ_w(d) − limit)·∇ψ_w(d) + (ε/n_w)·(w − w_prev)``, where ``n_w`` is the
number of weights and ``w_prev`` the weights when the extra iterations begin. Each extra
iteration recomputes the global batch's loss and gradient (every worker its share, one
all-reduce), stops as soon as the loss is at or below the limit
(:meth:`~actors.contracts.IsgdRule.more`), and otherwise takes one optimizer step on that
gradient. Every worker sees the same all-reduced loss, so all stop at the same iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from actors.contracts import IsgdRule
from actors.spec import JobSpec


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
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    global_loss_and_grad: Callable[[], float],
) -> int:
    """Run the conservative sub-problem's extra iterations; returns how many stepped.

    ``global_loss_and_grad()`` fills every ``p.grad`` with the global batch's mean gradient
    at the current weights and returns its mean loss ψ (the caller does the all-reduce).
    """
    w_prev = [p.detach().clone() for p in params]
    n_w = sum(p.numel() for p in params)
    done = 0
    while done < rule.max_extra:
        psi = global_loss_and_grad()
        if not rule.more(psi, done):
            break
        with torch.no_grad():
            for p, p0 in zip(params, w_prev, strict=True):
                p.grad.mul_(psi - rule.limit).add_(p - p0, alpha=rule.epsilon / n_w)
        optimizer.step()
        done += 1
    return done

"""User optimizers for the tests: what ``optimizer.name: "pkg.mod:make"`` names."""

from __future__ import annotations

import torch


def make(params, decay: float = 0.0):
    """``make(params, **options)``: an RMSprop whose alpha is the option (the plan sets lr)."""
    return torch.optim.RMSprop(params, lr=1.0, alpha=decay)


def not_an_optimizer(params):
    return list(params)


def warmup_then_decay(optimizer, warmup: int, total: int):
    """``make(optimizer, **options)`` for ``optimizer.lr_scheduler.name``: linear warmup over
    ``warmup`` steps, then linear decay to 0 at ``total`` (Hugging Face's
    get_linear_schedule_with_warmup)."""
    def factor(k: int) -> float:
        if k < warmup:
            return k / max(1, warmup)
        return max(0.0, (total - k) / max(1, total - warmup))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

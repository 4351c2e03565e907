"""User optimizers for the tests: what ``optimizer.name: "pkg.mod:make"`` names."""

from __future__ import annotations

import torch


def make(params, decay: float = 0.0):
    """``make(params, **options)``: an RMSprop whose alpha is the option (the plan sets lr)."""
    return torch.optim.RMSprop(params, lr=1.0, alpha=decay)


def not_an_optimizer(params):
    return list(params)

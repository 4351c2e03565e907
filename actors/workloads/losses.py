"""Per-sample losses: ``(outputs, targets) -> losses`` of shape ``(B,)``, one per sample, so
that a worker's ``Σ ℓ_j / B`` over its share, SUM all-reduced, is the global batch's mean
loss's gradient for any split (docs/spec.md, "Losses, metrics and targets").

Built-ins: ``cross_entropy`` (``(B, C)`` logits, ``(B,)`` labels), ``next_token`` (``(B, T,
V)`` logits, ``(B, T)`` targets; a sample's loss is its mean token cross-entropy) and
``mse`` (a sample's mean squared error).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from dynabatch.actors.workloads import WorkloadError
from dynabatch.actors.workloads.imports import resolve_callable

PerSample = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if outputs.dim() > 2:  # (B, ..., C) with (B, ...) targets: mean over the positions
        per = F.cross_entropy(outputs.flatten(0, -2), targets.flatten(), reduction="none")
        return per.view(targets.shape).flatten(1).mean(1)
    return F.cross_entropy(outputs, targets, reduction="none")


def next_token(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if outputs.dim() != 3 or targets.dim() != 2:
        raise ValueError(
            f"next_token needs (B, T, V) logits and (B, T) targets, got outputs "
            f"{tuple(outputs.shape)} and targets {tuple(targets.shape)}"
        )
    return cross_entropy(outputs, targets)


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    b = outputs.shape[0]
    o = outputs.reshape(b, -1)
    t = targets.reshape(b, -1).to(o.dtype)
    if o.shape != t.shape:
        raise ValueError(
            f"mse needs outputs and targets of the same size per sample, got outputs "
            f"{tuple(outputs.shape)} and targets {tuple(targets.shape)}"
        )
    return (o - t).pow(2).mean(1)


LOSSES: dict[str, PerSample] = {
    "cross_entropy": cross_entropy,
    "next_token": next_token,
    "mse": mse,
}
# The loss a dataset's targets call for when the spec names none.
DEFAULT_LOSS = {"classes": "cross_entropy", "tokens": "next_token", "values": "mse"}


def resolve_loss(name: str) -> PerSample:
    """A built-in loss by name, or the user's function by import path (field ``loss``)."""
    return LOSSES.get(name) or resolve_callable(name, "loss")


def check_per_sample(values: object, batch: int, field: str, name: str) -> torch.Tensor:
    """``values`` if it is a floating tensor of shape ``(batch,)``; else a WorkloadError."""
    if not isinstance(values, torch.Tensor):
        raise WorkloadError(
            f"{field}: {name!r} returned a {type(values).__name__}, not a tensor of one value "
            f"per sample (shape ({batch},))"
        )
    if tuple(values.shape) != (batch,):
        raise WorkloadError(
            f"{field}: {name!r} returned shape {tuple(values.shape)}; it must return one value "
            f"per sample, shape ({batch},)"
        )
    if not values.is_floating_point():
        raise WorkloadError(f"{field}: {name!r} returned dtype {values.dtype}, not floating point")
    return values

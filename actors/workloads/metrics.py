"""Evaluation metrics on the held-out set.

A metric is a per-sample function ``(outputs, targets) -> values (B,)`` plus a ``finish``
applied to the mean over the test set:

* ``accuracy``: the fraction of correct argmax predictions (per token for sequences);
* ``mse``: the mean squared error (:func:`dynabatch.actors.workloads.losses.mse`);
* ``perplexity``: ``exp`` of the mean per-sample cross-entropy; for equal-length sequences
  that is ``exp(-(1/NT) Σ log p(y_t))``, the per-token perplexity;
* a user ``"pkg.mod:function"``: the mean of its per-sample values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from dynabatch.actors.spec.sections import DEFAULT_METRICS as _SPEC_DEFAULT_METRICS
from dynabatch.actors.workloads import losses
from dynabatch.actors.workloads.imports import resolve_callable


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    hit = (outputs.argmax(-1) == targets).float()
    return hit.flatten(1).mean(1) if hit.dim() > 1 else hit


def _identity(v: float) -> float:
    return v


def _exp(v: float) -> float:
    return math.exp(min(v, 700.0))  # a diverged model reads as a huge number, not an error


@dataclass(frozen=True)
class Metric:
    name: str  # what it is shown as (the spec's metrics.<i>.name)
    per_sample: losses.PerSample
    finish: Callable[[float], float] = _identity
    fn: str = ""  # what the spec names: a built-in or an import path (for errors)

    def __post_init__(self) -> None:
        if not self.fn:
            object.__setattr__(self, "fn", self.name)


BUILTIN = {
    "accuracy": Metric("accuracy", accuracy),
    "mse": Metric("mse", losses.mse),
    "perplexity": Metric("perplexity", losses.cross_entropy, _exp),
}
# Metrics a loss calls for when the spec names none (the spec's table: submit-time checks
# of the metric names a job computes read it without torch).
DEFAULT_METRICS = _SPEC_DEFAULT_METRICS


def resolve_metric(fn: str, field: str, name: str | None = None) -> Metric:
    """A built-in metric, or the user's per-sample function by import path, shown as
    ``name`` (default: ``fn``)."""
    found = BUILTIN.get(fn)
    if found is None:
        found = Metric(fn, resolve_callable(fn, field))
    return found if name is None else replace(found, name=name)

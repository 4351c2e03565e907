"""Evaluation metrics on the held-out set, both kinds exact over a set split across workers.

* **per-sample**: a function ``(outputs, targets) -> values (B,)`` (``accuracy``, ``mse``,
  ``perplexity``: ``exp`` of the mean cross-entropy, or the user's), plus a ``finish``
  applied to the mean over the set; the shards' sums add up.
* **stateful**: a ``torchmetrics.Metric`` whose states are sufficient statistics (f1,
  precision, recall, auroc, the confusion matrix, mae, rmse, r2, or the user's subclass).
  Each worker updates one on its shard and ships its states as numpy arrays
  (:class:`Accumulator`); the driver merges the shards' states with torchmetrics' own
  ``merge_state`` and computes once (:func:`compute`): the value one process gives over
  the whole set, whatever the split. Class metrics take logits ``(B, C)`` (or ``(B, T, C)``
  per token); one logit per sample is a binary classifier.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from dynabatch.actors.spec.sections import BUILTIN_METRICS
from dynabatch.actors.workloads import WorkloadError, losses
from dynabatch.actors.workloads.imports import resolve_callable
from torch.utils._pytree import tree_map

if TYPE_CHECKING:
    import torchmetrics


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    hit = (outputs.argmax(-1) == targets).float()
    return hit.flatten(1).mean(1) if hit.dim() > 1 else hit


def _exp(v: float) -> float:
    return math.exp(min(v, 700.0))  # a diverged model reads as a huge number, not an error


Args = dict[str, Any]  # what builds a stateful metric, read off the first batch
Prepare = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Stateful:
    """How a torchmetrics metric is built and fed: ``args_of(outputs, targets)`` reads what
    it needs off a batch (the number of classes), ``make(args)`` builds it, ``prepare``
    turns a batch into its ``update``'s arguments."""

    make: Callable[[Args], torchmetrics.Metric]
    args_of: Callable[[torch.Tensor, torch.Tensor], Args] = lambda outputs, targets: {}
    prepare: Prepare = lambda outputs, targets: (outputs, targets)


@dataclass(frozen=True)
class Metric:
    name: str  # what it is shown as (the spec's metrics.<i>.name)
    per_sample: losses.PerSample | None = None
    finish: Callable[[float], float] = float
    fn: str = ""  # what the spec names: a built-in or an import path (for errors)
    stateful: Stateful | None = None

    def __post_init__(self) -> None:
        if not self.fn:
            object.__setattr__(self, "fn", self.name)


# ------------------------------------------------------------------ built-in stateful
def _classes(outputs: torch.Tensor, targets: torch.Tensor) -> Args:
    c = int(outputs.shape[-1]) if outputs.dim() > targets.dim() else 1
    return {"num_classes": c}


def _class_batch(outputs: torch.Tensor, targets: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    if targets.is_floating_point():
        raise ValueError("the targets are values, not classes: a classification metric "
                         "needs class labels")
    # The outputs are logits (what the loss takes): turned into probabilities here, once,
    # since torchmetrics decides per batch (a batch whose logits fall in [0, 1] would be
    # read as probabilities), which would make the value depend on the batching.
    if outputs.dim() > targets.dim() and outputs.shape[-1] > 1:
        # torchmetrics takes the classes on dim 1: (B, T, C) -> (B, C, T).
        probs = outputs.float().softmax(-1)
        return (probs.movedim(-1, 1) if probs.dim() > 2 else probs), targets.long()
    return outputs.reshape(targets.shape).float().sigmoid(), targets.long()  # one logit


def _classification(multi: Callable[..., torchmetrics.Metric],
                    binary: Callable[..., torchmetrics.Metric],
                    average: str | None = None) -> Stateful:
    def make(args: Args) -> torchmetrics.Metric:
        n = args["num_classes"]
        if n == 1:
            return binary()
        return multi(num_classes=n, **({"average": average} if average else {}))
    return Stateful(make, _classes, _class_batch)


def _values(outputs: torch.Tensor, targets: torch.Tensor) -> Args:
    return {"num_outputs": int(targets.shape[-1]) if targets.dim() == 2 else 1}


def _value_batch(outputs: torch.Tensor, targets: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return outputs.reshape(targets.shape).float().flatten(), targets.float().flatten()


def _r2_batch(outputs: torch.Tensor, targets: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    preds, y = outputs.reshape(targets.shape).float(), targets.float()
    return (preds, y) if y.dim() == 2 and y.shape[-1] > 1 else (preds.flatten(), y.flatten())


def _builtin_stateful(fn: str, average: str | None) -> Stateful | None:
    if fn not in BUILTIN_METRICS:
        return None
    # Imported here: torchmetrics' import (its text metrics pull in transformers) would
    # cost every worker's start seconds, and the built-in sums need none of it.
    from torchmetrics import classification as C
    from torchmetrics import regression as R

    avg = average or "macro"
    match fn:
        case "f1":
            return _classification(C.MulticlassF1Score, C.BinaryF1Score, avg)
        case "precision":
            return _classification(C.MulticlassPrecision, C.BinaryPrecision, avg)
        case "recall":
            return _classification(C.MulticlassRecall, C.BinaryRecall, avg)
        case "auroc":
            return _classification(C.MulticlassAUROC, C.BinaryAUROC, avg)
        case "confusion_matrix":
            return _classification(C.MulticlassConfusionMatrix, C.BinaryConfusionMatrix)
        case "mae":
            return Stateful(lambda a: R.MeanAbsoluteError(), _values, _value_batch)
        case "rmse":
            return Stateful(lambda a: R.MeanSquaredError(squared=False), _values, _value_batch)
        case "r2":
            return Stateful(lambda a: R.R2Score(num_outputs=a["num_outputs"])
                            if a["num_outputs"] > 1 else R.R2Score(), _values, _r2_batch)
    return None


BUILTIN = {
    "accuracy": Metric("accuracy", accuracy),
    "mse": Metric("mse", losses.mse),
    "perplexity": Metric("perplexity", losses.cross_entropy, _exp),
}


def resolve_metric(fn: str, field: str, name: str | None = None,
                   average: str | None = None) -> Metric:
    """A built-in metric, the user's per-sample function or ``torchmetrics.Metric`` subclass
    by import path, shown as ``name`` (default: ``fn``)."""
    found = BUILTIN.get(fn)
    if found is None and (st := _builtin_stateful(fn, average)) is not None:
        found = Metric(fn, stateful=st)
    if found is None:
        obj = resolve_callable(fn, field)
        # A torchmetrics.Metric subclass's module has imported torchmetrics.
        tm = sys.modules.get("torchmetrics")
        if isinstance(obj, type) and tm is not None and issubclass(obj, tm.Metric):
            found = Metric(fn, stateful=Stateful(_user_metric(obj, fn, field)))
        else:
            found = Metric(fn, obj)
    return found if name is None else replace(found, name=name)


def _user_metric(cls: type[torchmetrics.Metric], fn: str, field: str
                 ) -> Callable[[Args], torchmetrics.Metric]:
    def make(args: Args) -> torchmetrics.Metric:
        try:
            return cls()
        except Exception as err:
            raise WorkloadError(f"{field}: {fn!r} cannot be built without arguments "
                                f"({type(err).__name__}: {err})") from err
    return make


# ------------------------------------------------------------------ states
class Accumulator:
    """One stateful metric over one worker's shard: built from the first batch."""

    def __init__(self, metric: Metric):
        assert metric.stateful is not None
        self.spec = metric.stateful
        self.args: Args | None = None
        self.metric: torchmetrics.Metric | None = None

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        if self.metric is None:
            self.args = self.spec.args_of(outputs, targets)
            self.metric = self.spec.make(self.args).to(outputs.device)
        preds, y = self.spec.prepare(outputs, targets)
        self.metric.update(preds, y)

    def payload(self) -> dict[str, Any] | None:
        """What travels to the driver: ``{"args", "state"}`` (None before any batch)."""
        if self.metric is None:
            return None
        return {"args": dict(self.args or {}), "state": export_state(self.metric)}


def export_state(metric: torchmetrics.Metric) -> dict[str, Any]:
    """A metric's states as numpy arrays (a list state: a list of arrays), picklable and
    free of any device."""
    return tree_map(lambda t: t.detach().cpu().numpy(), dict(metric.metric_state))


def compute(metric: Metric, payloads: list[dict[str, Any]]) -> float | list[list[float]]:
    """One metric over the union of the shards: a fresh one merges every shard's states
    (``torchmetrics.Metric.merge_state``: sums add, lists concatenate) and computes once.
    A scalar is a float; a matrix (the confusion matrix) a list of rows."""
    assert metric.stateful is not None and payloads
    m = metric.stateful.make(payloads[0]["args"])
    for p in payloads:
        # Copied: the states arrive read-only from Ray's object store, and a tensor over one
        # makes torch warn, in the job's log, of undefined behaviour.
        m.merge_state(tree_map(lambda a: torch.from_numpy(np.array(a)), p["state"]))
    with warnings.catch_warnings():
        # merge_state does not count as an update: torchmetrics would warn that none ran.
        warnings.filterwarnings("ignore", message=".*before the ``update`` method.*")
        value = m.compute()
    return _plain(value)


def _plain(value: Any) -> float | list[list[float]]:
    t = torch.as_tensor(value).detach().cpu()
    if t.dim() == 0:
        return float(t)
    if t.dim() == 1 and t.numel() == 1:
        return float(t[0])
    if t.dim() == 1:  # per-output values (r2 with uniform averaging gives a scalar)
        return [[float(v) for v in t]]
    return [[float(v) for v in row] for row in t.reshape(t.shape[0], -1)]

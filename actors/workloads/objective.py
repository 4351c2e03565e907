"""What a worker optimises and reports: the job's per-sample loss and its metrics.

:func:`objective_for` resolves the spec's ``loss`` and ``metrics`` (defaults from the
dataset's targets, see :data:`dynabatch.actors.workloads.losses.DEFAULT_LOSS`). The worker calls
:meth:`Objective.loss_sum` in its training step (the sum of per-sample losses; it scales
it by ``1/B`` itself) and :meth:`Objective.eval_sums` on its shard of the held-out set
(:meth:`Objective.finish` turns the shards' combined sums into the scores);
:func:`check_objective` runs both on two samples when the job loads its data, so a loss of
the wrong shape or a metric that does not fit fails the job at once, naming the field.
Both see what the model returns through the outputs adapter (:func:`model_outputs`: a
transformers ``ModelOutput``'s logits, or the tensor a user's ``model.output`` picks).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from dynabatch.actors.batch import rows, to_device
from dynabatch.actors.errors import first_line
from dynabatch.actors.precision import call_model
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.spec.sections import DEFAULT_METRICS
from dynabatch.actors.workloads import WorkloadError
from dynabatch.actors.workloads import eval_metrics as M
from dynabatch.actors.workloads import losses as L
from dynabatch.actors.workloads.imports import describe, resolve_callable
from dynabatch.actors.workloads.metric_states import STATES
from torch import nn

Outputs = Callable[[Any], Any]  # what the model returns -> what the loss gets


def targets_kind(y: np.ndarray) -> str:
    """``classes``, ``tokens`` or ``values``, from normalised DatasetArrays targets."""
    arr = np.asarray(y)
    if arr.dtype.kind == "f":
        return "values"
    return "tokens" if arr.ndim == 2 else "classes"


@dataclass(frozen=True)
class Objective:
    loss_name: str
    loss: L.PerSample
    metrics: tuple[tuple[str, M.Metric], ...]  # (spec field, metric)
    # The outputs adapter (model.output): applied to what the model returns before the loss
    # and the metrics see it.
    outputs: Outputs

    def loss_sum(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """``Σ_j ℓ_j`` over the batch (a scalar tensor with a graph); ``outputs`` is what
        the model returned (a tensor, or e.g. a ModelOutput: see :func:`model_outputs`)."""
        return L.check_per_sample(self.loss(self.outputs(outputs), targets), len(targets),
                                  "loss", self.loss_name).sum()

    def eval_sums(self, model: nn.Module, x: np.ndarray, y: np.ndarray, lo: int, hi: int,
                  device: torch.device, batch: int = 1024) -> dict[str, Any]:
        """``{"n": samples, "loss": Σ ℓ_j, <metric>: Σ v_j, ..., "states": {<metric>:
        [its states]}}`` over ``(x, y)[lo:hi]`` (``states``: the stateful metrics').

        Every metric is a per-sample function plus a ``finish`` of the mean (see
        :mod:`dynabatch.actors.workloads.eval_metrics`), so the sums of disjoint shards add up
        to the sums of their union: the held-out set can be split across workers, the shards'
        sums added
        (``dynabatch.scheduler.sync.evaluation.combine``) and :meth:`finish` applied once."""
        def batches():
            for s in range(lo, hi, batch):
                e = min(s + batch, hi)
                # A writable copy of the batch: held-out sets come from the object
                # store read-only, which torch warns about in every job log.
                yield np.array(x[s:e]), np.array(y[s:e])

        return self.eval_batches(model, batches(), max(0, hi - lo), device)

    def eval_batches(self, model: nn.Module, batches: Iterable[tuple[Any, Any]], n: int,
                     device: torch.device) -> dict[str, Any]:
        """:meth:`eval_sums` over ``n`` samples given as batches of numpy arrays, or of
        dicts or tuples of tensors (a source read by position: ``dynabatch.actors.data``)."""
        sums: dict[str, Any] = {"n": float(n), "loss": 0.0} | {
            m.name: 0.0 for _, m in self.metrics if m.stateful is None}
        states = {m.name: M.Accumulator(m) for _, m in self.metrics if m.stateful is not None}
        model.eval()
        try:
            with torch.no_grad():
                for xa, ya in batches:
                    xb, yb = to_device(xa, device), to_device(ya, device)
                    out = self.outputs(call_model(model, xb))
                    # A loss or metric that passed the two-sample check can still raise
                    # on real batches: the error names it, as that check does.
                    v = per_sample_of("loss", self.loss_name, self.loss, out, yb)
                    sums["loss"] += float(v.sum())
                    for field, m in self.metrics:
                        if m.stateful is not None:
                            with failing_as(field, m.fn):
                                states[m.name].update(out, yb)
                            continue
                        v = per_sample_of(field, m.fn, m.per_sample, out, yb)
                        sums[m.name] += float(v.sum())
        finally:
            model.train()
        if states:
            # The stateful metrics' states, as numpy: the driver merges them across shards.
            sums[STATES] = {k: [p] for k, a in states.items() if (p := a.payload())}
        return sums

    def finish(self, sums: dict[str, Any]) -> dict[str, Any]:
        """``{"loss": mean per-sample loss, <metric>: value, ...}`` from (combined)
        :meth:`eval_sums`: a per-sample metric's ``finish`` of its mean, a stateful one
        computed once from every shard's merged states (a matrix is a list of rows)."""
        n = max(sums.get("n", 0.0), 1.0)
        out: dict[str, Any] = {"loss": sums["loss"] / n}
        states = sums.get(STATES) or {}
        for _, m in self.metrics:
            if m.stateful is None:
                out[m.name] = m.finish(sums[m.name] / n)
            elif states.get(m.name):
                out[m.name] = M.compute(m, states[m.name])
        return out


def objective_for(spec: JobSpec, kind: str) -> Objective:
    loss_name = spec.loss or L.DEFAULT_LOSS[kind]
    loss = L.resolve_loss(loss_name)
    named = [(m.name, m.fn, m.average) for m in spec.metrics] if spec.metrics is not None else [
        (n, n, None)
        for n in DEFAULT_METRICS.get(loss_name) or DEFAULT_METRICS[L.DEFAULT_LOSS[kind]]]
    # Each metric keyed by its spec name (test_metrics, /metrics, the page, the CLI).
    metrics = tuple((f"metrics.{i}", M.resolve_metric(fn, f"metrics.{i}", name, average))
                    for i, (name, fn, average) in enumerate(named))
    return Objective(loss_name, loss, metrics, model_outputs(spec.model.output))


def model_outputs(path: str | None) -> Outputs:
    """The outputs adapter: what the model returns -> what the loss and metrics get.

    With ``path`` (``model.output: "pkg.mod:fn"``): ``fn(outputs)``, which must return a
    tensor. Without: a transformers ``ModelOutput``'s ``logits`` (a Hugging Face model's
    forward returns one), anything else as it is (a tensor; or, say, a tuple that the
    user's own loss takes apart: :func:`check_objective` refuses it for a built-in loss).
    Problems are one-line WorkloadErrors naming ``model.output``."""
    if path is None:
        return _default_outputs
    fn = resolve_callable(path, "model.output")

    def picked(outputs: Any) -> torch.Tensor:
        try:
            out = fn(outputs)
        except WorkloadError:
            raise
        except Exception as err:
            raise WorkloadError(f"model.output: {path!r} raised {describe(err)}") from err
        if not isinstance(out, torch.Tensor):
            raise WorkloadError(f"model.output: {path!r} returned a {type(out).__name__}, "
                                "not a tensor")
        return out

    return picked


def _default_outputs(outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs
    # A ModelOutput means transformers is loaded already: no import here for plain models.
    generic = sys.modules.get("transformers.utils.generic")
    if generic is not None and isinstance(outputs, generic.ModelOutput):
        logits = outputs.get("logits")
        if isinstance(logits, torch.Tensor):
            return logits
        have = ", ".join(outputs.keys()) or "nothing"
        raise WorkloadError(f"model.output: the model's {type(outputs).__name__} has no "
                            f"logits (it has {have}): name the tensor the loss gets with "
                            "model.output: 'pkg.mod:fn'")
    return outputs


def check_objective(spec: JobSpec, model: nn.Module, x: np.ndarray, y: np.ndarray) -> Objective:
    """Resolve the objective and run the loss and every metric on two samples (``x`` arrays,
    or a batch of dicts or tuples of tensors); a problem is a one-line WorkloadError naming
    ``loss`` or ``metrics.i``."""
    obj = objective_for(spec, targets_kind(y))
    cpu = torch.device("cpu")
    xb, yb = to_device(rows(x, 0, 2), cpu), to_device(rows(y, 0, 2), cpu)
    with torch.no_grad():
        out = obj.outputs(call_model(model, xb))
        if not isinstance(out, torch.Tensor) and obj.loss_name in L.LOSSES:
            raise WorkloadError(
                f"model.output: the model returned a {type(out).__name__}, not a tensor, and "
                f"loss {obj.loss_name!r} needs one: name the tensor the loss gets with "
                "model.output: 'pkg.mod:fn'")
        per_sample_of("loss", obj.loss_name, obj.loss, out, yb)
        for field, m in obj.metrics:
            if m.stateful is None:
                per_sample_of(field, m.fn, m.per_sample, out, yb)
                continue
            acc = M.Accumulator(m)
            with failing_as(field, m.fn):
                acc.update(out, yb)
                payload = acc.payload()
                M.compute(m, [payload] if payload else [])
    return obj


@contextmanager
def failing_as(field: str, name: str) -> Iterator[None]:
    """An exception in the block (a loss's or metric's own code) as a one-line
    WorkloadError naming ``field`` and ``name``."""
    try:
        yield
    except WorkloadError:
        raise
    except Exception as err:
        raise WorkloadError(
            f"{field}: {name!r} failed on this dataset and model ({first_line(err)})"
        ) from err


def per_sample_of(field: str, name: str, fn: Any, outputs: torch.Tensor,
                  targets: torch.Tensor) -> torch.Tensor:
    """``fn(outputs, targets)``, one floating value per sample; anything else, or an
    exception, is a one-line WorkloadError naming ``field`` and ``name``."""
    with failing_as(field, name):
        values = fn(outputs, targets)
    return L.check_per_sample(values, len(targets), field, name)

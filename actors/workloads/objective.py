"""What a worker optimises and reports: the job's per-sample loss and its metrics.

:func:`objective_for` resolves the spec's ``loss`` and ``metrics`` (defaults from the
dataset's targets, see :data:`actors.workloads.losses.DEFAULT_LOSS`). The worker calls
:meth:`Objective.loss_sum` in its training step (the sum of per-sample losses; it scales
it by ``1/B`` itself) and :meth:`Objective.evaluate` on the held-out set;
:func:`check_objective` runs both on two samples when the job loads its data, so a loss of
the wrong shape or a metric that does not fit fails the job at once, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from actors.spec import JobSpec
from actors.workloads import WorkloadError
from actors.workloads import losses as L
from actors.workloads import metrics as M
from actors.workloads.imports import describe


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

    def per_sample(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return L.check_per_sample(self.loss(outputs, targets), len(targets), "loss",
                                  self.loss_name)

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``Σ_j ℓ_j`` over the batch (a scalar tensor with a graph)."""
        return self.per_sample(outputs, targets).sum()

    def evaluate(self, model: nn.Module, x: np.ndarray, y: np.ndarray, device: torch.device,
                 batch: int = 1024) -> dict[str, float]:
        """``{"loss": mean per-sample loss, <metric>: value, ...}`` over ``(x, y)``."""
        sums = {"loss": 0.0} | {m.name: 0.0 for _, m in self.metrics}
        model.eval()
        try:
            with torch.no_grad():
                for s in range(0, len(y), batch):
                    xb = torch.from_numpy(np.asarray(x[s:s + batch])).to(device)
                    yb = torch.from_numpy(np.asarray(y[s:s + batch])).to(device)
                    out = model(xb)
                    sums["loss"] += float(self.per_sample(out, yb).sum())
                    for field, m in self.metrics:
                        v = L.check_per_sample(m.per_sample(out, yb), len(yb), field, m.name)
                        sums[m.name] += float(v.sum())
        finally:
            model.train()
        n = max(len(y), 1)
        out = {"loss": sums["loss"] / n}
        for _, m in self.metrics:
            out[m.name] = m.finish(sums[m.name] / n)
        return out


def objective_for(spec: JobSpec, kind: str) -> Objective:
    loss_name = spec.loss or L.DEFAULT_LOSS[kind]
    loss = L.resolve_loss(loss_name)
    names = spec.metrics
    if names is None:
        names = M.DEFAULT_METRICS.get(loss_name) or M.DEFAULT_METRICS[L.DEFAULT_LOSS[kind]]
    metrics = tuple((f"metrics.{i}", M.resolve_metric(n, f"metrics.{i}"))
                    for i, n in enumerate(names))
    return Objective(loss_name, loss, metrics)


def check_objective(spec: JobSpec, model: nn.Module, x: np.ndarray, y: np.ndarray) -> Objective:
    """Resolve the objective and run the loss and every metric on two samples; a problem
    is a one-line WorkloadError naming ``loss`` or ``metrics.i``."""
    obj = objective_for(spec, targets_kind(y))
    xb = torch.from_numpy(np.asarray(x[:2]))
    yb = torch.from_numpy(np.asarray(y[:2]))
    with torch.no_grad():
        out = model(xb)
        for field, name, fn in [("loss", obj.loss_name, obj.loss),
                                *((f, m.name, m.per_sample) for f, m in obj.metrics)]:
            try:
                values = fn(out, yb)
            except Exception as err:
                raise WorkloadError(
                    f"{field}: {name!r} failed on this dataset and model ({describe(err)})"
                ) from err
            L.check_per_sample(values, len(yb), field, name)
    return obj

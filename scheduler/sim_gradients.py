"""Real gradients for the simulator: every simulated worker's share computed in-process.

Imported only in real-gradient mode (it imports torch). One model replica stands for every
worker: in synchronous training all replicas hold the same weights after each step (the
all-reduce gives each the same gradient, and a joining worker receives the state by
broadcast), so one copy is exact. Each worker's share is still computed on its own, from the
order positions the plan gave it, exactly as the real worker does
(:meth:`actors.worker.Worker._step`): the summed loss over its ``b_i`` samples scaled by
``1/B_s``, so its gradient is ``(b_i/B_s)·g_i``. The shares' gradients are then summed, which
is the SUM all-reduce: ``Σ_i (b_i/B_s)·g_i``, the mean gradient of the global batch. The
optimizer is the one the worker builds (:func:`actors.optim.build_optimizer`), on the model
the worker builds from the same seed, so the simulated run trains the same SGD as a real one.
The plan's learning rate and ISGD rule are applied as the worker applies them
(:mod:`actors.optim`), and in goodput mode the same gradient norms are reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actors.contracts import StepPlan, epoch_order
from actors.optim import build_optimizer, isgd_extras, set_lr
from actors.spec import JobSpec
from actors.worker import to_cpu
from actors.workloads.datasets import load_dataset
from actors.workloads.models import build_model
from actors.workloads.objective import objective_for, targets_kind


@dataclass(frozen=True, slots=True)
class StepOutcome:
    losses: list[float]  # each worker's summed loss over its share
    flagged: bool = False
    extra_iters: int = 0
    local_sqnorms: list[float | None] | None = None
    global_sqnorm: float | None = None


class GradientEngine:
    def __init__(self, spec: JobSpec):
        ds = load_dataset(spec.dataset, seed=spec.seed)
        self.name = ds.name
        self.x = torch.from_numpy(np.asarray(ds.x_train))
        self.y = torch.from_numpy(np.asarray(ds.y_train))
        self.x_test = np.asarray(ds.x_test)
        self.y_test = np.asarray(ds.y_test)
        self.objective = objective_for(spec, targets_kind(ds.y_train))
        torch.manual_seed(spec.seed)  # the worker seeds the same way before building
        self.model = build_model(spec.model, tuple(ds.input_shape), ds.num_classes)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(spec, self.params)
        self.model_bytes = 4 * sum(p.numel() for p in self.params)
        self._order: tuple[tuple[int, int, int], np.ndarray] | None = None

    @property
    def n_train(self) -> int:
        return len(self.y)

    @property
    def n_test(self) -> int:
        return len(self.y_test)

    def _epoch_order(self, seed: int, epoch: int, n: int) -> np.ndarray:
        key = (seed, epoch, n)
        if self._order is None or self._order[0] != key:
            self._order = (key, epoch_order(*key))
        return self._order[1]

    def step(self, seed: int, epoch: int, dataset_size: int,
             shares: Sequence[StepPlan]) -> StepOutcome:
        """Train one step from the workers' shares (one per worker, in order)."""
        order = self._epoch_order(seed, epoch, dataset_size)
        batches = [None if not sp.own_size else torch.from_numpy(
            np.asarray(order[sp.own_start:sp.own_start + sp.own_size], dtype=np.int64))
            for sp in shares]
        first = shares[0]
        noise = first.noise
        losses, local = self._gradient(shares, batches, noise)
        global_sq = (float(sum(float(p.grad.square().sum()) for p in self.params))
                     if noise else None)
        set_lr(self.optimizer, first.lr)
        rule = first.isgd
        flagged = rule is not None and rule.flagged(sum(losses) / first.size)
        self.optimizer.step()
        extra = 0
        if flagged:
            def again() -> float:
                return sum(self._gradient(shares, batches, False)[0]) / first.size
            extra = isgd_extras(rule, self.params, self.optimizer, again)
        return StepOutcome(losses, flagged, extra, local if noise else None, global_sq)

    def _gradient(self, shares: Sequence[StepPlan], batches, noise: bool
                  ) -> tuple[list[float], list[float | None]]:
        """Sum the shares' gradients ``(b_i/B)·g_i`` into ``p.grad`` (the all-reduce);
        returns each share's summed loss and, with ``noise``, each |g_i|²."""
        total = [torch.zeros_like(p) for p in self.params]
        losses: list[float] = []
        local: list[float | None] = []
        for sp, ids in zip(shares, batches, strict=True):
            if ids is None:
                losses.append(0.0)
                local.append(None)
                continue
            loss = self.objective.loss_sum(self.model(self.x.index_select(0, ids)),
                                           self.y.index_select(0, ids))
            grads = torch.autograd.grad(loss / sp.size, self.params)
            for acc, g in zip(total, grads, strict=True):
                acc.add_(g)
            losses.append(float(loss.detach()))
            if noise:
                sq = sum(float(g.square().sum()) for g in grads)
                local.append(sq * (sp.size / sp.own_size) ** 2)
        for p, g in zip(self.params, total, strict=True):
            p.grad = g
        return losses, local

    def evaluate(self, batch: int = 1024) -> dict[str, float]:
        """The held-out loss and metrics, as :meth:`actors.worker.Worker.evaluate`."""
        return self.objective.evaluate(self.model, self.x_test, self.y_test,
                                       torch.device("cpu"), batch)

    def state(self) -> dict[str, Any]:
        return {"model": to_cpu(self.model.state_dict()),
                "optimizer": to_cpu(self.optimizer.state_dict())}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

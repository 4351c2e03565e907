"""Real gradients for the simulator: every simulated worker's share computed in-process, by
the worker's own step math (:class:`dynabatch.actors.step.StepMath`) on the model and
optimizer the worker builds. Imported only in real-gradient mode (it imports torch).

One model replica stands for every worker: in synchronous training all replicas hold the
same weights after each step, and a regroup broadcasts one member's state, so one copy is
exact. Each share's summed loss is scaled by ``1/B_s`` and the shares' gradients summed: the
SUM all-reduce, the mean gradient of the global batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from dynabatch.actors.contracts import IsgdRule, StepPlan, epoch_order
from dynabatch.actors.data.source import holdout_ids
from dynabatch.actors.device_data import BatchGather
from dynabatch.actors.optim import build_optimizer
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.step import StepMath, mean_loss, share_sqnorm, sqnorm
from dynabatch.actors.worker import to_cpu
from dynabatch.actors.workloads import WorkloadError
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.actors.workloads.models import build_model
from dynabatch.actors.workloads.objective import objective_for, targets_kind
from dynabatch.scheduler.sim.replicas import StepOutcome


class GradientEngine:
    """The simulator's :class:`~dynabatch.scheduler.sim.replicas.Replicas` with the real
    model: one replica for every worker (see the module docstring), so the worker names the
    seam passes are not needed. ``holdout``: evaluate on that fraction of the *training*
    samples, held out of training (a validation split, as ``dynabatch tune`` needs), instead
    of the test set."""

    def __init__(self, spec: JobSpec, holdout: float = 0.0):
        ds = load_dataset(spec.dataset, seed=spec.seed)
        self.name = ds.name
        x, y = np.asarray(ds.x_train), np.asarray(ds.y_train)
        self.x_test, self.y_test = np.asarray(ds.x_test), np.asarray(ds.y_test)
        # The held-out sets by split name (the runtime's evaluation names one).
        self.held: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        fraction = holdout or spec.dataset.validation_fraction
        if not holdout and spec.dataset.validation is not None and fraction is None:
            raise WorkloadError(f"dataset.validation: the simulator holds out a fraction of "
                                f"train, not the split {spec.dataset.validation!r}")
        if fraction:
            # The job's own validation split (dataset.validation), or tune's (holdout): the
            # same seeded split a real job holds out.
            keep, val = holdout_ids(len(y), fraction, spec.seed,
                                    "holdout" if holdout else "dataset.validation")
            self.held["validation"] = (x[val], y[val])
            self.name = f"{ds.name} ({len(keep)} train, {len(val)} validation held out)"
            x, y = x[keep], y[keep]
            if holdout:  # tune scores the validation split in the test set's place
                self.x_test, self.y_test = self.held["validation"]
        self.held["test"] = (self.x_test, self.y_test)
        self.x = torch.from_numpy(np.ascontiguousarray(x))
        self.y = torch.from_numpy(np.ascontiguousarray(y))
        self.objective = objective_for(spec, targets_kind(y))
        torch.manual_seed(spec.seed)  # the worker seeds the same way before building
        self.input_shape, self.num_classes = tuple(ds.input_shape), ds.num_classes
        self.model = build_model(spec.model, self.input_shape, self.num_classes)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.math = StepMath(self.model, self.objective, self.params,
                             clip_grad_norm=spec.optimizer.clip_grad_norm)
        self.optimizer = build_optimizer(spec, self.params)
        self.model_bytes = 4 * sum(p.numel() for p in self.params)
        self.shuffle = spec.dataset.shuffle
        self._gather = BatchGather(self.x, self.y, torch.device("cpu"), "host")
        self._order: tuple[tuple[int, int, int], np.ndarray] | None = None

    @property
    def n_train(self) -> int:
        return len(self.y)

    @property
    def n_test(self) -> int:
        return len(self.y_test)

    def _epoch_order(self, seed: int, epoch: int, n: int) -> BatchGather:
        """The gatherer, holding this epoch's order (computed once an epoch), as the
        worker's."""
        key = (seed, epoch, n)
        if self._order is None or self._order[0] != key:
            self._order = (key, epoch_order(*key, self.shuffle))
            self._gather.set_order(key, self._order[1])
        return self._gather

    def step(self, seed: int, epoch: int, dataset_size: int,
             shares: Sequence[StepPlan], rule: IsgdRule | None = None,
             caps: Sequence[int | None] | None = None, *,
             workers: Sequence[str] = ()) -> StepOutcome:
        """Train one step from the workers' shares (one per worker, in order); ``rule``:
        ISGD's for this step (from the segment's chart); ``caps``: each worker's micro-batch
        cap (default: none, one micro-batch per share). The one replica applies it, whoever
        ``workers`` are: a member that did not is never read again (the driver regroups from
        one that did)."""
        gather = self._epoch_order(seed, epoch, dataset_size)
        caps = caps if caps is not None else [None] * len(shares)
        first = shares[0]
        noise = first.noise
        losses, local = self._gradient(gather, shares, caps, noise)
        global_sq = sqnorm(p.grad for p in self.params) if noise else None
        psi = mean_loss(sum(losses), first.size)

        def again() -> float:
            return mean_loss(sum(self._gradient(gather, shares, caps, False)[0]), first.size)
        up = self.math.update(self.optimizer, first.lr, rule, psi, again)
        return StepOutcome(losses, psi, up.flagged, up.extra_iters, local if noise else None,
                           global_sq)

    def _gradient(self, gather: BatchGather, shares: Sequence[StepPlan],
                  caps: Sequence[int | None], noise: bool
                  ) -> tuple[list[float], list[float | None]]:
        """Sum the shares' gradients ``(b_i/B)·g_i`` into ``p.grad`` (the all-reduce);
        returns each share's summed loss and, with ``noise``, each |g_i|²."""
        total = [torch.zeros_like(p) for p in self.params]
        losses: list[float] = []
        local: list[float | None] = []
        for sp, cap in zip(shares, caps, strict=True):
            if not sp.own_size:
                losses.append(0.0)
                local.append(None)
                continue
            # Each share alone in p.grad, as in its worker's buffer before the all-reduce:
            # its own norm is read from it, then it joins the sum.
            for p in self.params:
                p.grad = None
            share = self.math.share(gather.gather, sp.own_start, sp.own_start + sp.own_size,
                                    sp.size, cap)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                     for p in self.params]
            for acc, g in zip(total, grads, strict=True):
                acc.add_(g)
            losses.append(float(share.loss))
            if noise:
                local.append(share_sqnorm(sqnorm(grads), sp.size, sp.own_size))
        for p, g in zip(self.params, total, strict=True):
            p.grad = g
        return losses, local

    @property
    def n_validation(self) -> int:
        return len(self.held["validation"][1]) if "validation" in self.held else 0

    def eval_sums(self, worker: str, lo: int, hi: int, batch: int = 1024,
                  split: str = "test") -> dict[str, float]:
        """A holder's shard of the held-out ``split`` (test, validation), as
        :meth:`dynabatch.actors.worker.Worker.evaluate_shard`; :meth:`finish` scores the sums."""
        x, y = self.held[split]
        return self.objective.eval_sums(self.model, x, y, lo, hi, torch.device("cpu"), batch)

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        return self.objective.finish(sums)

    def state(self, worker: str = "") -> dict[str, Any]:
        return {"model": to_cpu(self.model.state_dict()),
                "optimizer": to_cpu(self.optimizer.state_dict())}

    def load_state(self, state: dict[str, Any] | None, members: Sequence[str] = ()) -> None:
        """Every member takes ``state``; None: the first member's, which the one replica
        already holds."""
        if state is None:
            return
        self.model.load_state_dict(state["model"])
        if state.get("optimizer") is not None:  # none: another optimizer's (checkpoint.from)
            self.optimizer.load_state_dict(state["optimizer"])

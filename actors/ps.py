"""Parameter-server training: the server and the learner (plain classes; ``ray.remote`` is
applied where they are launched), and the torch pieces both drivers share.

* :class:`ParamStore`: the model as one flat float32 vector, with the optimizer state (SGD
  momentum, Adam moments) on the server. An update ``Σ_l w_l·g_l`` (the weights come from the
  protocol: sample share × staleness factor × optional lr scale) becomes the flat
  parameter's gradient and one optimizer step at the base learning rate α0. SGD and Adam are
  elementwise, so the flat parameter steps exactly as the model's parameters would.
* :class:`GradientComputer`: a learner's model replica; loads a flat weight vector, returns
  the *mean* gradient over the chunk's samples (and the summed loss).
* :class:`ParameterServer`: an asyncio actor around a pure job core (``scheduler.ps_core``,
  passed in, so this module imports nothing above it). ``request`` hands a learner its work
  and the weights of the version it pulls (one ``ray.put`` per version), awaiting without
  blocking when the protocol says wait; ``push`` feeds a gradient in and applies what the
  core decides. Waiting learners never block pushes: both are coroutines on one event loop.
* :class:`Learner`: loops request → compute → push until the job is finished.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from actors.contracts import epoch_order
from actors.emulation import ComputeClock, slowdown_at
from actors.spec import JobSpec
from actors.worker import build_optimizer


def _build(spec: JobSpec, input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    from actors.workloads.models import build_model

    torch.manual_seed(spec.seed)  # every replica and the server start from the same weights
    return build_model(spec.model, tuple(input_shape), num_classes)


class ParamStore:
    def __init__(self, spec: JobSpec, input_shape: tuple[int, ...], num_classes: int):
        self.model = _build(spec, input_shape, num_classes)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        flat = torch.nn.utils.parameters_to_vector(self._params).detach().clone()
        self.flat = torch.nn.Parameter(flat.float())
        self.optimizer = build_optimizer(spec, [self.flat])
        self.version = 0

    @property
    def size(self) -> int:
        return self.flat.numel()

    def weights(self) -> np.ndarray:
        return self.flat.detach().numpy().copy()

    def apply(self, grads: list[tuple[np.ndarray | torch.Tensor, float]]) -> None:
        """One optimizer step on ``Σ weight·grad``."""
        total = torch.zeros_like(self.flat)
        for g, w in grads:
            total.add_(torch.as_tensor(g, dtype=torch.float32), alpha=float(w))
        self.flat.grad = total
        self.optimizer.step()
        self.version += 1

    def evaluate(self, x_test: np.ndarray, y_test: np.ndarray, batch: int = 1024
                 ) -> tuple[float, float]:
        """(test loss, test accuracy) of the current weights."""
        torch.nn.utils.vector_to_parameters(self.flat.detach(), self._params)
        self.model.eval()
        total, correct = 0.0, 0
        with torch.no_grad():
            for s in range(0, len(y_test), batch):
                xb = torch.from_numpy(np.asarray(x_test[s:s + batch]))
                yb = torch.from_numpy(np.asarray(y_test[s:s + batch]))
                out = self.model(xb)
                total += float(F.cross_entropy(out, yb, reduction="sum"))
                correct += int((out.argmax(1) == yb).sum())
        self.model.train()
        n = max(len(y_test), 1)
        return total / n, correct / n


class GradientComputer:
    def __init__(self, spec: JobSpec, x: np.ndarray, y: np.ndarray,
                 input_shape: tuple[int, ...], num_classes: int):
        self.model = _build(spec, input_shape, num_classes)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.x = torch.from_numpy(np.asarray(x))
        self.y = torch.from_numpy(np.asarray(y))
        self._order: tuple[tuple[int, int, int], np.ndarray] | None = None

    def indices(self, seed: int, epoch: int, n: int, ranges) -> np.ndarray:
        key = (seed, epoch, n)
        if self._order is None or self._order[0] != key:
            self._order = (key, epoch_order(*key))
        order = self._order[1]
        return np.concatenate([order[lo:hi] for lo, hi in ranges]).astype(np.int64)

    def gradient(self, weights: np.ndarray | torch.Tensor, ids: np.ndarray
                 ) -> tuple[np.ndarray, float]:
        """(mean gradient over ``ids`` at ``weights``, summed loss)."""
        torch.nn.utils.vector_to_parameters(torch.as_tensor(weights, dtype=torch.float32),
                                            self.params)
        ii = torch.from_numpy(ids)
        loss = F.cross_entropy(self.model(self.x.index_select(0, ii)),
                               self.y.index_select(0, ii), reduction="sum")
        grads = torch.autograd.grad(loss / len(ids), self.params)
        flat = torch.cat([g.reshape(-1) for g in grads])
        return flat.numpy(), float(loss.detach())


class ParameterServer:
    """The server actor. ``core`` is a ``scheduler.ps_core.PSCore``; its decisions are
    applied here, to the tensors, and its epoch ends are evaluated here."""

    def __init__(self, spec: JobSpec, core: Any, input_shape: tuple[int, ...],
                 num_classes: int, x_test: np.ndarray, y_test: np.ndarray,
                 idle_poll_s: float = 2.0):
        torch.set_num_threads(1)
        self.spec = spec
        self.core = core
        self.store = ParamStore(spec, input_shape, num_classes)
        self.x_test, self.y_test = x_test, y_test
        self.idle_poll_s = idle_poll_s
        self._grads: dict[int, np.ndarray] = {}
        self._ref: tuple[int, Any] | None = None  # (version, ObjectRef) of the weights
        self._changed = asyncio.Condition()
        self.epochs: list[dict[str, Any]] = []
        self.push_log: list[dict[str, Any]] = []  # rolling window of PushRecords
        self._t0 = time.monotonic()
        self._losses: dict[int, float] = {}
        self._ep_loss = 0.0  # summed training loss of the epoch's applied gradients
        self._ep_samples = 0

    # --- learners ---------------------------------------------------------------------
    def _weights_ref(self) -> Any:
        import ray

        v = self.store.version
        if self._ref is None or self._ref[0] != v:
            self._ref = (v, ray.put(self.store.weights()))  # one put per version
        return self._ref[1]

    def pull(self) -> tuple[int, Any]:
        return self.store.version, self._weights_ref()

    async def request(self, worker: str) -> dict[str, Any]:
        """Work for ``worker``: ``{"work": ..., "weights": ref}``, ``{"idle": reason}`` after
        ``idle_poll_s`` without work (the learner asks again), or ``{"finished": True}``."""
        deadline = time.monotonic() + self.idle_poll_s
        async with self._changed:
            while True:
                res, events = self.core.request(worker)
                self._handle(events)
                kind = type(res).__name__
                if kind == "Work":
                    return {"work": res, "weights": self._weights_ref()}
                if kind == "Finished":
                    return {"finished": True}
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"idle": res.reason}
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    return {"idle": res.reason}

    async def push(self, worker: str, ticket: int, version_pulled: int, grad: np.ndarray,
                   samples: int, compute_s: float, loss_sum: float = 0.0) -> dict[str, Any]:
        async with self._changed:
            chunk = self.core.ticket_chunk(ticket)
            if chunk is None or chunk.samples != samples:
                raise ValueError(f"{worker}: ticket {ticket} is not open for {samples} samples")
            self._grads[ticket] = grad
            self._losses[ticket] = loss_sum
            staleness = self.store.version - version_pulled
            self.push_log.append({"worker": worker, "version_pulled": version_pulled,
                                  "staleness": staleness, "samples": samples,
                                  "compute_s": compute_s, "t": time.monotonic() - self._t0})
            del self.push_log[:-2000]
            self._handle(self.core.push(worker, ticket, version_pulled, compute_s))
            self._changed.notify_all()
            return {"version": self.store.version}

    async def join(self, worker: str) -> None:
        async with self._changed:
            self.core.join(worker)
            self._changed.notify_all()

    async def leave(self, worker: str) -> None:
        """A learner is lost: its in-flight chunk goes back to the queue (no regroup)."""
        async with self._changed:
            self._handle(self.core.leave(worker))
            self._changed.notify_all()

    def _handle(self, events: list[Any]) -> None:
        for e in events:
            kind = type(e).__name__
            if kind == "Apply":
                self.store.apply([(self._grads.pop(g.push_id), g.weight) for g in e.gradients])
                for g in e.gradients:
                    self._ep_loss += self._losses.pop(g.push_id, 0.0)
                    self._ep_samples += g.samples
            elif kind == "Refuse":
                self._grads.pop(e.push_id, None)
                self._losses.pop(e.push_id, None)
            elif kind == "EpochEnd":
                loss, acc = self.store.evaluate(self.x_test, self.y_test)
                v = e.verification
                self.epochs.append({
                    "epoch": e.epoch, "version": e.version, "test_loss": loss,
                    "train_loss": self._ep_loss / max(1, self._ep_samples),
                    "test_accuracy": acc, "verified": v.verified, "problems": list(v.problems),
                    "samples_applied": v.samples_trained, "retried_samples": v.retried_samples,
                    "samples_by_worker": dict(v.samples_by_worker),
                    "t": time.monotonic() - self._t0,
                })
                self._ep_loss, self._ep_samples = 0.0, 0

    # --- views ------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        snap = self.core.snapshot()
        snap["epochs"] = list(self.epochs)
        snap["elapsed_s"] = time.monotonic() - self._t0
        return snap

    def pushes(self, since: int = 0) -> list[dict[str, Any]]:
        return self.push_log[since:]

    def weights(self) -> np.ndarray:
        return self.store.weights()


class Learner:
    def __init__(self, worker_id: str, ordinal: int, spec: JobSpec, x_train: np.ndarray,
                 y_train: np.ndarray, input_shape: tuple[int, ...], num_classes: int):
        torch.set_num_threads(max(1, int(spec.worker_cpus)))
        self.worker_id = worker_id
        self.ordinal = ordinal
        self.spec = spec
        self.computer = GradientComputer(spec, x_train, y_train, input_shape, num_classes)
        self._clock = ComputeClock(spec.emulated)
        self.pushes = 0

    def run(self, server: Any, call_timeout_s: float = 60.0) -> dict[str, Any]:
        """Pull, compute, push until the server says the job is finished."""
        import ray

        while True:
            reply = ray.get(server.request.remote(self.worker_id), timeout=call_timeout_s)
            if reply.get("finished"):
                return {"worker": self.worker_id, "pushes": self.pushes}
            if "idle" in reply:
                continue
            work = reply["work"]
            weights = ray.get(reply["weights"], timeout=call_timeout_s)
            factor = slowdown_at(self.spec.emulation, self.ordinal, work.epoch, self.pushes)
            self._clock.start()
            ids = self.computer.indices(work.seed, work.epoch, work.dataset_size,
                                        work.chunk.ranges)
            grad, loss_sum = self.computer.gradient(weights, ids)
            compute = self._clock.finish(factor)
            ray.get(server.push.remote(self.worker_id, work.ticket, work.version, grad,
                                       len(ids), compute, loss_sum), timeout=call_timeout_s)
            self.pushes += 1

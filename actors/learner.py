"""Parameter-server training, the learner's side (the server is :mod:`dynabatch.actors.ps`):
:class:`GradientComputer`, a replica returning the mean gradient of a chunk (the simulator's
learners use it too), and :class:`Learner`, which loops request → compute → push.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from dynabatch.actors.contracts import epoch_order
from dynabatch.actors.emulation import ComputeClock, slowdown_at
from dynabatch.actors.errors import TransportError, first_line
from dynabatch.actors.output import own_actor_id
from dynabatch.actors.ps import Bounds, build_replica, shared_tensor
from dynabatch.actors.spec import JobSpec


class GradientComputer:
    """A learner's replica. Its chunk is a step of its own (``B = b``), trained by the
    workers' step math (:class:`dynabatch.actors.step.StepMath`): the mean gradient."""

    def __init__(self, spec: JobSpec, x: np.ndarray, y: np.ndarray,
                 input_shape: tuple[int, ...], num_classes: int):
        # Imported where a replica is built, as build_replica imports the models.
        from dynabatch.actors.step import StepMath
        from dynabatch.actors.workloads.objective import objective_for, targets_kind

        self.model = build_replica(spec, input_shape, num_classes)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # protocol ps trains cross_entropy on class labels only (actors/spec.py checks it).
        self.math = StepMath(self.model, objective_for(spec, targets_kind(y)), self.params)
        self.x = shared_tensor(x)
        self.y = shared_tensor(y)
        self.size = sum(p.numel() for p in self.params)
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
        torch.nn.utils.vector_to_parameters(shared_tensor(weights), self.params)
        ii = torch.from_numpy(ids)
        for p in self.params:  # the chunk's gradient alone (backward accumulates)
            p.grad = None
        share = self.math.share(
            lambda lo, hi: (self.x.index_select(0, ii[lo:hi]), self.y.index_select(0, ii[lo:hi])),
            0, len(ids), len(ids))
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params])
        return flat.numpy(), float(share.loss) if share.loss is not None else 0.0


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

    # This actor's Ray id: the job reads its stdout and stderr by it (actors/output.py).
    actor_id = staticmethod(own_actor_id)

    def run(self, server: Any, shards: Sequence[Any] = (), bounds: Bounds | None = None,
            call_timeout_s: float = 60.0) -> dict[str, Any]:
        """Pull, compute, push until the server says the job is finished."""
        import ray

        bounds = bounds or ((0, self.computer.size),)
        lo0, hi0 = bounds[0]
        while True:
            with _transport():
                reply = ray.get(server.request.remote(self.worker_id), timeout=call_timeout_s)
            if reply.get("finished"):
                return {"worker": self.worker_id, "pushes": self.pushes}
            if "idle" in reply:
                continue
            work = reply["work"]
            with _transport():  # the slices, in parallel
                parts = ray.get(reply["weights"], timeout=call_timeout_s)
            weights = parts[0] if len(parts) == 1 else np.concatenate(parts)
            factor = slowdown_at(self.spec.emulation, self.ordinal, work.epoch, self.pushes)
            self._clock.start()
            ids = self.computer.indices(work.seed, work.epoch, work.dataset_size,
                                        work.chunk.ranges)
            grad, loss_sum = self.computer.gradient(weights, ids)
            compute = self._clock.finish(factor)
            with _transport():  # the shards' slices first: in place before the core decides
                if shards:
                    ray.get([s.put.remote(work.ticket, grad[lo:hi])
                             for s, (lo, hi) in zip(shards, bounds[1:], strict=True)],
                            timeout=call_timeout_s)
                ray.get(server.push.remote(self.worker_id, grad[lo0:hi0], work.version,
                                           len(ids), compute, loss_sum),
                        timeout=call_timeout_s)
            self.pushes += 1


@contextmanager
def _transport() -> Iterator[None]:
    """Around the learner's calls to the server and its shards (submitting, and waiting for
    the answer): an ``OSError`` Ray raises there is its transport failing (this worker's
    node going away), raised on as a :class:`TransportError` so that the driver counts the
    learner lost instead of failing the job with it. An error the server's own code raised
    (a Ray task error, whatever its cause) goes on as it is."""
    try:
        yield
    except OSError as err:
        from ray.exceptions import RayError  # here, off the loop's path: only on an error

        if isinstance(err, RayError):
            raise
        raise TransportError(first_line(err)) from err

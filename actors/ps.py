"""Parameter-server training, the server's side: :class:`ParamStore` (a slice of the flat
parameter vector with that slice's optimizer state), :class:`ParameterServer` (an asyncio
actor around the pure job core ``dynabatch.scheduler.core.ps.machine``, passed in so this
module imports nothing above it; it holds slice 0 and decides for all slices) and
:class:`ParamShard` (slices 1..k−1: applies what the server decides). Plain classes;
``ray.remote`` is applied where they are launched. Sharding: docs/parameter-server.md.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from dynabatch.actors.accumulate import even_ranges
from dynabatch.actors.optim import build_optimizer
from dynabatch.actors.output import own_actor_id
from dynabatch.actors.ps_events import CoreEventInterpreter
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.objective import objective_for

ADAPTIVE = ("adam", "adamw")
RATE_WINDOW_S = 10.0  # pushes per second over this window (not a lifetime average)

Bounds = tuple[tuple[int, int], ...]


def build_replica(spec: JobSpec, input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    from dynabatch.actors.workloads.models import build_model

    torch.manual_seed(spec.seed)  # every replica and the server start from the same weights
    return build_model(spec.model, tuple(input_shape), num_classes)


def param_count(spec: JobSpec, input_shape: tuple[int, ...], num_classes: int) -> int:
    model = build_replica(spec, input_shape, num_classes)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def shard_bounds(size: int, k: int) -> Bounds:
    """``k`` contiguous slices of ``[0, size)`` whose sizes differ by at most one."""
    if not 1 <= k <= size:
        raise ValueError(f"protocol.shards: {k} shards for {size} parameters")
    return tuple(even_ranges(size, k))


class ParamStore:
    def __init__(self, spec: JobSpec, input_shape: tuple[int, ...], num_classes: int,
                 bounds: tuple[int, int] | None = None):
        self.model = build_replica(spec, input_shape, num_classes)
        self.objective = objective_for(spec, "classes")
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        full = torch.nn.utils.parameters_to_vector(self._params).detach().clone().float()
        self.total = full.numel()
        self.lo, self.hi = bounds or (0, self.total)
        self.flat = torch.nn.Parameter(full[self.lo:self.hi].clone())
        self.optimizer = build_optimizer(spec, [self.flat])
        self.adaptive = spec.optimizer.name in ADAPTIVE
        self.version = 0
        self._ref: tuple[int, Any] | None = None  # (version, ObjectRef) of ref()
        self.puts = 0  # ray.put calls: one per version pulled

    @property
    def size(self) -> int:
        return self.flat.numel()

    def weights(self) -> np.ndarray:
        return self.flat.detach().numpy().copy()

    def ref(self) -> Any:
        """An object-store reference to this version's weights: one ``ray.put`` a version."""
        import ray

        if self._ref is None or self._ref[0] != self.version:
            self._ref = (self.version, ray.put(self.weights()))
            self.puts += 1
        return self._ref[1]

    def apply(self, grads: Sequence[tuple[np.ndarray | torch.Tensor, float]]) -> None:
        """One optimizer step on ``Σ weight·grad``.

        SGD (with or without momentum) steps on the weighted sum at α0: Rudra's
        ``θ ← θ − Σ α(τ_l)·w_l·g_l``. Adam and AdamW divide the gradient by its running RMS,
        which would largely cancel a staleness factor on the gradient, so for them the
        weights' sum ``W = Σ w_l`` scales the learning rate of this one step (α0·W) and the
        gradient is the weights' normalised mix ``Σ (w_l/W)·g_l``."""
        total = torch.zeros_like(self.flat)
        weight_sum = float(sum(w for _, w in grads))
        norm = weight_sum if self.adaptive and weight_sum > 0 else 1.0
        for g, w in grads:
            g = shared_tensor(g)
            if g.numel() != self.size:
                raise ValueError(f"a gradient of {g.numel()} values for a slice of {self.size}")
            total.add_(g, alpha=float(w) / norm)
        self.flat.grad = total
        groups = self.optimizer.param_groups
        base = [g["lr"] for g in groups]
        if norm != 1.0:
            for g in groups:
                g["lr"] = g["lr"] * norm
        try:
            self.optimizer.step()
        finally:
            for g, lr in zip(groups, base, strict=True):
                g["lr"] = lr
        self.version += 1

    def evaluate(self, x: np.ndarray, y: np.ndarray, flat: np.ndarray | None = None,
                 batch: int = 1024) -> tuple[float, float]:
        """(mean cross-entropy, accuracy) over ``x, y`` of the full weights ``flat`` (default:
        this store's own, when it holds the whole vector)."""
        if flat is None:
            if self.size != self.total:
                raise ValueError("a slice cannot be evaluated alone: pass the full weights")
            flat_t = self.flat.detach()
        else:
            flat_t = torch.tensor(np.asarray(flat), dtype=torch.float32)  # may be read-only
        torch.nn.utils.vector_to_parameters(flat_t, self._params)
        # The job's own objective, as a synchronous job's evaluation (spec validation keeps a
        # parameter-server job to cross-entropy and accuracy).
        obj = self.objective
        scores = obj.finish(obj.eval_sums(self.model, x, y, 0, len(y), torch.device("cpu"), batch))
        return scores["loss"], scores["accuracy"]


def shared_tensor(a: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A tensor over ``a`` without a copy. Arrays from Ray's object store are read-only, and
    torch warns that a tensor over one must not be written; these (the training set, a
    pushed gradient, pulled weights) are only ever read, so the warning is silenced here
    instead of paying a copy of each."""
    if isinstance(a, torch.Tensor):
        return a
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(np.asarray(a))
    return t.float() if t.dtype == torch.float64 else t


def model_state(
    spec: JobSpec, input_shape: tuple[int, ...], num_classes: int, flat: Any
) -> dict[str, Any]:
    """The model's state dict with the server's flat parameter vector ``flat`` in it (the
    trained model a job exports): the job's model as every replica builds it, its trainable
    parameters replaced in the order the server flattened them in."""
    model = build_replica(spec, input_shape, num_classes)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(shared_tensor(flat).clone(), params)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class ParamShard:
    """One slice of a sharded server: gradient slices in, the coordinator's decisions applied,
    one ``ray.put`` of the slice per version."""

    def __init__(self, spec: JobSpec, input_shape: tuple[int, ...], num_classes: int,
                 bounds: tuple[int, int]):
        torch.set_num_threads(1)
        self.store = ParamStore(spec, input_shape, num_classes, bounds)
        self._grads: dict[int, np.ndarray] = {}

    # This actor's Ray id: the job reads its stdout and stderr by it (actors/output.py).
    actor_id = staticmethod(own_actor_id)

    def put(self, ticket: int, grad: np.ndarray) -> None:
        if grad.size != self.store.size:
            raise ValueError(f"ticket {ticket}: a slice of {grad.size} values for a shard of "
                             f"{self.store.size}")
        self._grads[ticket] = grad

    def drop(self, tickets: Sequence[int]) -> None:
        """Refused or lost gradients: their slices will never be applied."""
        for t in tickets:
            self._grads.pop(t, None)

    def apply(self, version: int, weighted: Sequence[tuple[int, float]]) -> Any:
        missing = [t for t, _ in weighted if t not in self._grads]
        if missing:
            raise ValueError(f"shard [{self.store.lo}, {self.store.hi}): no slice for tickets "
                             f"{missing}")
        self.store.apply([(self._grads.pop(t), w) for t, w in weighted])
        self.store.version = version
        return self.weights_ref()

    def weights_ref(self) -> Any:
        return self.store.ref()


class ParameterServer:
    """The server actor. ``core`` is a ``dynabatch.scheduler.core.ps.machine.PSCore``; its
    decisions are
    applied here (slice 0) and on the shards, and its epoch ends are evaluated here.

    ``start_learners``: requests wait until that many learners have asked (the start
    barrier, so learners that came up early do not train alone), or ``start_timeout_s``
    after the first one asked; throughput is timed from then (``started_s``)."""

    def __init__(self, spec: JobSpec, core: Any, input_shape: tuple[int, ...],
                 num_classes: int, x_test: np.ndarray, y_test: np.ndarray,
                 shards: Sequence[Any] = (), bounds: Bounds | None = None, *,
                 idle_poll_s: float = 2.0, start_learners: int = 0,
                 start_timeout_s: float = 60.0, call_timeout_s: float = 30.0):
        torch.set_num_threads(1)
        self.spec = spec
        self.core = core
        self.shards = list(shards)
        self.store = ParamStore(spec, input_shape, num_classes, bounds[0] if bounds else None)
        if bounds is not None and len(bounds) != 1 + len(self.shards):
            raise ValueError(f"{len(bounds)} slices for {1 + len(self.shards)} servers")
        self.x_test, self.y_test = x_test, y_test
        self.idle_poll_s = idle_poll_s
        self.call_timeout_s = call_timeout_s
        self.events = CoreEventInterpreter(self.store)  # holds the pushed slices 0
        self._shard_refs: list[Any] | None = None  # the shards' slices of this version
        self._changed = asyncio.Condition()
        self.epochs: list[dict[str, Any]] = []
        self._t0 = time.monotonic()
        self._push_times: deque[float] = deque()
        self.apply_s: deque[float] = deque(maxlen=5000)  # wall time of each update
        self._expected = start_learners
        self._arrived: set[str] = set()
        self._first_ask: float | None = None
        self.started: float | None = None if start_learners else self._t0
        self.start_timeout_s = start_timeout_s

    # This actor's Ray id: the job reads its stdout and stderr by it (actors/output.py).
    actor_id = staticmethod(own_actor_id)

    # --- learners ---------------------------------------------------------------------
    async def _await(self, refs: list[Any]) -> list[Any]:
        return list(await asyncio.wait_for(asyncio.gather(*refs), self.call_timeout_s))

    async def _weight_refs(self) -> list[Any]:
        if self._shard_refs is None and self.shards:  # version 0: the shards' first puts
            self._shard_refs = await self._await([s.weights_ref.remote() for s in self.shards])
        return [self.store.ref(), *(self._shard_refs or [])]

    async def pull(self) -> tuple[int, np.ndarray]:
        """(version, the full flat weights)."""
        async with self._changed:
            return self.store.version, await self._full_weights()

    async def _full_weights(self) -> np.ndarray:
        if not self.shards:
            return self.store.weights()
        refs = (await self._weight_refs())[1:]
        parts = await self._await(refs)
        return np.concatenate([self.store.weights(), *parts])

    async def _barrier(self, worker: str) -> bool:
        """True once training may start (every initial learner asked, or the timeout)."""
        if self.started is not None:
            return True
        now = time.monotonic()
        self._arrived.add(worker)
        self._first_ask = self._first_ask or now
        if (len(self._arrived) >= self._expected
                or now - self._first_ask >= self.start_timeout_s):
            self.started = now
            async with self._changed:
                self._changed.notify_all()
            return True
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.started is not None),
                                       self.idle_poll_s)
            except TimeoutError:
                return False
        return True

    async def request(self, worker: str) -> dict[str, Any]:
        """Work for ``worker``: ``{"work": ..., "weights": [ref per slice]}``, ``{"idle":
        reason}`` after ``idle_poll_s`` without work (the learner asks again), or
        ``{"finished": True}``."""
        if not await self._barrier(worker):
            return {"idle": "start"}
        deadline = time.monotonic() + self.idle_poll_s
        async with self._changed:
            while True:
                res, events = self.core.request(worker)
                await self._handle(events)
                kind = type(res).__name__
                if kind == "Work":
                    return {"work": res, "weights": await self._weight_refs()}
                if kind == "Finished":
                    return {"finished": True}
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"idle": res.reason}
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    return {"idle": res.reason}

    async def push(self, worker: str, grad: np.ndarray, version_pulled: int, samples: int,
                   compute_s: float, loss_sum: float = 0.0) -> dict[str, Any]:
        """``worker``'s mean gradient (slice 0 when sharded; the other slices were put on
        their shards first) over the ``samples`` it was handed, computed on
        ``version_pulled``. ``loss_sum``: its summed training loss (telemetry)."""
        async with self._changed:
            ticket = self.core.ticket_of(worker)
            chunk = None if ticket is None else self.core.ticket_chunk(ticket)
            if chunk is None or chunk.samples != samples:
                raise ValueError(f"{worker}: no open work of {samples} samples")
            if np.size(grad) != self.store.size:
                raise ValueError(f"{worker}: a gradient of {np.size(grad)} values for a slice "
                                 f"of {self.store.size}")
            self.events.pushed(ticket, grad, loss_sum)
            self._push_times.append(time.monotonic())
            await self._handle(self.core.push(worker, ticket, version_pulled, compute_s))
            self._changed.notify_all()
            return {"version": self.store.version}

    async def join(self, worker: str) -> None:
        async with self._changed:
            self.core.join(worker)
            self._changed.notify_all()

    async def leave(self, worker: str) -> None:
        """A learner is lost: its in-flight chunk goes back to the queue (no regroup)."""
        async with self._changed:
            ticket = self.core.ticket_of(worker)
            self._expected = max(0, self._expected - (worker not in self._arrived))
            await self._handle(self.core.leave(worker))
            if ticket is not None and self.shards:  # slices it may have put already
                await self._await([s.drop.remote([ticket]) for s in self.shards])
            self._changed.notify_all()

    async def _handle(self, events: list[Any]) -> None:
        """The core's events, through the one interpreter (slice 0 steps there); then the
        shards step or drop their slices and each closed epoch is evaluated here."""
        t0 = time.perf_counter()
        fx = self.events.handle(events)
        for version, weighted in fx.applied:
            if self.shards:  # the shards step their slices in the order of the updates
                self._shard_refs = await self._await(
                    [s.apply.remote(version, list(weighted)) for s in self.shards])
        if fx.applied:
            self.apply_s.append(time.perf_counter() - t0)
        if fx.dropped and self.shards:
            await self._await([s.drop.remote(fx.dropped) for s in self.shards])
        for closed in fx.closed:
            flat = await self._full_weights()
            loss, acc = self.store.evaluate(self.x_test, self.y_test, flat)
            self.epochs.append(self.events.record(closed, loss, acc,
                                                  time.monotonic() - self._t0))

    # --- views ------------------------------------------------------------------------
    def pushes_per_s(self, now: float | None = None) -> float:
        """Pushes over the last ``RATE_WINDOW_S`` seconds (or since the start barrier, when
        that is shorter), per second."""
        now = time.monotonic() if now is None else now
        while self._push_times and self._push_times[0] < now - RATE_WINDOW_S:
            self._push_times.popleft()
        if self.started is None:
            return 0.0
        span = min(RATE_WINDOW_S, now - self.started)
        return len(self._push_times) / span if span > 0 else 0.0

    async def snapshot(self) -> dict[str, Any]:
        """The core's state and the evaluated epochs as one consistent view: under the lock
        that every event is handled under, so a snapshot never shows the core ``finished``
        while the last epoch's evaluation (which awaits the shards' slices) is still to be
        recorded."""
        async with self._changed:
            snap = self.core.snapshot()
            snap["epochs"] = list(self.epochs)
        now = time.monotonic()
        snap["elapsed_s"] = now - self._t0
        snap["started_s"] = None if self.started is None else self.started - self._t0
        snap["pushes_per_s"] = self.pushes_per_s(now)
        snap["shards"] = 1 + len(self.shards)
        snap["apply_ms_mean"] = (1e3 * float(np.mean(self.apply_s))) if self.apply_s else 0.0
        snap["puts"] = self.store.puts
        return snap

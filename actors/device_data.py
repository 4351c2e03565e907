"""Where a worker's training samples live, and how a micro-batch is gathered from them.

The in-memory set goes to the GPU once when it fits in what the model leaves
(:func:`data_budget`), else each micro-batch is staged through a reused page-locked buffer;
on the CPU the arrays stay zero-copy views of the object store. The epoch's order is set
once per epoch (on the device when the set is), so a step sends no index to the GPU.
docs/architecture.md ("GPU") says why.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from dynabatch.actors.batch import Tree, to_device
from dynabatch.actors.data.loader import (
    Loader,
    StagingPool,
    _Buffer,
    default_threads,
    read_batches,
)
from dynabatch.actors.data.order import block_order
from dynabatch.actors.data.source import DataError

# Fraction of what is left after the model, its optimizer state and the activations of
# the largest micro-batch that the data may not take: the caching allocator's
# fragmentation, cuDNN/cuBLAS workspaces, the reducer's staging, the CUDA context's growth.
DATA_HEADROOM = 0.2
# Optimizer state per parameter, in parameter-sized tensors (Adam: two moments; SGD: one
# momentum buffer when momentum is on). An optimizer not listed counts two.
OPTIMIZER_SLOTS = {"Adam": 2, "AdamW": 2, "SGD": 1, "RMSprop": 2, "Adagrad": 1}


def data_budget(free_bytes: int, model_bytes: int, act_bytes_per_sample: float,
                micro_batch: int, headroom: float = DATA_HEADROOM) -> int:
    """Device bytes the training set may take: the free device memory (measured before
    the model was placed) less the model's parameters, gradients and optimizer state
    (``model_bytes``) and the activations of a micro-batch of ``micro_batch`` samples,
    less ``headroom`` of what remains; 0 when nothing remains."""
    left = free_bytes - model_bytes - act_bytes_per_sample * max(1, micro_batch)
    return max(0, int(left * (1.0 - headroom)))


def model_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Parameters, their gradients and the optimizer's state, in bytes (the state is
    created at the first step, so it is counted from the optimizer's kind)."""
    n = sum(p.numel() * p.element_size() for p in params)
    slots = OPTIMIZER_SLOTS.get(type(optimizer).__name__, 2)
    if isinstance(optimizer, torch.optim.SGD) and not any(
            g.get("momentum", 0) for g in optimizer.param_groups):
        slots = 0
    return n * (2 + slots)


def stage_dataset(x: torch.Tensor, y: torch.Tensor, device: torch.device,
                  budget: int | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(x, y, where): the training set on ``device`` when it fits in ``budget`` bytes, else
    left in host memory and staged per micro-batch; unchanged on the CPU. ``where`` is
    "device", "staged" or "host"."""
    if device.type != "cuda":
        return x, y, "host"
    need = x.numel() * x.element_size() + y.numel() * y.element_size()
    if budget is not None and need <= budget:
        try:
            return x.to(device), y.to(device), "device"
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
    return x, y, "staged"


class BatchGather:
    """Micro-batches of the epoch's order, gathered from the training set where it lives
    (``where`` as returned by :func:`stage_dataset`) and delivered on ``device``. Staged:
    through reused buffers, page-locked on a CUDA device (on the CPU, only tests stage)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, device: torch.device, where: str):
        self.x, self.y, self.device, self.where = x, y, device, where
        self._cuda = device.type == "cuda"
        self._order: torch.Tensor | None = None
        self._key: object = None
        # Staged: two buffers in turn, so a gather never overwrites the batch before it.
        self.pool = StagingPool(x, y, self._cuda, keep=2)
        self._held: _Buffer | None = None

    def set_order(self, key: object, order: np.ndarray) -> None:
        """Use ``order`` (sample ids by position) until the next call with another key;
        on the device when the set is there, so each epoch's order crosses once."""
        if key == self._key:
            return
        ids = torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64))
        self._order = ids.to(self.x.device) if self.x.device != ids.device else ids
        self._key = key

    def gather(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at order positions ``[lo, hi)``, on the worker's device."""
        ids = self._order[lo:hi]
        if self.where != "staged":
            # On the CPU a view of the order; on the GPU both live on the device.
            return self.x.index_select(0, ids), self.y.index_select(0, ids)
        n = hi - lo
        buf = self.pool.take(n)
        if self._held is not None:
            self.pool.give(self._held)
        self._held = buf
        xs, ys = buf.x[:n], buf.y[:n]
        torch.index_select(self.x, 0, ids, out=xs)
        torch.index_select(self.y, 0, ids, out=ys)
        if not self._cuda:  # only in tests: the staging path without a GPU
            return xs, ys
        xb = xs.to(self.device, non_blocking=True)
        yb = ys.to(self.device, non_blocking=True)
        buf.copied = torch.cuda.Event()
        buf.copied.record()
        return xb, yb


class WorkerData:
    """A worker's training data, whichever kind: in-memory arrays (gathered by
    :class:`BatchGather`, zero-copy from the object store, on the device when they fit)
    or a source read by position (``x_train`` a :class:`~dynabatch.actors.data.open.DataRef`,
    ``y_train`` None), whose :class:`~dynabatch.actors.data.loader.Loader` reads each
    segment's planned shares ahead of time. Never a copy of a whole file-backed set."""

    def __init__(self, x_train: object, y_train: object, spec: object, device: torch.device):
        self.spec, self.device = spec, device
        self.loader = None
        self._test: dict[tuple, object] = {}
        self._eval_pool = None
        if hasattr(x_train, "open"):  # a DataRef: open this worker's own view of the source
            self.source = x_train.open()
            self.targets = self.source.meta.targets
            self.block = self.source.block
            self.n = len(self.source)
            self.loader = Loader(self.source, device, spec.seed, spec.dataset.prefetch,
                                 spec.dataset.loader_threads
                                 or default_threads(spec.worker_cpus), opener=x_train.open)
            self.loader.start()
            self.gatherer = self.loader
            return
        from dynabatch.actors.workloads.objective import targets_kind

        x, y = np.asarray(x_train), np.asarray(y_train)
        self.targets, self.block, self.n = targets_kind(y), 1, len(y)
        with warnings.catch_warnings():
            # Object-store arrays are read-only views: only ever indexed, never written.
            warnings.simplefilter("ignore", UserWarning)
            tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        # In host memory until :meth:`place` knows what the model leaves of the device.
        self.x, self.y, self.where = tx, ty, "host"
        self.gatherer = BatchGather(self.x, self.y, device, self.where)

    def place(self, budget: int | None) -> str:
        """Put the in-memory set where it trains: on the device when it fits in ``budget``
        bytes (:func:`data_budget`), else staged per micro-batch; the CPU keeps it as it
        is. Called once the model is built. Returns where it is."""
        if self.loader is not None:
            return "source"
        self.x, self.y, self.where = stage_dataset(self.x, self.y, self.device, budget)
        self.gatherer = BatchGather(self.x, self.y, self.device, self.where)
        self._key = None  # the order is placed again, next to the set
        return self.where

    def __len__(self) -> int:
        return self.n

    def warm(self, n: int) -> tuple[Tree, Tree] | None:
        """``n`` samples for the warm-up pass: the first ones in memory; zeros of the
        sample's shape for a source (a bad sample fails the step that trains it, with its
        position, never the worker's start). A structured source (dict or tuple inputs, a
        collate) has no such zeros: its first samples, or None (no warm-up) when they fail."""
        if self.loader is None:
            return self.sample(np.arange(n))
        m = self.source.meta
        if m.structured:
            try:
                return self.sample(np.arange(n))
            except DataError:
                return None
        tok = m.targets == "tokens"
        x = torch.zeros((n, *m.sample_shape), dtype=torch.int64 if tok else torch.float32)
        y = torch.zeros((n, *m.target_shape),
                        dtype=torch.float32 if m.targets == "values" else torch.int64)
        return x.to(self.device), y.to(self.device)

    def sample(self, ids: np.ndarray) -> tuple[Tree, Tree]:
        """The samples ``ids`` (no augmentation), on the device (warm-up, profiling)."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.loader is not None:
            x, y = self.source.read(ids)
            return to_device(x, self.device), to_device(y, self.device)
        ii = torch.from_numpy(ids).to(self.x.device)
        return (self.x.index_select(0, ii).to(self.device),
                self.y.index_select(0, ii).to(self.device))

    def for_epoch(self, seed: int, epoch: int, size: int, shuffle: str) -> object:
        """The gatherer, holding the order of ``epoch`` (computed once an epoch)."""
        key = (seed, epoch, size)
        if getattr(self, "_key", None) != key:
            self._key = key
            order = block_order(seed, epoch, size, self.block, shuffle)
            if self.loader is not None:
                self.loader.set_order(key, order, epoch)
            else:
                self.gatherer.set_order(key, order)
        return self.gatherer

    def plan(self, steps: tuple, size: int) -> None:
        """A segment's steps: its shares are read ahead, then the share the step after it
        would train if the allocation stays (a re-plan only changes what is read next)."""
        if self.loader is None or not steps:
            return
        ranges = [(sp.own_start, sp.own_start + sp.own_size) for sp in steps]
        last = steps[-1]
        lo = last.start + last.size + (last.own_start - last.start)
        if last.own_size and lo + last.own_size <= size:
            ranges.append((lo, lo + last.own_size))
        self.loader.plan(ranges)

    def take_stats(self) -> tuple[float, float | None]:
        """(seconds the step waited for data, the loader's samples per second)."""
        return self.loader.take_stats() if self.loader is not None else (0.0, None)

    def eval_sums(self, objective: object, model: object, x_test: object, y_test: object,
                  lo: int, hi: int, batch: int) -> dict[str, float]:
        """The objective's sums over the held-out shard ``[lo, hi)``, read by position from a
        source (``x_test`` a DataRef), or sliced from in-memory arrays."""
        if not hasattr(x_test, "open"):
            return objective.eval_sums(model, x_test, y_test, lo, hi, self.device, batch)
        key = (x_test.spec.name, x_test.spec.path, x_test.split)
        src = self._test.get(key)
        if src is None:  # opened once; the worker keeps it for later epochs
            self._test.clear()
            src = self._test[key] = x_test.open()
        if self._eval_pool is None:
            self._eval_pool = ThreadPoolExecutor(1, thread_name_prefix="dynabatch-eval")
        return objective.eval_batches(model, read_batches(src, lo, hi, batch, self._eval_pool),
                                      max(0, hi - lo), self.device)

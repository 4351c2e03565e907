"""The weighted gradient all-reduce of a worker: one flat buffer, reduced flat or in buckets.

Layout. Every gradient is a view of one flat buffer (backward accumulates into it in place,
the collective works on it in place), followed by one coverage slot per position of the
step (see :mod:`actors.contracts`)::

    flat = [ grad(p_0) | grad(p_1) | ... | grad(p_{n-1}) | coverage[0:B_s] ]

Weighting. Each worker scales its summed loss by 1/B (B the step's global batch), so the
SUM all-reduce yields Σ_i (b_i/B)·g_i, the mean gradient of the global batch, whatever the
split or the bucketing: a bucket is a contiguous slice of the buffer and the sum is taken
element-wise.

Two modes:

* ``flat``: one all-reduce of the whole buffer after backward (the collective starts when
  the last gradient is ready).
* ``bucketed`` (as DDP's reducer): the buffer is cut into buckets of about ``bucket_bytes``
  from its END (the last layers' gradients are ready first in backward); the first bucket
  also holds the coverage slots, which are written before backward. A
  ``register_post_accumulate_grad_hook`` on each parameter counts the gradients still
  missing in its bucket; when a bucket is complete it is launched as an asynchronous
  all-reduce, so communication runs behind the rest of backward. Buckets are launched
  strictly in index order (bucket k waits for every bucket before it), so every rank issues
  the same sequence of collectives, as gloo and NCCL require. :meth:`finish` launches what
  the hooks did not (a worker with an empty share runs no backward) and waits for all.

Hooks fire only while the reducer is *armed*: with micro-batch accumulation only the last
micro-batch's backward completes the gradient, so the earlier ones run unarmed.

A GPU worker in a gloo group (any member on the CPU) stages through pinned host memory
and reduces flat.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

MODES = ("flat", "bucketed")


def plan_buckets(sizes: Sequence[int], bucket_elems: int) -> list[tuple[int, int, list[int]]]:
    """Cut parameters (``sizes`` in buffer order) into buckets from the end of the buffer.

    Returns ``(lo, hi, params)`` per bucket in launch order: bucket 0 ends at the last
    parameter, each bucket is contiguous and holds at least one parameter, and a bucket is
    closed once it reaches ``bucket_elems`` elements. Pure, for tests.
    """
    offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))).tolist()
    buckets: list[tuple[int, int, list[int]]] = []
    hi = offsets[-1]
    params: list[int] = []
    for i in range(len(sizes) - 1, -1, -1):
        params.append(i)
        lo = offsets[i]
        if hi - lo >= bucket_elems or i == 0:
            buckets.append((lo, hi, params))
            hi, params = lo, []
    return buckets


class GradientReducer:
    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        device: torch.device,
        max_step: int,
        mode: str = "bucketed",
        bucket_bytes: int = 1 << 20,
    ):
        if mode not in MODES:
            raise ValueError(f"unknown all-reduce mode {mode!r}: use one of {MODES}")
        self.params = list(params)
        self.device = device
        self.mode = mode
        self.n_params = sum(p.numel() for p in self.params)
        elem = torch.empty(0, dtype=self.params[0].dtype).element_size() if self.params else 4
        self._buckets = plan_buckets([p.numel() for p in self.params],
                                     max(1, bucket_bytes // elem))
        self._bucket_of = {}
        for k, (_, _, members) in enumerate(self._buckets):
            for i in members:
                self._bucket_of[i] = k
        self._host: torch.Tensor | None = None
        self._armed = False
        self._missing: list[int] = []
        self._ready: list[bool] = []
        self._works: list[tuple[int, object]] = []
        self._launch_error: BaseException | None = None
        self._next = 0
        self._step_size = 0
        self.first_launch: float | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                       for i, p in enumerate(self.params)] if self.params else []
        self.alloc(max_step)

    # --- buffer -----------------------------------------------------------------------
    def alloc(self, max_step: int) -> None:
        """(Re)allocate the buffer for steps of up to ``max_step`` samples; gradients become
        views of it."""
        self.flat = torch.zeros(self.n_params + max_step, device=self.device)
        off = 0
        for p in self.params:
            p.grad = self.flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        self.cov = self.flat[self.n_params:]
        if self.device.type == "cuda":
            self._host = torch.zeros(self.flat.numel(), pin_memory=True)

    def zero_(self) -> None:
        self.flat.zero_()

    @property
    def overlapping(self) -> bool:
        """Whether buckets go out from hooks (CPU or NCCL); a GPU in a gloo group stages
        the whole buffer through host memory instead."""
        return self.mode == "bucketed" and not (
            self.device.type == "cuda" and _backend() == "gloo")

    # --- one step ---------------------------------------------------------------------
    def begin(self, step_size: int) -> None:
        """Start a step of ``step_size`` samples: zero the buffer (gradients and coverage)."""
        if step_size > self.cov.numel():
            self.alloc(step_size)
        self.flat.zero_()
        self._step_size = step_size
        self._works = []
        self._launch_error = None
        self._next = 0
        self._missing = [len(m) for _, _, m in self._buckets]
        self._ready = [False] * len(self._buckets)
        self._armed = False
        self.first_launch = None

    def arm(self) -> None:
        """The next backward completes the gradient: buckets may go out from its hooks."""
        self._armed = self.overlapping

    def _hook(self, i: int):
        def hook(_p: torch.Tensor) -> None:
            if not self._armed:
                return
            k = self._bucket_of[i]
            self._missing[k] -= 1
            if self._missing[k] == 0:
                self._ready[k] = True
                while self._next < len(self._buckets) and self._ready[self._next]:
                    self._launch(self._next)
        return hook

    def _slice(self, k: int) -> torch.Tensor:
        lo, hi, _ = self._buckets[k]
        if k == 0:  # the first bucket carries the coverage slots too
            hi = self.n_params + self._step_size
        return self.flat[lo:hi]

    def _launch(self, k: int) -> None:
        self._next = k + 1
        if self._launch_error is not None:
            return
        if self.first_launch is None:
            self.first_launch = time.perf_counter()
        try:
            work = dist.all_reduce(self._slice(k), op=dist.ReduceOp.SUM, async_op=True)
        except Exception as err:
            # From a hook, an error would surface from backward and look like this
            # worker's own compute error; it is the collective's (a peer's), so finish()
            # raises it.
            self._launch_error = err
            return
        self._works.append((k, work))

    def finish(self) -> np.ndarray:
        """Launch what is left, wait for every bucket, and return the step's all-reduced
        coverage counts on the host."""
        self._armed = False
        if not self.overlapping:
            return self._flat_reduce()
        if not self._buckets:  # a model without parameters: coverage alone
            dist.all_reduce(self.cov[:self._step_size], op=dist.ReduceOp.SUM)
        while self._next < len(self._buckets):
            self._launch(self._next)
        if self._launch_error is not None:
            raise self._launch_error
        for _, work in self._works:
            work.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's one synchronisation
        cov = self.cov[:self._step_size]
        return (cov.cpu() if cov.device.type == "cuda" else cov).numpy()

    def _flat_reduce(self) -> np.ndarray:
        n = self.n_params + self._step_size
        flat = self.flat[:n]
        self.first_launch = time.perf_counter()
        if self.device.type == "cuda" and _backend() == "gloo":
            host = self._host[:n]
            host.copy_(flat, non_blocking=True)
            torch.cuda.synchronize(self.device)
            dist.all_reduce(host, op=dist.ReduceOp.SUM)
            flat.copy_(host, non_blocking=True)
            torch.cuda.synchronize(self.device)
            return host[self.n_params:].numpy()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        cov = flat[self.n_params:]
        return (cov.cpu() if cov.device.type == "cuda" else cov).numpy()


def _backend() -> str | None:
    return dist.get_backend() if dist.is_initialized() else None

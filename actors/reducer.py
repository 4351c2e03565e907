"""The weighted gradient all-reduce of a worker: one flat buffer, reduced flat or in buckets.

Layout. Every gradient is a view of one flat buffer (backward accumulates into it in place,
the collective works on it in place), followed by one coverage slot per position of the
step (see :mod:`dynabatch.actors.contracts`), with one slot before them for the worker's
summed loss::

    flat = [ grad(p_0) | grad(p_1) | ... | grad(p_{n-1}) | loss | coverage[0:B_s] ]

The loss slot (ISGD's batch loss). The share's summed loss is known after the
last micro-batch's forward, before its backward, so the worker writes it into the slot
there (:meth:`dynabatch.actors.step.StepMath.share`'s ``loss_slot``) and it rides in the
collective that already carries the coverage: every worker gets the global batch's summed
loss back with the gradient (:attr:`Reduced.global_loss_sum`), and ISGD's control chart
needs no collective of its own (a step that flags nothing costs what an SGD step costs).

Each worker back-propagates its summed loss over 1/B (:mod:`dynabatch.actors.step`), so the
SUM all-reduce is the global batch's mean gradient whatever the bucketing.

Two modes: ``flat``, one all-reduce of the whole buffer after backward; ``bucketed`` (as
DDP's reducer), buckets cut from the buffer's END (the last layers' gradients are ready
first), each launched from backward's hooks once complete, strictly in index order so every
rank issues the same collectives. The first bucket also carries the loss and coverage slots.
Bucket sizes, the overlap measurement and goodput's per-bucket norms: docs/architecture.md
("Overlapped, bucketed all-reduce").

One plan per group (:class:`CollectivePlan`). Every member of a group must issue the same
collectives, the same number in the same order over the same offsets, or gloo fails on a
size mismatch, hangs, or sums unrelated slices. So the mode and the bucket boundaries are
the group's: :func:`group_plan` derives them from what every member shares (the group's
backend, which the coordinator chose from every member's device; the spec's mode and bucket
size; the model), never from one member's device, and :meth:`GradientReducer.use_group`
takes them at the join. A GPU member of a gloo group (any member on the CPU) cannot hand
gloo device memory: it *stages* the buffer through pinned host memory after backward (one
copy and the step's one synchronisation, its loss and norm riding along) and issues the
plan's calls on that copy, bucket by bucket as its CPU peers do, then copies the sum back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
MIN_BUCKET_BYTES = 32 * 2**10
AUTO_BUCKETS = 4


@dataclass(frozen=True)
class CollectivePlan:
    """How every member of a group reduces its gradient buffer: ``flat`` (one all-reduce of
    the whole buffer) or ``bucketed``; ``buckets``: the buckets' ``[lo, hi)`` element ranges
    of the gradients in launch order (from the buffer's end; bucket 0 also carries the loss
    and coverage slots); ``bucket_bytes``: the ``(first, rest)`` sizes they were cut with."""

    mode: str
    buckets: tuple[tuple[int, int], ...]
    bucket_bytes: tuple[int, int] = (DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES)

    def calls(self, n_params: int, n: int) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` ranges of the buffer's first ``n`` elements (gradients, loss,
        coverage) that this plan all-reduces, in order: the same list in every member."""
        if self.mode == "flat" or not self.buckets:
            return [(0, n)] if self.buckets else [(n_params, n)]
        return [(lo, n if k == 0 else hi) for k, (lo, hi) in enumerate(self.buckets)]


def group_plan(backend: str | None, sizes: Sequence[int], mode: str = "bucketed",
               bucket_bytes: int | None = None, elem: int = 4) -> CollectivePlan:
    """The collective plan of a group of ``backend`` for a model whose parameters have
    ``sizes`` (elements, in buffer order, ``elem`` bytes each); ``bucket_bytes``: the spec's
    (None: automatic). NCCL (every member on a GPU): the GPU's sizes; otherwise (some member
    on the CPU, or no group) DDP's, which its CPU members reduce best with and its GPU
    members stage. Pure: every member computes the same value."""
    if bucket_bytes is None:
        first, rest = auto_bucket_bytes(sum(sizes) * elem, gpu=backend == "nccl")
    else:
        first = rest = bucket_bytes
    cuts = plan_buckets(sizes, max(1, rest // elem), max(1, first // elem)) if sizes else []
    return CollectivePlan(mode, tuple((lo, hi) for lo, hi, _ in cuts), (first, rest))


def stages_through_host(device: torch.device, backend: str | None) -> bool:
    """Whether a member on ``device`` stages its buffer through host memory in a group of
    ``backend``: a GPU in a gloo group (gloo reduces host memory only)."""
    return device.type == "cuda" and backend == "gloo"


def auto_bucket_bytes(model_bytes: int, *, gpu: bool = True) -> tuple[int, int]:
    """``(first, rest)`` bucket sizes for a model whose gradients take ``model_bytes``.
    On a GPU: a quarter of the model, between 32 KiB and DDP's 25 MiB; the first at most
    1 MiB. On the CPU: DDP's 1 MiB and 25 MiB (why: docs/architecture.md)."""
    if not gpu:
        return DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES
    rest = min(DDP_BUCKET_BYTES, max(MIN_BUCKET_BYTES, model_bytes // AUTO_BUCKETS))
    return min(DDP_FIRST_BUCKET_BYTES, rest), rest


def plan_buckets(sizes: Sequence[int], bucket_elems: int, first_elems: int | None = None
                 ) -> list[tuple[int, int, list[int]]]:
    """Cut parameters (``sizes`` in buffer order) into buckets from the end of the buffer.

    Returns ``(lo, hi, params)`` per bucket in launch order: bucket 0 ends at the last
    parameter, each bucket is contiguous and holds at least one parameter, and a bucket is
    closed once it reaches ``bucket_elems`` elements (``first_elems`` for bucket 0, when
    given). Pure.
    """
    offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))).tolist()
    buckets: list[tuple[int, int, list[int]]] = []
    hi = offsets[-1]
    params: list[int] = []
    cap = first_elems if first_elems is not None else bucket_elems
    for i in range(len(sizes) - 1, -1, -1):
        params.append(i)
        lo = offsets[i]
        if hi - lo >= cap or i == 0:
            buckets.append((lo, hi, params))
            hi, params = lo, []
            cap = bucket_elems
    return buckets


def hidden_seconds(spans: Sequence[tuple[float, float]], until: float) -> float:
    """Length of the union of the intervals ``[start, end]`` that lies before ``until``:
    how long some bucket's all-reduce was in flight while compute still ran. Pure."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        lo, hi = max(start, reach), min(end, until)
        if hi > lo:
            total += hi - lo
        reach = max(reach, end)
    return total


class StepMarks:
    """Points in time of one step: host clock readings on the CPU; on a GPU, CUDA events on
    the current stream, which :meth:`seconds` reads only after the step's synchronisation."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._t0: float | torch.cuda.Event = 0.0

    def begin(self) -> None:
        self._t0 = self.mark()

    def mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, mark: float | torch.cuda.Event) -> float:
        """Seconds from :meth:`begin` to ``mark`` (a GPU's after its synchronisation)."""
        if not self.cuda:
            return mark - self._t0
        return self._t0.elapsed_time(mark) / 1000.0


@dataclass
class Reduced:
    """What a step's all-reduce brings home. ``compute_s`` and ``wait_s`` are device-timed
    on a GPU (None on the CPU, where the worker's own clock times compute)."""

    coverage: np.ndarray  # the all-reduced per-position counts
    loss_sum: float  # this worker's summed loss (its share's)
    hidden_s: float  # communication hidden behind compute (see hidden_seconds)
    buckets: int  # collectives launched this step
    early: int  # of them, launched from backward's hooks
    first_launch_s: float | None = None  # from the step's start to its first collective
    local_sq: float | None = None  # |(b_i/B)·g_i|² before the all-reduce (goodput)
    global_sq: float | None = None  # |G|² after it (goodput)
    compute_s: float | None = None
    wait_s: float | None = None
    global_loss_sum: float = 0.0  # the loss slot, all-reduced: Σ over every share


class GradientReducer:
    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        device: torch.device,
        max_step: int,
        mode: str = "bucketed",
        bucket_bytes: int | None = None,
    ):
        self.params = list(params)
        self.device = torch.device(device)
        self.n_params = sum(p.numel() for p in self.params)
        self._sizes = [p.numel() for p in self.params]
        self._elem = (torch.empty(0, dtype=self.params[0].dtype).element_size()
                      if self.params else 4)
        self._mode, self._bucket_spec = mode, bucket_bytes
        self.marks = StepMarks(self.device)
        self._host: torch.Tensor | None = None
        self.staged = False
        self.flat = torch.zeros(0, device=self.device)
        # Until the worker joins a group (use_group): the plan of a group of members like
        # this one, for steps run alone (profiling, warm-up, a one-member group).
        self.use_plan(group_plan("nccl" if self.device.type == "cuda" else "gloo",
                                 self._sizes, mode, bucket_bytes, self._elem), staged=False)
        self._armed = False
        self._missing: list[int] = []
        self._ready: list[bool] = []
        self._works: list[tuple[int, object]] = []
        self._spans: list[list] = []  # per launched bucket: [launch mark, done mark]
        self._launch_error: BaseException | None = None
        self._next = 0
        self._early = 0
        self._step_size = 0
        self._norms = False
        self._sq: list[torch.Tensor] = []
        self._pace: Callable[[], object] | None = None
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook(i))
        self.alloc(max_step)

    @property
    def n_buckets(self) -> int:
        return len(self._buckets)

    # --- the group's plan ---------------------------------------------------------------
    def use_group(self, backend: str | None) -> CollectivePlan:
        """Take the plan of a group of ``backend`` (at the join; see :func:`group_plan`),
        staging through host memory where this member's device needs it."""
        plan = group_plan(backend, self._sizes, self._mode, self._bucket_spec, self._elem)
        self.use_plan(plan, staged=stages_through_host(self.device, backend))
        return plan

    def use_plan(self, plan: CollectivePlan, staged: bool) -> None:
        """Reduce by ``plan`` from the next step on; ``staged``: through a host copy of the
        buffer (a GPU in a gloo group) rather than in place from backward's hooks. Refuses
        a plan whose buckets do not fall on this model's parameters (another model)."""
        offsets = np.concatenate(([0], np.cumsum(self._sizes, dtype=np.int64))).tolist()
        where = {off: i for i, off in enumerate(offsets)}
        buckets: list[tuple[int, int, list[int]]] = []
        hi_expected = offsets[-1]
        for lo, hi in plan.buckets:
            if hi != hi_expected or lo not in where or hi not in where or lo >= hi:
                raise ValueError(f"collective plan: bucket [{lo}, {hi}) does not fall on "
                                 f"this model's parameters (offsets {offsets[:4]}...)")
            buckets.append((lo, hi, list(range(where[hi] - 1, where[lo] - 1, -1))))
            hi_expected = lo
        if hi_expected != 0:
            raise ValueError(f"collective plan: its buckets end at element {hi_expected}, "
                             "not at the buffer's start")
        self.plan, self.staged, self._buckets = plan, staged, buckets
        self._bucket_of = {i: k for k, (_, _, members) in enumerate(buckets) for i in members}
        if staged and (self._host is None or self._host.numel() < self.flat.numel() + 3):
            self._host = self._new_host(self.flat.numel() + 3)

    def _new_host(self, n: int) -> torch.Tensor:
        return torch.zeros(n, pin_memory=self.device.type == "cuda")

    # --- buffer -----------------------------------------------------------------------
    def alloc(self, max_step: int) -> None:
        """(Re)allocate the buffer for steps of up to ``max_step`` samples; gradients become
        views of it."""
        self.flat = torch.zeros(self.n_params + 1 + max_step, device=self.device)
        off = 0
        for p in self.params:
            # In the parameter's own layout (channels_last weights: the spec's
            # channels_last), as autograd's gradient layout contract asks: a contiguous
            # view of a channels_last weight is accumulated into through a strided copy.
            # Either layout is a dense permutation of the same p.numel() elements.
            p.grad = (self.flat[off:off + p.numel()].view_as(p) if p.is_contiguous()
                      else self.flat.as_strided(p.size(), p.stride(),
                                                self.flat.storage_offset() + off))
            off += p.numel()
        self.loss_slot = self.flat[self.n_params:self.n_params + 1]
        self.cov = self.flat[self.n_params + 1:]
        if self.device.type == "cuda" or self.staged:
            # The loss slot and coverage (or the whole buffer, staged for gloo) plus 3
            # scalars: loss, norms.
            self._host = self._new_host(self.flat.numel() + 3)

    def zero_(self) -> None:
        self.flat.zero_()

    @property
    def overlapping(self) -> bool:
        """Whether buckets go out from hooks (CPU or NCCL); a GPU in a gloo group stages
        the whole buffer through host memory instead."""
        return self.plan.mode == "bucketed" and not self.staged

    # --- one step ---------------------------------------------------------------------
    def begin(self, step_size: int, norms: bool = False,
              pace: Callable[[], object] | None = None) -> None:
        """Start a step of ``step_size`` samples: zero the buffer (gradients and coverage)
        and mark the step's start. ``norms``: measure |g_i|² before the all-reduce
        (goodput). ``pace``: called before a bucket leaves from a hook (emulated slowdown,
        see :mod:`dynabatch.actors.emulation`)."""
        if step_size > self.cov.numel():
            self.alloc(step_size)
        self.marks.begin()
        self.flat.zero_()
        self._step_size = step_size
        self._works = []
        self._spans = []
        self._launch_error = None
        self._next = 0
        self._early = 0
        self._missing = [len(m) for _, _, m in self._buckets]
        self._ready = [False] * len(self._buckets)
        self._armed = False
        self._norms = norms
        self._sq = []
        self._pace = pace

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
                if self._next < len(self._buckets) and self._ready[self._next]:
                    if self._pace is not None:
                        self._pace()  # a slowed worker's bucket leaves when it would
                    while self._next < len(self._buckets) and self._ready[self._next]:
                        self._early += 1
                        self._launch(self._next)
        return hook

    def _slice(self, k: int) -> torch.Tensor:
        lo, hi, _ = self._buckets[k]
        if k == 0:  # the first bucket carries the loss and coverage slots too
            hi = self.n_params + 1 + self._step_size
        return self.flat[lo:hi]

    def _launch(self, k: int) -> None:
        self._next = k + 1
        if self._launch_error is not None:
            return
        if self._norms:  # before the collective overwrites the bucket in place
            lo, hi, _ = self._buckets[k]
            g = self.flat[lo:hi]
            self._sq.append(torch.dot(g, g))
        span = [self.marks.mark(), None]
        try:
            work = dist.all_reduce(self._slice(k), op=dist.ReduceOp.SUM, async_op=True)
        except Exception as err:
            # From a hook, an error would surface from backward and look like this
            # worker's own compute error; it is the collective's (a peer's), so finish()
            # raises it.
            self._launch_error = err
            return
        marks = self.marks

        def done(_fut: torch.futures.Future) -> None:
            span[1] = marks.mark()

        work.get_future().then(done)
        self._spans.append(span)
        self._works.append((k, work))

    def finish(self, compute_end: float | torch.cuda.Event | None = None,
               loss: torch.Tensor | None = None) -> Reduced:
        """Launch what is left, wait for every bucket, and bring the step's results home:
        the all-reduced coverage counts, ``loss`` (this worker's summed loss), the norms in
        goodput mode, and how much communication ran before ``compute_end`` (a mark of
        :attr:`marks`; None: now)."""
        self._armed = False
        if compute_end is None:
            compute_end = self.marks.mark()
        if self.staged:
            return self._staged_finish(compute_end, loss)
        if not self.overlapping:
            return self._flat_finish(compute_end, loss)
        if not self._buckets:  # a model without parameters: loss and coverage alone
            dist.all_reduce(self.flat[self.n_params:self.n_params + 1 + self._step_size],
                            op=dist.ReduceOp.SUM)
        while self._next < len(self._buckets):
            self._launch(self._next)
        if self._launch_error is not None:
            raise self._launch_error
        for _, work in self._works:
            work.wait()
        launched = len(self._works)
        local_sq = torch.stack(self._sq).sum() if self._norms and self._sq else None
        g = self.flat[:self.n_params]
        global_sq = torch.dot(g, g) if self._norms else None
        slots = self.flat[self.n_params:self.n_params + 1 + self._step_size]  # loss, coverage
        res, comm_end = self._home(slots, loss, local_sq, global_sq, launched, self._early,
                                   compute_end)
        # A completion not marked yet (its callback still to run) ended by the last wait.
        spans = [(self.marks.seconds(a), self.marks.seconds(b if b is not None else comm_end))
                 for a, b in self._spans]
        res.hidden_s = hidden_seconds(spans, self.marks.seconds(compute_end))
        res.first_launch_s = spans[0][0] if spans else None
        return res

    def _home(self, slots: torch.Tensor, loss: torch.Tensor | None,
              local_sq: torch.Tensor | None, global_sq: torch.Tensor | None, buckets: int,
              early: int, compute_end: float | torch.cuda.Event) -> tuple[Reduced, object]:
        """The step's results from the all-reduced ``slots`` (the loss slot, then the
        coverage) and this worker's scalars, with the mark of the communication's end; on a
        GPU in one pinned copy, device-timed."""
        comm_end = self.marks.mark()
        if self.device.type != "cuda":
            h = slots.numpy()
            return Reduced(coverage=h[1:], loss_sum=_item_or(loss) or 0.0,
                           local_sq=_item_or(local_sq), global_sq=_item_or(global_sq),
                           hidden_s=0.0, buckets=buckets, early=early,
                           global_loss_sum=float(h[0])), comm_end
        host = self._to_host(slots, loss, local_sq, global_sq)
        compute_s = self.marks.seconds(compute_end)
        return Reduced(coverage=host[0][1:], loss_sum=host[1], local_sq=host[2],
                       global_sq=host[3], hidden_s=0.0, buckets=buckets, early=early,
                       compute_s=compute_s,
                       wait_s=max(0.0, self.marks.seconds(comm_end) - compute_s),
                       global_loss_sum=float(host[0][0])), comm_end

    def _to_host(self, cov: torch.Tensor, *scalars: torch.Tensor | None) -> tuple:
        """One pinned copy of the coverage and the scalars, then the step's one
        synchronisation (GPU)."""
        n = cov.numel()
        host = self._host[:n + len(scalars)]
        vals = [s.reshape(()).float() if s is not None else cov.new_zeros(())
                for s in scalars]
        packed = torch.cat([cov, torch.stack(vals)])
        host.copy_(packed, non_blocking=True)
        torch.cuda.synchronize(self.device)  # the step's one synchronisation
        out = host.numpy()
        vals_h = [float(out[n + j]) if s is not None else None for j, s in enumerate(scalars)]
        vals_h[0] = vals_h[0] or 0.0  # the loss of an empty share is 0
        return (out[:n].copy(), *vals_h)

    def _staged_finish(self, compute_end, loss: torch.Tensor | None) -> Reduced:
        """Reduce through a host copy of the buffer: the plan's calls, in its order, on the
        copy (the same calls as the members that reduce in place), then the sum back."""
        n = self.n_params + 1 + self._step_size
        flat = self.flat[:n]
        g = self.flat[:self.n_params]
        local_sq = torch.dot(g, g) if self._norms else None
        # The loss and local norm ride along: one synchronisation, then the copy back is
        # ordered before the optimizer on the device's stream.
        host = self._host[:n + 2]
        vals = [loss.reshape(()).float() if loss is not None else flat.new_zeros(()),
                local_sq if local_sq is not None else flat.new_zeros(())]
        host.copy_(torch.cat([flat, torch.stack(vals)]), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's one synchronisation
        compute_s = self.marks.seconds(compute_end)
        t0 = time.perf_counter()
        calls = self.plan.calls(self.n_params, n)
        works = [dist.all_reduce(host[lo:hi], op=dist.ReduceOp.SUM, async_op=True)
                 for lo, hi in calls]
        for work in works:
            work.wait()
        flat.copy_(host[:n], non_blocking=True)
        h = host.numpy()
        global_sq = (float(np.dot(h[:self.n_params], h[:self.n_params])) if self._norms
                     else None)
        return Reduced(coverage=h[self.n_params + 1:n].copy(), loss_sum=float(h[n]),
                       local_sq=float(h[n + 1]) if self._norms else None,
                       global_sq=global_sq, hidden_s=0.0, buckets=len(calls), early=0,
                       compute_s=compute_s if self.device.type == "cuda" else None,
                       wait_s=time.perf_counter() - t0 if self.device.type == "cuda" else None,
                       global_loss_sum=float(h[self.n_params]))

    def _flat_finish(self, compute_end, loss: torch.Tensor | None) -> Reduced:
        n = self.n_params + 1 + self._step_size
        flat = self.flat[:n]
        g = self.flat[:self.n_params]
        local_sq = torch.dot(g, g) if self._norms else None
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        global_sq = torch.dot(g, g) if self._norms else None
        return self._home(flat[self.n_params:], loss, local_sq, global_sq, 1, 0,
                          compute_end)[0]


def _item_or(t: torch.Tensor | None) -> float | None:
    return float(t) if t is not None else None

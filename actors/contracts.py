"""What crosses between a job's coordinator and a worker: the plan it trains and what it reports.

These types sit in ``actors`` because that is the lowest layer that uses them: the
scheduler imports them downward. Pure: numpy and pydantic, no ray, no torch. How sample
order and coverage prove exactly-once: docs/architecture.md ("Sample order and coverage").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

# (count, run length) pairs: [(1, 64)] means 64 positions trained exactly once.
Coverage = tuple[tuple[int, int], ...]


def epoch_order(seed: int, epoch: int, dataset_size: int, shuffle: str = "every_epoch"
                ) -> np.ndarray:
    """The epoch's sample order: a permutation of ``range(dataset_size)``. With ``shuffle``
    ``once`` every epoch trains epoch 0's permutation, so at a fixed global batch the same
    batches recur in a fixed cycle (Caffe-style data layers, as ISGD's paper trains)."""
    return np.random.default_rng([seed, epoch if shuffle == "every_epoch" else 0]
                                 ).permutation(dataset_size)


def encode_counts(counts: np.ndarray) -> Coverage:
    """Run-length encode an integer vector: ``[1, 1, 2, 1] -> ((1, 2), (2, 1), (1, 1))``."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.size == 0:
        return ()
    edges = np.flatnonzero(np.diff(counts)) + 1
    starts = np.concatenate(([0], edges))
    lengths = np.diff(np.concatenate((starts, [counts.size])))
    return tuple((int(counts[s]), int(n)) for s, n in zip(starts, lengths, strict=True))


def decode_counts(coverage: Coverage) -> np.ndarray:
    """Inverse of :func:`encode_counts`."""
    if not coverage:
        return np.zeros(0, dtype=np.int64)
    values, lengths = zip(*coverage, strict=True)
    return np.repeat(np.asarray(values, dtype=np.int64), np.asarray(lengths, dtype=np.int64))


@dataclass(frozen=True, slots=True)
class IsgdRule:
    """ISGD for one step: when the global batch's loss ψ is above ``limit`` the batch is
    under-trained and gets up to ``max_extra`` conservative iterations (see
    :mod:`dynabatch.actors.optim`). ``limit`` comes from the control chart."""

    limit: float
    epsilon: float
    max_extra: int

    def flagged(self, loss: float) -> bool:
        return loss > self.limit

    def more(self, loss: float, done: int) -> bool:
        """Whether to take another extra iteration, ``done`` taken, at loss ``loss`` (the
        loss of the batch at the current weights)."""
        return done < self.max_extra and loss > self.limit


@dataclass(frozen=True, slots=True)
class ControlChart:
    """ISGD's control chart (Wang et al., arXiv 1603.05544): which batches are under-trained.

    It keeps the global losses ψ of the last ``window`` batches (a FIFO). Its upper control
    limit is ``mean(ψ) + σ·std(ψ)`` (std: the population standard deviation); a batch whose
    loss is above it is under-trained. No limit until the window is full.

    Pure and deterministic: the coordinator and every worker push the same all-reduced
    losses in the same order, so they hold the same chart and the same limit, bit for bit
    (see :class:`IsgdPlan`).
    """

    window: int
    sigma: float
    losses: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"window must be at least 2, got {self.window}")
        if len(self.losses) > self.window:
            raise ValueError("more losses than the window holds")

    def push(self, loss: float) -> ControlChart:
        """The chart after one more batch loss (non-finite losses are not charted)."""
        if not math.isfinite(loss):
            return self
        return ControlChart(self.window, self.sigma, (*self.losses, loss)[-self.window:])

    def resized(self, window: int) -> ControlChart:
        """The chart over the last ``window`` batches (``isgd.window: epoch`` follows the
        steps per epoch when the global batch changes)."""
        if window == self.window:
            return self
        return ControlChart(window, self.sigma, self.losses[-window:])

    @property
    def limit(self) -> float | None:
        n = len(self.losses)
        if n < self.window:
            return None
        mean = sum(self.losses) / n
        var = sum((x - mean) ** 2 for x in self.losses) / n
        return mean + self.sigma * math.sqrt(var)


@dataclass(frozen=True, slots=True)
class IsgdPlan:
    """ISGD over one segment: the control chart as of its first step, and the rule's other
    parameters. Every worker sees the same all-reduced loss ψ of every step, so each keeps
    the chart up to date itself (:meth:`after`) and judges every batch against the limit of
    the batches just before it, however long the segment; the coordinator replays the
    chart from the reported losses and checks every worker's decisions
    (:meth:`dynabatch.scheduler.core.regime.regime.Regime.observe`). ``monitor`` is false in the
    first epoch
    (the losses of an untrained model say nothing about batches)."""

    chart: ControlChart
    epsilon: float
    max_extra: int
    monitor: bool = True

    def rule(self) -> IsgdRule | None:
        """The rule of the next step; None while monitoring has not started or the window
        is not full."""
        lim = self.chart.limit
        if not self.monitor or lim is None:
            return None
        return IsgdRule(limit=lim, epsilon=self.epsilon, max_extra=self.max_extra)

    def after(self, loss: float) -> IsgdPlan:
        """The plan for the step after one whose batch loss was ``loss``."""
        return IsgdPlan(self.chart.push(loss), self.epsilon, self.max_extra, self.monitor)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step for one worker: the step's positions and this worker's share of them, and
    how to step: the learning rate (None: the optimizer's own) and whether to report
    gradient norms for the noise-scale estimate (goodput mode). ISGD's rule is the
    segment's (:class:`IsgdPlan`)."""

    step: int  # step index within the epoch
    start: int  # order position of the step's first sample
    size: int  # the step's global batch
    own_start: int  # order position of this worker's first sample
    own_size: int  # this worker's share (0 is allowed: an empty share of a last step)
    lr: float | None = None
    noise: bool = False


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """Consecutive steps of one epoch for one worker; ``isgd``: ISGD's chart and rule
    (None: off)."""

    epoch: int
    seed: int
    dataset_size: int
    steps: tuple[StepPlan, ...]
    isgd: IsgdPlan | None = None
    # The driver may post a plan update for these steps: claim each step's key in the
    # group's store before starting it (dynabatch.scheduler.core.sync.update).
    updates: bool = False
    # The memory cap the driver learned for this worker's node and device (its largest
    # micro-batch that fits, after an out-of-memory): the share is computed in
    # micro-batches of at most this many samples. None: none learned.
    micro_cap: int | None = None


def plan_key(epoch: int, step: int) -> str:
    """The group-store key a plan update for ``step`` of ``epoch`` is posted (or sealed)
    under (dynabatch.scheduler.core.sync.update)."""
    return f"dynabatch/plan/{epoch}/{step}"


class _Frozen(BaseModel):
    """The base of the immutable records here and in ``dynabatch.scheduler.telemetry``."""

    model_config = ConfigDict(frozen=True)


class StepTelemetry(_Frozen):
    """One worker's account of one step it completed (all-reduce and optimizer step done).

    ``compute_s`` is gather + forward + backward (+ emulated slowdown); ``wait_s`` is the
    weighted all-reduce after compute, which includes waiting for slower peers (with the
    bucketed all-reduce, only the part not hidden behind backward). ``start`` and
    ``samples`` are the order positions this worker trained; ``coverage`` is the step's
    all-reduced per-position count (:func:`encode_counts`).

    The breakdown (wall seconds, summed over micro-batches; device-timed on a GPU):
    ``gather_s`` (index and copy the samples), ``forward_s`` (model and loss),
    ``backward_s`` (without an emulated slowdown's sleep), ``optimizer_s``; ``overlap_s``
    is the communication hidden behind compute: how long some gradient bucket's all-reduce
    was in flight (launch to completion) before compute ended (see :mod:`dynabatch.actors.reducer`);
    ``step_s`` is the whole step as the worker saw it.
    ``micro_batches`` is how many micro-batches the share was computed in.
    ``data_wait_s`` is how long the step blocked for its samples (part of ``compute_s``
    and of ``gather_s``), ``loader_rate`` the loader's own samples per second
    (:mod:`dynabatch.actors.data.loader`).
    """

    worker: str
    epoch: int
    step: int
    batch: int
    samples: int
    compute_s: float
    wait_s: float
    loss_sum: float = Field(description="Sum of per-sample losses over the worker's batch.")
    slowdown: float = 1.0
    start: int = 0
    step_start: int = 0
    step_size: int = 0
    coverage: Coverage = ()
    flagged: bool = Field(default=False, description="ISGD flagged the step's global batch.")
    extra_iters: int = Field(default=0, description="ISGD extra iterations on this batch: "
                             "each one conservative step and one more pass (forward, "
                             "backward, all-reduce) over the batch.")
    isgd_loss: float | None = Field(
        default=None, description="ISGD: the all-reduced batch loss ψ the worker judged and "
        "charted (the coordinator replays the chart from it).")
    overflow: bool = Field(
        default=False, description="precision fp16: the all-reduced gradient was not "
        "finite; every worker skipped the update and halved its loss scale.")
    local_sqnorm: float | None = Field(
        default=None, description="|g_i|² of this worker's local mean gradient (goodput).")
    global_sqnorm: float | None = Field(
        default=None, description="|G|² of the all-reduced mean gradient (goodput).")
    gather_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    overlap_s: float = 0.0
    step_s: float = 0.0
    micro_batches: int = 1
    micro_cap: int | None = None
    data_wait_s: float = Field(
        default=0.0, description="Seconds the step blocked for its samples (0 when the "
        "loader's read-ahead hid the read); counted in compute_s.")
    loader_rate: float | None = Field(
        default=None, description="The loader's own reading speed since the last step, "
        "samples per second of its threads' time (None: nothing read, or in memory).")


ErrorKind = Literal["peer", "compute", "oom", "user"]


class SegmentResult(_Frozen):
    """What a worker returns after running a segment of consecutive steps.

    ``error_kind`` tells why it stopped early: ``peer`` when the collective failed (a peer
    died, left or timed out: retryable), ``compute`` when this worker's own step raised
    (gather, forward, backward or optimizer: possibly deterministic), ``user`` when that
    error is one in the job's own data, model or configuration (deterministic: the job
    fails at once, :class:`~dynabatch.actors.errors.UserError`), ``oom`` when its
    forward or backward ran out of device memory on a micro-batch of ``oom_batch``
    samples (retried with a smaller memory cap). ``failed_compute_s`` is how long the
    failed step computed before the collective, which tells a straggler.
    """

    worker: str
    steps: list[StepTelemetry]
    error: str | None = Field(
        default=None, description="Why the segment stopped early (a peer failed, a timeout)."
    )
    error_kind: ErrorKind | None = None
    failed_compute_s: float | None = None
    oom_batch: int | None = Field(
        default=None, description="error_kind oom: the micro-batch (samples) that did not "
        "fit the worker's device memory.")

"""What crosses between the scheduler and a worker: the plan it trains and what it reports.

These types sit in ``actors`` because that is the lowest layer that uses them: the
scheduler imports them downward. Pure: numpy and pydantic, no ray, no torch.

Sample order. Epoch ``e`` trains the permutation :func:`epoch_order` ``(seed, e, N)``;
step ``s`` trains the order positions ``[start, start + size)``, cut into the workers'
shares. A worker receives *positions* and looks the sample ids up in the same
permutation, so plans stay small and what it reports (the positions it trained) can be
checked against the epoch's coverage.

Coverage. Each step the gradient all-reduce also sums a vector with one slot per position
of the step, in which every worker writes 1 at the positions it trained. After the
all-reduce every participant holds, per position, how many workers trained it in that
step: a fact produced by the collective itself, reported as a run-length encoding
(:func:`encode_counts`). The scheduler's ledger rebuilds the epoch from these reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

# (count, run length) pairs: [(1, 64)] means 64 positions trained exactly once.
Coverage = tuple[tuple[int, int], ...]


def epoch_order(seed: int, epoch: int, dataset_size: int) -> np.ndarray:
    """The epoch's sample order: a permutation of ``range(dataset_size)``."""
    return np.random.default_rng([seed, epoch]).permutation(dataset_size)


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
    :mod:`actors.optim`). ``limit`` comes from the coordinator's control chart."""

    limit: float
    epsilon: float
    max_extra: int

    def flagged(self, loss: float) -> bool:
        return loss > self.limit

    def more(self, loss: float, done: int) -> bool:
        """Whether to take another extra iteration, ``done`` taken, at loss ``loss``."""
        return done < self.max_extra and loss > self.limit


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step for one worker: the step's positions and this worker's share of them, and
    how to step: the learning rate (None: the optimizer's own), the ISGD rule (None: off),
    and whether to report gradient norms for the noise-scale estimate (goodput mode)."""

    step: int  # step index within the epoch
    start: int  # order position of the step's first sample
    size: int  # the step's global batch
    own_start: int  # order position of this worker's first sample
    own_size: int  # this worker's share (0 is allowed: an empty share of a last step)
    lr: float | None = None
    isgd: IsgdRule | None = None
    noise: bool = False


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """Consecutive steps of one epoch for one worker."""

    epoch: int
    seed: int
    dataset_size: int
    steps: tuple[StepPlan, ...]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class StepTelemetry(_Frozen):
    """One worker's account of one step it completed (all-reduce and optimizer step done).

    ``compute_s`` is gather + forward + backward (+ emulated slowdown); ``wait_s`` is the
    weighted all-reduce after compute, which includes waiting for slower peers (with the
    bucketed all-reduce, only the part not hidden behind backward). ``start`` and
    ``samples`` are the order positions this worker trained; ``coverage`` is the step's
    all-reduced per-position count (see the module docstring).

    The breakdown (wall seconds, summed over micro-batches): ``gather_s`` (index and copy
    the samples), ``forward_s`` (model and loss), ``backward_s``, ``optimizer_s``;
    ``overlap_s`` is how long the all-reduce ran behind backward (from the first bucket's
    launch to the end of compute); ``step_s`` is the whole step as the worker saw it.
    ``micro_batches`` is how many micro-batches the share was computed in.
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
    extra_iters: int = Field(default=0, description="ISGD extra iterations on this batch.")
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


ErrorKind = Literal["peer", "compute"]


class SegmentResult(_Frozen):
    """What a worker returns after running a segment of consecutive steps.

    ``error_kind`` tells why it stopped early: ``peer`` when the collective failed (a peer
    died, left or timed out: retryable), ``compute`` when this worker's own step raised
    (gather, forward, backward or optimizer: possibly deterministic). ``failed_compute_s``
    is how long the failed step computed before the collective, which tells a straggler.
    """

    worker: str
    steps: list[StepTelemetry]
    error: str | None = Field(
        default=None, description="Why the segment stopped early (a peer failed, a timeout)."
    )
    error_kind: ErrorKind | None = None
    failed_compute_s: float | None = None
    output: tuple[str, ...] = Field(
        default=(), description="The worker's own output lines since its last segment "
        "('stdout: ...' / 'stderr: ...'; see actors.output)."
    )

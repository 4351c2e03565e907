"""What a failed segment means, and how often it may be retried. Pure: no ray, no clock.

Every failure is classified:

* **retryable**: a worker was lost (its actor died, its node went away) or hung (no answer
  long after its peers gave up): it is removed and the step is retried over the others;
* **straggler**: every worker answered, but the collective timed out while one worker was
  still computing for longer than the timeout allows: it is evicted (its node is kept
  out), so the same step does not time out again and again;
* **deterministic**: a worker's own step raised (an exception in the model or the loss,
  an injected error). The step is retried up to ``max_retries`` times; then the job fails
  with that error;
* **user error**: what a worker's step raised is an error in the job's own data, model or
  configuration (:class:`~dynabatch.actors.errors.UserError`: a token id at or above the
  model's ``vocab_size``, dict samples whose keys differ). It fails the same way on every
  node, so it is not a fault: the job fails at once, naming it, without retries;
* **out of memory**: a worker's forward or backward ran out of device memory on a
  micro-batch of b samples. Its node and device's memory cap becomes b // 2
  (:class:`MemoryCaps`; every later plan of a worker there carries it, so a replacement
  inherits it) and the step is retried, uncounted: each retry is at a smaller micro-batch,
  so they end. The job fails only when one sample does not fit.

A failure that fits none of these (every worker reports a peer error and nobody is
slow) is retried too, at most ``max_retries + 1`` times in a row at the same step, so
nothing loops forever. So is forming the group: a regroup that fails with nobody lost is
tried at most ``max_retries + 1`` times in a row. And an evaluation whose shard failed on a
worker that is still up (a metric that raises on real batches, a shard that timed out) is
deterministic as far as the driver can tell: evaluations that fail so, in a row, are
allowed ``max_retries`` retries, whichever epochs they score. :class:`RetryBudget` counts
all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynabatch.actors.contracts import SegmentResult
from dynabatch.scheduler.core.sync.protocol import Position

# A worker whose failed step computed for more than this fraction of the collective
# timeout is why its peers timed out: they waited the rest in the all-reduce.
STRAGGLER_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class WorkerOutcome:
    """A worker's answer to a segment: a result, or why there is none."""

    worker: str
    result: SegmentResult | None = None
    lost: str | None = None  # "died: ..." or "hung ..." when there is no result

    @property
    def failed(self) -> bool:
        return self.result is None or self.result.error is not None


@dataclass(frozen=True, slots=True)
class Failure:
    lost: dict[str, str] = field(default_factory=dict)  # worker -> reason: remove
    stragglers: dict[str, str] = field(default_factory=dict)  # worker -> reason: evict
    compute: dict[str, str] = field(default_factory=dict)  # worker -> its own error
    peer_errors: tuple[str, ...] = ()
    # worker -> (its error, the micro-batch that did not fit its device's memory)
    oom: dict[str, tuple[str, int]] = field(default_factory=dict)
    user: dict[str, str] = field(default_factory=dict)  # worker -> its error (not retried)

    @property
    def summary(self) -> str:
        parts = [f"{w} {r}" for w, r in self.lost.items()]
        parts += [f"{w} straggler: {r}" for w, r in self.stragglers.items()]
        parts += [f"{w} raised {e}" for w, e in self.compute.items()]
        parts += [f"{w} raised {e}" for w, e in self.user.items()]
        parts += [f"{w} ran out of memory on a micro-batch of {b}: {e}"
                  for w, (e, b) in self.oom.items()]
        if not parts and self.peer_errors:
            parts.append(f"collective failed: {self.peer_errors[0]}")
        return "; ".join(parts) or "unknown failure"


def classify(outcomes: list[WorkerOutcome], collective_timeout_s: float) -> Failure | None:
    """None when every worker completed the segment."""
    if not any(o.failed for o in outcomes):
        return None
    lost = {o.worker: o.lost or "gave no answer" for o in outcomes if o.result is None}
    answered = [o.result for o in outcomes if o.result is not None and o.result.error]
    compute = {r.worker: r.error for r in answered if r.error_kind == "compute"}
    oom = {r.worker: (r.error, r.oom_batch or 0) for r in answered if r.error_kind == "oom"}
    user = {r.worker: r.error for r in answered if r.error_kind == "user"}
    peer = tuple(r.error for r in answered if r.error_kind not in ("compute", "oom", "user"))
    stragglers: dict[str, str] = {}
    if not lost and not compute and not oom and not user and answered:
        slow = max(answered, key=lambda r: r.failed_compute_s or 0.0)
        took = slow.failed_compute_s or 0.0
        if took > STRAGGLER_FRACTION * collective_timeout_s:
            stragglers[slow.worker] = (
                f"a step computed {took:.1f}s, beyond what collective_timeout_s="
                f"{collective_timeout_s:g} allows its peers to wait"
            )
    return Failure(lost=lost, stragglers=stragglers, compute=compute, peer_errors=peer,
                   oom=oom, user=user)


@dataclass
class MemoryCaps:
    """The largest micro-batch known to fit, per node and device: learned from
    out-of-memory failures, carried by every plan of a worker there
    (:attr:`SegmentPlan.micro_cap`). Keyed by the node and the worker's share of its GPUs
    (0 on the CPU), not by the worker: a replacement on the same node and device inherits
    the cap, and a worker elsewhere is not held to it."""

    caps: dict[tuple[str, float], int] = field(default_factory=dict)

    def ran_out(self, node: str, gpus: float, batch: int) -> int | None:
        """A worker on ``node`` with ``gpus`` ran out of memory on a micro-batch of
        ``batch``: its cap becomes half of it. The new cap, or None when ``batch`` is one
        sample (nothing smaller to try)."""
        if batch <= 1:
            return None
        cap = min(batch // 2, self.caps.get((node, gpus), batch))
        self.caps[(node, gpus)] = cap
        return cap

    def cap(self, node: str, gpus: float) -> int | None:
        return self.caps.get((node, gpus))


@dataclass
class RetryBudget:
    """Consecutive failures: of segments at one position, and of regroups; decides when to
    stop retrying."""

    max_retries: int
    position: Position | None = None
    compute_failures: int = 0
    unexplained: int = 0
    regroup_failures: int = 0
    evaluation_failures: int = 0

    @property
    def retrying(self) -> bool:
        """A segment failed since the last one that succeeded: the next runs as its retry
        (alone: nothing is sent ahead of it). It outlives the regroups and waits between."""
        return self.position is not None

    def succeeded(self) -> None:
        self.position, self.compute_failures, self.unexplained = None, 0, 0

    def failed(self, position: Position, failure: Failure) -> str | None:
        """Record a failure at ``position``; the reason to fail the job, or None to retry."""
        if position != self.position:
            self.position, self.compute_failures, self.unexplained = position, 0, 0
        where = f"epoch {position.epoch} step {position.step}"
        for worker, error in failure.user.items():
            return (f"worker {worker} failed at {where} with {error} (an error in the job's "
                    "data, model or configuration: not retried)")
        for worker, (error, batch) in failure.oom.items():
            if batch <= 1:
                return (f"worker {worker} ran out of memory at {where} on a micro-batch of "
                        f"one sample: one sample does not fit its device ({error})")
        if failure.compute:
            self.compute_failures += 1
            if self.compute_failures > self.max_retries:
                worker, error = next(iter(failure.compute.items()))
                return (f"worker {worker} failed at {where} with {error} "
                        f"({self.compute_failures} attempts; max_retries={self.max_retries})")
            return None
        if failure.lost or failure.stragglers:
            return None  # membership changes: the retry runs on a different group
        if failure.oom:
            return None  # a smaller memory cap: the retry computes smaller micro-batches
        self.unexplained += 1
        if self.unexplained > self.max_retries + 1:
            return f"step failed {self.unexplained} times at {where}: {failure.summary}"
        return None

    def regrouped(self) -> None:
        self.regroup_failures = 0

    def regroup_failed(self, lost_workers: bool, why: str) -> str | None:
        """Record a regroup that failed (``lost_workers``: it lost some, so the next one
        forms a different group and is always allowed); the reason to fail the job, or None
        to try again at the next boundary."""
        self.regroup_failures += 1
        if not lost_workers and self.regroup_failures > self.max_retries + 1:
            return f"the group could not be formed {self.regroup_failures} times in a row: {why}"
        return None

    def evaluated(self) -> None:
        """An evaluation scored every shard: the evaluations' failures start over."""
        self.evaluation_failures = 0

    def evaluation_failed(self, epoch: int, worker: str, shard: tuple[int, int],
                          error: str, *, user: bool = False) -> str | None:
        """Record an evaluation of ``epoch`` whose ``shard`` of the held-out set failed
        on ``worker`` (alive) with ``error``; the reason to fail the job, or None to go
        on (evaluating again when the weights are still there). A ``user`` error (one in
        the job's data, model or configuration) fails it at once, as in training."""
        self.evaluation_failures += 1
        lo, hi = shard
        where = f"evaluation of epoch {epoch} failed on {worker} (test samples [{lo}, {hi}))"
        if user:
            return (f"{where} with {error} (an error in the job's data, model or "
                    "configuration: not retried)")
        if self.evaluation_failures > self.max_retries:
            return (f"{where} with {error} ({self.evaluation_failures} attempts; "
                    f"max_retries={self.max_retries})")
        return None

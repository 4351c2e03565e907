"""What a failed segment means, and how often it may be retried. Pure: no ray, no clock.

:func:`classify` sorts a segment's failure: a worker *lost* or *hung* is removed and the step
retried over the others; a *straggler* (everyone answered, but one computed past what the
collective timeout lets its peers wait) is evicted and its node kept out, so the step does
not time out again and again; a worker's own error is retried up to ``max_retries`` times; a
*user error* (:class:`~dynabatch.actors.errors.UserError`, in the job's own data, model or
configuration) fails the job at once, as it would on every node; *out of memory* halves the
micro-batch cap of the worker's node and device (:class:`MemoryCaps`) and retries uncounted,
failing only when one sample does not fit. Unexplained failures, regroups that fail with
nobody lost and failed evaluations are bounded too (:class:`Attempts`), so nothing loops
forever. :class:`FailurePolicy` turns each :class:`FailureEvent` into exactly one decision:
retry, evict, roll back, or fail the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

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


# What a failure can be: a segment's (``counted``: not one sent ahead of a failed one,
# whose failure is the one already counted), a regroup's, an evaluation shard's on a live
# worker, the wait for the minimum of workers running out, every holder of the state lost
# (a checkpoint to roll back to, or not), the data that would not load, and the epoch's
# exactly-once check.
FailureKind = Literal["segment", "regroup", "evaluation", "no_workers", "state_lost", "data",
                      "exactly_once"]


@dataclass(frozen=True, slots=True)
class FailureEvent:
    """A failure as the driver saw it: where (a segment's ``position``, an evaluation's
    epoch), a segment's classified ``failure``, whose and what ``error``; ``lost``: a
    regroup lost workers; ``user``: the job's own error; ``checkpoint``: one to restore."""

    kind: FailureKind
    position: Position = field(default_factory=lambda: Position(0, 0))
    failure: Failure | None = None
    counted: bool = True
    worker: str | None = None
    error: str = ""
    shard: tuple[int, int] = (0, 0)
    lost: bool = False
    user: bool = False
    checkpoint: bool = False


@dataclass(frozen=True, slots=True)
class Retry:
    """Go on: the step, the regroup or the evaluation runs again (on a different group when
    workers were lost)."""


@dataclass(frozen=True, slots=True)
class Evict:
    """Take these workers out of the job (worker -> why), then retry without them."""

    workers: dict[str, str]


@dataclass(frozen=True, slots=True)
class RollBack:
    """No member holds the committed state: restore the checkpoint, then regroup."""

    reason: str


@dataclass(frozen=True, slots=True)
class Fail:
    """End the job FAILED with ``reason``."""

    reason: str


FailureDecision = Retry | Evict | RollBack | Fail


@dataclass(frozen=True, slots=True)
class Attempts:
    """Consecutive failures: of segments at one position (``position``: the retry's, None
    once a segment succeeded; it outlives the regroups and waits between), of regroups, and
    of evaluations. What the policy counts."""

    position: Position | None = None
    compute: int = 0
    unexplained: int = 0
    regroup: int = 0
    evaluation: int = 0

    def succeeded(self) -> Attempts:
        return replace(self, position=None, compute=0, unexplained=0)

    def regrouped(self) -> Attempts:
        return replace(self, regroup=0)

    def evaluated(self) -> Attempts:
        """An evaluation scored every shard: the evaluations' failures start over."""
        return replace(self, evaluation=0)


@dataclass(frozen=True, slots=True)
class FailurePolicy:
    """Every failure's one decision: retry, evict, roll back or fail. Pure: the attempts
    so far come in and go out (:meth:`decide`), as Ray Train's ``FailureDecision`` is made
    from the failure and its count against ``max_retries``."""

    max_retries: int

    def decide(self, attempts: Attempts, event: FailureEvent
               ) -> tuple[Attempts, FailureDecision]:
        match event.kind:
            case "segment":
                return self._segment(attempts, event)
            case "regroup":
                n = attempts.regroup + 1
                attempts = replace(attempts, regroup=n)
                # A regroup that lost workers forms a different group next time.
                if not event.lost and n > self.max_retries + 1:
                    return attempts, Fail(f"the group could not be formed {n} times in a "
                                          f"row: {event.error}")
                return attempts, Retry()
            case "evaluation":
                n = attempts.evaluation + 1
                attempts = replace(attempts, evaluation=n)
                lo, hi = event.shard
                where = (f"evaluation of epoch {event.position.epoch} failed on "
                         f"{event.worker} (test samples [{lo}, {hi}))")
                if event.user:
                    return attempts, Fail(f"{where} with {event.error} {_USER}")
                if n > self.max_retries:
                    return attempts, Fail(f"{where} with {event.error} ({n} attempts; "
                                          f"max_retries={self.max_retries})")
                return attempts, Retry()
            case "state_lost":
                at = event.position
                lost = ("every worker holding the current model state was lost "
                        f"(committed at epoch {at.epoch} step {at.step})")
                if event.error:
                    return attempts, Fail(f"{lost}, and the checkpoint cannot be loaded: "
                                          f"{event.error}")
                if not event.checkpoint:  # never from freshly initialised weights
                    return attempts, Fail(f"{lost}, and there is no checkpoint to restore "
                                          "(set checkpoint.dir); not continuing from freshly "
                                          "initialised weights")
                return attempts, RollBack(f"{lost}; rolling back")
            case _:  # no_workers, data, exactly_once: nothing to retry
                return attempts, Fail(event.error)

    def _segment(self, attempts: Attempts, event: FailureEvent
                 ) -> tuple[Attempts, FailureDecision]:
        f = event.failure or Failure()
        evict = Evict({w: f"straggler: {why}" for w, why in f.stragglers.items()})
        if not event.counted:  # the failure before it was counted, and decided
            return attempts, evict if f.stragglers else Retry()
        position = event.position
        if position != attempts.position:
            attempts = replace(attempts, position=position, compute=0, unexplained=0)
        where = f"epoch {position.epoch} step {position.step}"
        for worker, error in f.user.items():
            return attempts, Fail(f"worker {worker} failed at {where} with {error} {_USER}")
        for worker, (error, batch) in f.oom.items():
            if batch <= 1:
                return attempts, Fail(
                    f"worker {worker} ran out of memory at {where} on a micro-batch of "
                    f"one sample: one sample does not fit its device ({error})")
        if f.compute:
            n = attempts.compute + 1
            attempts = replace(attempts, compute=n)
            if n > self.max_retries:
                worker, error = next(iter(f.compute.items()))
                return attempts, Fail(f"worker {worker} failed at {where} with {error} "
                                      f"({n} attempts; max_retries={self.max_retries})")
            return attempts, Retry()
        if f.stragglers:
            return attempts, evict  # the retry runs without them
        if f.lost or f.oom:
            # A different group, or a smaller memory cap: the retry is not the same step.
            return attempts, Retry()
        n = attempts.unexplained + 1
        attempts = replace(attempts, unexplained=n)
        if n > self.max_retries + 1:
            return attempts, Fail(f"step failed {n} times at {where}: {f.summary}")
        return attempts, Retry()


_USER = "(an error in the job's data, model or configuration: not retried)"

"""Synchronous DBS: where the epoch stands and what each worker trains next.

Pure: numpy only, no ray, no torch, no clock.

Step ``s`` of an epoch always trains the order positions ``[s·B, s·B + B_s)``, cut into the
workers' shares by the allocation in force, so the global batches never depend on the
allocation or the membership. An allocation is in force from the step where it was adopted
(its *anchor*) to the epoch's end. A re-plan may be adopted ahead (``replan(at=s)``) while a
segment it cannot change is queued; the steps before ``s`` keep their allocation. At the
epoch's end the allocation in force is carried into the next epoch, so its first segment
can be planned ahead too (``plan_segment(at=Position(epoch + 1, s))``). The protocol
advances only by the steps the workers report complete (:meth:`SyncProtocol.advance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.scheduler.core.sync.allocation import (
    Allocation,
    Decision,
    Policy,
    WorkerTelemetry,
    make_allocation,
)

MAX_SEGMENT_STEPS = 8


@dataclass(frozen=True, slots=True)
class RebalanceRule:
    """When the allocation may change within an epoch (see ``RebalanceSpec``)."""

    mode: str = "epoch"  # epoch | steps | adaptive
    every_steps: int = 10
    check_steps: int = 2

    def due(self, step: int, steps_per_epoch: int) -> bool:
        """Whether the rule asks for a re-plan at the boundary before ``step``."""
        if self.mode == "epoch" or step >= steps_per_epoch:
            return False
        return step % self.every_steps == 0 if self.mode == "steps" else True


@dataclass(frozen=True, slots=True, order=True)
class Position:
    epoch: int
    step: int


class SyncProtocol:
    def __init__(
        self,
        *,
        global_batch: int,
        seed: int,
        dataset_size: int = 0,
        rule: RebalanceRule = RebalanceRule(),
        position: Position = Position(0, 0),
    ):
        """``dataset_size`` 0: the data is not loaded yet (:meth:`load`); until then the
        protocol only says where training (re)starts, and at what global batch."""
        if global_batch < 1:
            raise ValueError(f"global_batch must be at least 1, got {global_batch}")
        self.global_batch = global_batch
        self.dataset_size = 0
        self.seed = seed
        self.rule = rule
        self.epoch, self.step = position.epoch, position.step
        # The allocations of this epoch by the step from which each is in force (its
        # anchor), in step order: the first is in force now, a later one was adopted
        # ahead (``replan(at=)``).
        self._plans: list[tuple[int, Allocation]] = []
        # Adaptive mode: the step that first measures the last allocation that moved batches
        # (the one after its anchor: a first step at a new size is not a measurement). A
        # segment ends right after it, so the next check sees it a step sooner.
        self._measure_at: int | None = None
        if dataset_size:
            self.load(dataset_size)

    def load(self, dataset_size: int) -> None:
        """The data is loaded: an epoch is ``dataset_size`` samples."""
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be at least 1, got {dataset_size}")
        self.dataset_size = dataset_size
        self.step = min(self.step, self.steps_per_epoch)

    @property
    def loaded(self) -> bool:
        return self.dataset_size > 0

    # --- where the epoch stands ---------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        return -(-self.dataset_size // self.global_batch)

    @property
    def position(self) -> Position:
        return Position(self.epoch, self.step)

    @property
    def epoch_complete(self) -> bool:
        return self.step >= self.steps_per_epoch

    @property
    def allocation(self) -> Allocation | None:
        """The allocation in force at the current step (at the epoch's end: its last)."""
        got = self._in_force(min(self.step, self.steps_per_epoch - 1))
        return got[1] if got else None

    def _in_force(self, step: int) -> tuple[int, Allocation] | None:
        return next((x for x in reversed(self._plans) if x[0] <= step), None)

    def _prune(self) -> None:
        """Forget allocations no step from here on trains under (the epoch's last one is
        kept: it is what the epoch ended with)."""
        step = min(self.step, self.steps_per_epoch - 1)
        plans = self._plans
        first = max((i for i, (anchor, _) in enumerate(plans) if anchor <= step), default=0)
        if first:
            self._plans = plans[first:]  # a new list: readers in other threads see either

    def _left(self, step: int) -> int:
        """The samples from ``step`` to the epoch's end; at its end, the next epoch's."""
        if step < self.steps_per_epoch:
            return self.dataset_size - step * self.global_batch
        return self.dataset_size

    def _carried(self) -> Allocation | None:
        """The allocation in force at the epoch's end, re-cut over a whole epoch (the next
        epoch starts with it: a policy keeping it returns it as is)."""
        got = self._in_force(self.steps_per_epoch)
        return None if got is None else self._recut(got[1], self.steps_per_epoch)

    def _recut(self, a: Allocation, step: int) -> Allocation:
        """``a``'s batches over the samples from ``step`` on."""
        return make_allocation(a.workers, list(a.batches), self.global_batch, self._left(step))

    def step_size(self, step: int) -> int:
        return min(self.global_batch, self.dataset_size - step * self.global_batch)

    def next_epoch(self) -> None:
        if not self.epoch_complete:
            raise ValueError(f"epoch {self.epoch} is at step {self.step} of "
                             f"{self.steps_per_epoch}, not complete")
        carried = self._carried()
        self.epoch += 1
        self.step = 0
        self._measure_at = None
        # The allocation is kept: the next epoch's first re-plan sees it as the current one,
        # and a segment planned ahead across the boundary trained under it.
        self._plans = [(0, carried)] if carried is not None else []

    def resize(self, global_batch: int) -> None:
        """Train at ``global_batch`` from here: only before an epoch's first step (a stage
        boundary), so every epoch has one batch size and its steps stay well defined."""
        if global_batch < 1:
            raise ValueError(f"global_batch must be at least 1, got {global_batch}")
        if global_batch == self.global_batch:
            return
        if self.step != 0:
            raise ValueError(f"cannot change the global batch at step {self.step} of epoch "
                             f"{self.epoch}: only at an epoch's start")
        self.global_batch = global_batch
        self._plans = []  # the policy plans the new batch afresh

    def advance(self, steps: int) -> None:
        """``steps`` more steps were completed by the holder of the model state."""
        if steps < 0 or self.step + steps > self.steps_per_epoch:
            raise ValueError(f"cannot advance {steps} steps from step {self.step} of "
                             f"{self.steps_per_epoch}")
        self.step += steps
        self._prune()

    def rewind(self, position: Position, global_batch: int | None = None) -> None:
        """Go back to ``position`` (the model was restored from a checkpoint taken there),
        at the global batch trained there."""
        if global_batch is not None:
            if global_batch < 1:
                raise ValueError(f"global_batch must be at least 1, got {global_batch}")
            self.global_batch = global_batch
        self.epoch, self.step = position.epoch, position.step
        if self.loaded:
            self.step = min(self.step, self.steps_per_epoch)
        self._plans = []

    # --- allocation -------------------------------------------------------------------
    def replan(
        self,
        policy: Policy,
        telemetry: Sequence[WorkerTelemetry],
        at: int | None = None,
    ) -> Decision | None:
        """Ask ``policy`` for the rest of the epoch from step ``at`` (default: now) and adopt
        its allocation from there (``steps_per_epoch``: the next epoch's); the steps before
        keep theirs. None when the epoch is complete and no ``at`` was given."""
        spe = self.steps_per_epoch
        start = self.step if at is None else at
        if start < self.step or start > spe:
            raise ValueError(f"cannot re-plan from step {start}: the epoch is at {self.step} "
                             f"of {spe}")
        if at is None and start >= spe:
            return None
        current = self._in_force(start)
        decision = policy.decide(telemetry, self.global_batch, self._left(start),
                                 current[1] if current else None)
        # A kept allocation comes back re-cut over what is left, so adopting it always
        # re-anchors the plan at ``start`` without changing any batch.
        self._plans = [x for x in self._plans if x[0] < start] + [(start, decision.allocation)]
        self._prune()
        if decision.rebalanced and self.rule.mode == "adaptive" and start < spe:
            self._measure_at = start + 1
        return decision

    def defer(self, step: int, to: int) -> None:
        """The allocation adopted from ``step`` takes effect from ``to`` instead (its plan
        update was refused: a worker had started ``step``); the steps between keep the
        allocation they were sent with."""
        plans = self._plans
        i = next((j for j, (anchor, _) in enumerate(plans) if anchor == step), None)
        if i is None or to < step:
            raise ValueError(f"no allocation adopted from step {step} to defer to {to}")
        moved = self._recut(plans[i][1], to)
        self._plans = ([x for x in plans[:i] if x[0] < to] + [(to, moved)]
                       + [x for x in plans[i + 1:] if x[0] > to])
        if self._measure_at == step + 1:
            self._measure_at = to + 1

    def planned_remaining(self, worker: str) -> int:
        """Samples ``worker`` still has to train in this epoch under the allocations."""
        total = 0
        plans = self._plans
        for j, (anchor, a) in enumerate(plans):
            end = plans[j + 1][0] if j + 1 < len(plans) else self.steps_per_epoch
            first = max(anchor, self.step)
            if first >= end or worker not in a.workers:
                continue
            i = a.workers.index(worker)
            lo, hi = first - anchor, min(end - anchor, a.steps)
            full = max(0, min(hi, a.steps - 1) - lo)
            total += full * a.batches[i]
            if lo <= a.steps - 1 < hi:
                total += a.step_shares(a.steps - 1)[i]
        return total

    # --- segments ---------------------------------------------------------------------
    def segment_length(self, step: int | None = None) -> int:
        step = self.step if step is None else step
        left = self.steps_per_epoch - step
        rule = self.rule
        if rule.mode == "steps":
            # Land on multiples of K so "every K steps" means what it says.
            k = rule.every_steps - (step % rule.every_steps)
        elif rule.mode == "adaptive":
            k = rule.check_steps
        else:
            k = MAX_SEGMENT_STEPS
        return max(0, min(k, left, MAX_SEGMENT_STEPS))

    def plan_segment(self, at: int | Position | None = None, *, whole: bool = False
                     ) -> dict[str, SegmentPlan]:
        """Each worker's steps for the next segment (empty when the epoch is complete), or
        for one sent ahead from step ``at`` of this epoch or ``Position(epoch + 1, s)`` (under
        the allocation carried over). ``whole``: not cut after the step that measures a new
        allocation (a plan update must cover the rest of the segment in flight)."""
        epoch = self.epoch
        if isinstance(at, Position):
            if at.epoch == self.epoch:
                at = at.step
            elif at.epoch == self.epoch + 1:
                return self._plan(self.epoch + 1, at.step, 0, self._carried())
            else:
                raise ValueError(f"cannot plan epoch {at.epoch} from epoch {self.epoch}")
        first = self.step if at is None else at
        if first < self.step:
            raise ValueError(f"step {first} is behind the protocol's step {self.step}")
        got = self._in_force(first)
        if got is None:
            raise ValueError("no allocation: replan first")
        return self._plan(epoch, first, got[0], got[1], whole)

    def _plan(self, epoch: int, first: int, anchor: int, a: Allocation | None,
              whole: bool = False) -> dict[str, SegmentPlan]:
        if a is None:
            raise ValueError("no allocation: replan first")
        k = self.segment_length(first)
        # An allocation adopted ahead is in force from its anchor: a segment ends there.
        later = [x[0] for x in self._plans if x[0] > first] if epoch == self.epoch else []
        if later:
            k = min(k, later[0] - first)
        m = self._measure_at if epoch == self.epoch and not whole else None
        if m is not None and first <= m < first + k:
            k = m + 1 - first
        if k == 0:
            return {}
        local0 = first - anchor
        base = anchor * self.global_batch
        ranges = a.worker_ranges(local0, k)
        plans = {}
        for i, w in enumerate(a.workers):
            steps = []
            for j, (lo, hi) in enumerate(ranges[i]):
                s = first + j
                steps.append(StepPlan(step=s, start=s * self.global_batch,
                                      size=self.step_size(s), own_start=base + lo,
                                      own_size=hi - lo))
            # Plan updates reach a segment in flight (core/sync/update.py); epoch mode
            # re-plans only at the epoch's end.
            plans[w] = SegmentPlan(epoch, self.seed, self.dataset_size, tuple(steps),
                                   updates=self.rule.mode != "epoch")
        return plans

"""Synchronous DBS: where the epoch stands and what each worker trains next.

Pure: numpy only, no ray, no torch, no clock.

Step ``s`` of an epoch always trains the order positions ``[s·B, s·B + B_s)`` (the last
step may be partial), cut into the workers' shares by the current :class:`Allocation`, so
the sequence of global batches never depends on the allocation or the membership. An
allocation covers the epoch from the step where it was adopted (its *anchor*) to the end;
re-planning at a step boundary adopts a new one for the samples not trained yet.

The protocol advances only by what the workers report: :meth:`SyncProtocol.advance` takes
the number of steps that the state holder completed, and the epoch is complete exactly
when every step is (:attr:`epoch_complete`), whether the last segment succeeded or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from actors.contracts import SegmentPlan, StepPlan
from scheduler.policy import Allocation, Decision, Policy, WorkerTelemetry

MAX_SEGMENT_STEPS = 8


@dataclass(frozen=True, slots=True)
class RebalanceRule:
    """When the allocation may change within an epoch (see ``RebalanceSpec``)."""

    mode: str = "epoch"  # epoch | steps | adaptive
    every_steps: int = 10
    check_steps: int = 2


@dataclass(frozen=True, slots=True, order=True)
class Position:
    epoch: int
    step: int


class SyncProtocol:
    def __init__(
        self,
        *,
        global_batch: int,
        dataset_size: int,
        seed: int,
        rule: RebalanceRule = RebalanceRule(),
        position: Position = Position(0, 0),
    ):
        if global_batch < 1:
            raise ValueError(f"global_batch must be at least 1, got {global_batch}")
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be at least 1, got {dataset_size}")
        self.global_batch = global_batch
        self.dataset_size = dataset_size
        self.seed = seed
        self.rule = rule
        self.epoch = position.epoch
        self.step = min(position.step, self.steps_per_epoch)
        self.allocation: Allocation | None = None
        self._anchor = self.step  # epoch step where the allocation starts

    # --- where the epoch stands ---------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        return -(-self.dataset_size // self.global_batch)

    @property
    def position(self) -> Position:
        return Position(self.epoch, self.step)

    @property
    def remaining_samples(self) -> int:
        return max(0, self.dataset_size - self.step * self.global_batch)

    @property
    def epoch_complete(self) -> bool:
        return self.step >= self.steps_per_epoch

    def step_size(self, step: int) -> int:
        return min(self.global_batch, self.dataset_size - step * self.global_batch)

    def next_epoch(self) -> None:
        if not self.epoch_complete:
            raise ValueError(f"epoch {self.epoch} is at step {self.step} of "
                             f"{self.steps_per_epoch}, not complete")
        self.epoch += 1
        self.step = 0
        # The allocation is kept: the next epoch's first re-plan sees it as the current one
        # (DBS scales it, affine keeps it unless a better one gains enough).
        self._anchor = 0

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
        self.allocation = None  # the policy plans the new batch afresh
        self._anchor = 0

    def advance(self, steps: int) -> None:
        """``steps`` more steps were completed by the holder of the model state."""
        if steps < 0 or self.step + steps > self.steps_per_epoch:
            raise ValueError(f"cannot advance {steps} steps from step {self.step} of "
                             f"{self.steps_per_epoch}")
        self.step += steps

    def rewind(self, position: Position, global_batch: int | None = None) -> None:
        """Go back to ``position`` (the model was restored from a checkpoint taken there),
        at the global batch trained there."""
        if global_batch is not None:
            if global_batch < 1:
                raise ValueError(f"global_batch must be at least 1, got {global_batch}")
            self.global_batch = global_batch
        self.epoch, self.step = position.epoch, min(position.step, self.steps_per_epoch)
        self.allocation = None
        self._anchor = self.step

    # --- allocation -------------------------------------------------------------------
    def replan(
        self,
        policy: Policy,
        telemetry: Sequence[WorkerTelemetry],
    ) -> Decision | None:
        """Ask ``policy`` for the rest of the epoch and adopt its allocation. None when the
        epoch has nothing left to plan."""
        if self.epoch_complete:
            return None
        decision = policy.decide(
            telemetry, self.global_batch, self.remaining_samples, self.allocation
        )
        # A kept allocation comes back re-cut over what is left, so adopting it always
        # re-anchors the plan at this step without changing any batch.
        self.allocation = decision.allocation
        self._anchor = self.step
        return decision

    def planned_remaining(self, worker: str) -> int:
        """Samples ``worker`` still has to train in this epoch under the allocation."""
        a = self.allocation
        if a is None or worker not in a.workers:
            return 0
        i = a.index(worker)
        done = self.step - self._anchor
        full = min(done, a.steps - 1)
        used = full * a.batches[i] + (a.step_shares(a.steps - 1)[i] if done >= a.steps else 0)
        return a.partitions[i] - used

    def due_check(self, step: int | None = None) -> bool:
        """Whether the rule asks for a re-plan at this step boundary (or at ``step``)."""
        step = self.step if step is None else step
        mode = self.rule.mode
        if mode == "epoch" or step >= self.steps_per_epoch:
            return False
        if mode == "steps":
            return step % self.rule.every_steps == 0
        return True

    def next_boundary_keeps_plan(self, segment_steps: int) -> bool:
        """Whether the segment after the current one (of ``segment_steps`` steps) trains
        under the same allocation, so it can be sent to the workers before the current
        one's results are in: it lies in this epoch and the rule asks no re-plan between."""
        nxt = self.step + segment_steps
        return nxt < self.steps_per_epoch and not self.due_check(nxt)

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

    def plan_segment(self, at: int | None = None) -> dict[str, SegmentPlan]:
        """Each worker's steps for the next segment (empty when the epoch is complete), or
        for the segment starting at step ``at`` of this epoch under the same allocation
        (a segment sent ahead; see :meth:`next_boundary_keeps_plan`)."""
        a = self.allocation
        if a is None:
            raise ValueError("no allocation: replan first")
        first = self.step if at is None else at
        if first < self.step:
            raise ValueError(f"step {first} is behind the protocol's step {self.step}")
        k = self.segment_length(first)
        if k == 0:
            return {}
        local0 = first - self._anchor
        base = self._anchor * self.global_batch
        ranges = a.worker_ranges(local0, k)
        plans = {}
        for i, w in enumerate(a.workers):
            steps = []
            for j, (lo, hi) in enumerate(ranges[i]):
                s = first + j
                steps.append(StepPlan(step=s, start=s * self.global_batch,
                                      size=self.step_size(s), own_start=base + lo,
                                      own_size=hi - lo))
            plans[w] = SegmentPlan(self.epoch, self.seed, self.dataset_size, tuple(steps))
        return plans


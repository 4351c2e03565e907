"""What the simulator's runtime asks of the model its workers train: :class:`Replicas`, the
seam between :class:`~dynabatch.scheduler.sim.runtime.SimRuntime` and a gradient engine (the
real :class:`~dynabatch.scheduler.sim.gradients.GradientEngine`, or a test's). Each call names
the workers it is about, so an engine may keep one replica per worker, or one for all.
Pure: no ray, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dynabatch.actors.contracts import IsgdRule, StepPlan


@dataclass(frozen=True, slots=True)
class StepOutcome:
    losses: list[float]  # each share's summed loss
    psi: float = 0.0  # the global batch's mean loss before the step (ISGD judges it)
    flagged: bool = False
    extra_iters: int = 0
    local_sqnorms: list[float | None] | None = None
    global_sqnorm: float | None = None


class Replicas(Protocol):
    """The model replicas of a simulated job's workers, named by worker id."""

    @property
    def model_bytes(self) -> int:
        """The gradient's bytes (0: unknown); the all-reduce moves them."""

    def step(
        self,
        seed: int,
        epoch: int,
        dataset_size: int,
        shares: Sequence[StepPlan],
        rule: IsgdRule | None = None,
        caps: Sequence[int | None] | None = None,
        *,
        workers: Sequence[str] = (),
    ) -> StepOutcome:
        """One step from every share (one per member, in order, as the all-reduce sums
        them), applied by ``workers`` (each member when the step completed; fewer when it
        failed part-way). ``rule``: ISGD's for the step; ``caps``: each share's micro-batch
        cap."""

    def state(self, worker: str) -> dict[str, Any]:
        """``worker``'s model and optimizer state."""

    def load_state(self, state: dict[str, Any] | None, members: Sequence[str]) -> None:
        """A regroup: every member takes ``state``, or with None the first member's (rank
        0's broadcast)."""

    def eval_sums(self, worker: str, lo: int, hi: int, *, split: str = "test"
                  ) -> dict[str, float]:
        """``worker``'s weights scored on the held-out ``split``'s samples ``[lo, hi)``: the
        sums :meth:`finish` combines."""

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        """The scores from every shard's summed sums."""

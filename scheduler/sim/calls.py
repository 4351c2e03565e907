"""The simulated workers' call queue: segments and evaluations run in the order they were
sent, as each Ray actor runs its calls, and only when the driver needs their results, each
starting where the previous call ended (no bubble between segments, as on Ray). A segment
queued can still take a plan update (:meth:`CallQueue.queued_segment`). :class:`CallRecord`
is what the workers were asked over a run, for a report or a test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynabatch.actors.contracts import SegmentPlan
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.runtime.seam import ShardResult


@dataclass(eq=False)
class Call:
    """One call sent to the workers: a segment (``plans``) or an evaluation (``shards``);
    its answer (``outcomes`` or ``results``) once it ran. Also the call's ticket."""

    plans: dict[str, SegmentPlan] | None = None
    shards: dict[str, tuple[int, int]] | None = None
    split: str = "test"  # the held-out split an evaluation scores
    outcomes: list[WorkerOutcome] | None = None
    results: list[ShardResult] | None = None
    delivered: bool = False  # an evaluation's results were handed out (each once)

    @property
    def ran(self) -> bool:
        return self.outcomes is not None or self.results is not None


class CallQueue:
    """Calls sent and not yet run, oldest first. ``run(call, grace_s)`` runs one and fills
    in its answer."""

    def __init__(self, run: Callable[[Call, float], None]):
        self._run = run
        self.pending: list[Call] = []

    def send(self, call: Call) -> Call:
        self.pending.append(call)
        return call

    def run_through(self, call: Call | None, grace_s: float) -> None:
        """Run every call sent before ``call``, in order, then ``call`` (if not run yet);
        None: every call sent."""
        while self.pending and (call is None or call in self.pending):
            item = self.pending.pop(0)
            if not item.ran:
                self._run(item, grace_s)

    def segments_before(self, call: Call) -> bool:
        """Whether a segment that has not run is queued before ``call``."""
        for item in self.pending:
            if item is call:
                return False
            if item.plans is not None:
                return True
        return False

    def queued_segment(self, epoch: int, step: int) -> Call | None:
        """The segment queued (not run) that holds ``step`` of ``epoch``."""
        for item in self.pending:
            if item.plans is None:
                continue
            seg = next(iter(item.plans.values()))
            if seg.epoch == epoch and any(sp.step == step for sp in seg.steps):
                return item
        return None


@dataclass
class CallRecord:
    """What a simulated run asked of its workers, in order: how many calls of each kind
    ran, the segments trained (their plans only with ``keep_plans``: a long ``simulate`` of
    a large cluster would otherwise hold every segment's per-worker plans to the end), the
    plan updates asked for and applied, and the workers and spares started and stopped."""

    keep_plans: bool = False
    submitted: int = 0  # segments sent
    segments: int = 0  # segments run, those a broken group could not train included
    trained: int = 0  # segments trained (a broken group's refusals not counted)
    regroups: int = 0
    evaluations: int = 0  # evaluations run (each scores every shard sent)
    fetches: int = 0  # fetch_state calls (checkpoints, handovers)
    plans: list[dict[str, SegmentPlan]] = field(default_factory=list)  # kept ones, in order
    updates: list[Any] = field(default_factory=list)  # plan updates asked for, in order
    updates_applied: list[Any] = field(default_factory=list)  # those the workers took
    killed: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)  # spawns that took over a spare
    fresh: list[str] = field(default_factory=list)  # spawns that started a new process
    spares_started: list[str] = field(default_factory=list)  # node ids
    spares_stopped: list[str] = field(default_factory=list)

    def note_trained(self, plans: dict[str, SegmentPlan]) -> None:
        self.trained += 1
        if self.keep_plans:
            self.plans.append(plans)

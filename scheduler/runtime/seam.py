"""What the coordinator needs from the world it drives, and nothing more: a :class:`Runtime`,
Ray's (:mod:`~dynabatch.scheduler.runtime.ray_runtime`) or the simulator's, so the same pure
machines run under each. Every call is bounded: an implementation that cannot answer in time
reports the worker lost rather than blocking.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dynabatch.actors.contracts import SegmentPlan
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.core.membership import NodeInfo, Spawn


@dataclass(frozen=True, slots=True)
class DataInfo:
    name: str
    n_train: int
    n_test: int
    # What the model is built for: the trained model's manifest records them
    # (dynabatch.actors.export). Empty/0 from runtimes without a real model.
    input_shape: tuple[int, ...] = ()
    num_classes: int = 0
    # dataset.validation's split (0: none; the test set is then the one judged).
    n_validation: int = 0


@dataclass(frozen=True, slots=True)
class Started:
    """A spawned worker finished starting: ``error`` is None when it is up."""

    worker: str
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RegroupResult:
    """``lost``: members whose process died (remove them), with why. ``error``: the group did
    not form although nobody in it died (a peer's death broke the rendezvous): retry."""

    lost: dict[str, str]
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.lost and self.error is None


@dataclass(frozen=True, slots=True)
class ShardResult:
    """One worker's shard of an evaluation: the sums of its test samples (``{"n", "loss",
    <metric>: Σ}``, see ``Objective.eval_sums``) and the seconds the worker spent on them;
    or, without sums, why (``lost``: the worker is gone; ``user``: what it raised is an
    error in the job's data, model or configuration, ``dynabatch.actors.errors.UserError``,
    which fails the job at once, as in training)."""

    worker: str
    sums: dict[str, float] | None = None
    seconds: float = 0.0
    error: str | None = None
    lost: bool = False
    user: bool = False


@dataclass(frozen=True, slots=True)
class GroupReport:
    """What a job tells the cluster scheduler when its group changes (it formed, first or
    again): each joined member's node and speed (samples per compute-second, 0 when not
    measured yet), and the global batch in force. The scheduler's view shows these as the
    job's members at once, rather than at its next round's poll of the job."""

    job_id: str
    workers: tuple[tuple[str, float], ...]
    global_batch: float

    @classmethod
    def of(cls, job_id: str, snapshot: Any) -> GroupReport:
        """What a job's snapshot (:class:`~dynabatch.scheduler.telemetry.JobSnapshot`) says
        of its group: its joined workers' nodes and speeds, its global batch. The scheduler's
        poll reads a job so, and a job whose group changes between polls reports so."""
        return cls(job_id, tuple((w.node, float(w.throughput)) for w in snapshot.workers
                                 if w.joined), float(snapshot.global_batch or 1))


class GroupReports(Protocol):
    """Where a job's :class:`GroupReport` goes: the cluster scheduler actor on Ray
    (``dynabatch.scheduler.runtime.ray_runtime.RayGroupReports``); a list in the tests."""

    def report(self, report: GroupReport) -> None:
        """Send ``report`` without waiting for an answer; never raises (with no scheduler
        to tell, nothing happens)."""


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds (timeouts, durations)."""

    def time(self) -> float:
        """Wall-clock seconds since the epoch (timestamps in events and logs)."""

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class Runtime(Protocol):
    """Every runtime implements every call: the driver has one code path (segments sent
    ahead, plan updates, spares, evaluation in shards), so what a simulated job does is
    what a job on Ray does."""

    def load_data(self) -> DataInfo:
        """Load the job's dataset (raises ``WorkloadError`` naming the field)."""

    def nodes(self) -> list[NodeInfo]:
        """Alive nodes that can host one of this job's workers."""

    def spawn(self, spawn: Spawn) -> None:
        """Start a worker; :meth:`poll_started` reports when it is up (or failed). ``adopt``:
        the node's spare becomes the worker (a fresh one starts when that spare is gone)."""

    def poll_started(self, timeout_s: float) -> list[Started]:
        """Workers whose start finished, waiting up to ``timeout_s`` for the first one."""

    def kill(self, worker: str) -> None: ...

    # --- spares: pre-warmed workers on idle nodes, where
    # Membership.spare_plan says. They reserve nothing while they wait; each call returns
    # at once.
    def start_spare(self, node_id: str) -> None: ...

    def stop_spare(self, node_id: str) -> None: ...

    def lost_spares(self) -> list[tuple[str, str]]:
        """Spares that died or did not come up in time since the last call: (node, why)."""

    # --- segments: a worker runs its calls in order, so a segment submitted while another
    # runs starts on each worker as soon as it ends the last (no bubble between segments
    # while the driver reads the results).
    def submit_segment(self, plans: dict[str, SegmentPlan]) -> Any:
        """Send the plans; returns a ticket for :meth:`collect_segment`."""

    def collect_segment(self, ticket: Any, grace_s: float) -> list[WorkerOutcome]:
        """The outcomes of a submitted segment; a worker that has not answered ``grace_s``
        after the first failure is reported as hung."""

    def update_segment(self, update: Any, timeout_s: float) -> bool:
        """Post ``update`` (a ``PlanUpdate``) to the segment already sent that holds its step:
        True when every worker will apply it from ``update.at_step``, False when refused (a
        worker had started that step, or the group is not reached in ``timeout_s``)."""

    def regroup(
        self, generation: int, members: Sequence[str], state: dict[str, Any] | None,
        timeout_s: float,
    ) -> RegroupResult:
        """Form a new group (rank order as given) and broadcast rank 0's state, after
        loading ``state`` into it when given. A member whose join raised is not lost: it
        is alive and takes part in the next attempt."""

    def submit_evaluation(self, shards: dict[str, tuple[int, int]],
                          split: str = "test") -> Any:
        """Queue each worker's evaluation of the samples ``[lo, hi)`` of ``split`` behind the
        calls sent to it before (so it scores the weights they leave); a ticket for
        :meth:`poll_evaluation`."""

    def poll_evaluation(self, ticket: Any, timeout_s: float) -> list[ShardResult]:
        """The ticket's shards that finished since the last poll (each returned once),
        waiting up to ``timeout_s`` for the first of them."""

    def finish_evaluation(self, sums: dict[str, float]) -> dict[str, float]:
        """The job's scores from the shards' combined sums: ``{"loss": ..., <metric>:
        ...}`` (means, and each metric's finish), as one worker scoring the whole set."""

    def fetch_state(self, worker: str, timeout_s: float) -> dict[str, Any]:
        """``worker``'s model and optimizer state on the CPU; raises ``WorkerCallError``."""


class WorkerCallError(RuntimeError):
    """A call to one worker failed or timed out. ``lost``: the worker is gone."""

    def __init__(self, worker: str, message: str, lost: bool):
        super().__init__(f"{worker}: {message}")
        self.worker = worker
        self.lost = lost

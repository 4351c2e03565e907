"""What the coordinator needs from the world it drives, and nothing more.

The coordinator (``scheduler.coordinator``) owns the pure machines and turns their
decisions into calls on a :class:`Runtime`; the runtime turns those calls into actor calls
(``scheduler.ray_runtime``), into in-process fakes with injected faults (``tests.fakes``),
or into events on a virtual clock (a simulator). The same machine objects run under each.

Every call is bounded: the timeouts are arguments, and an implementation that cannot
answer in time reports the worker as lost rather than blocking.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from actors.contracts import SegmentPlan
from scheduler.failures import WorkerOutcome
from scheduler.membership import NodeInfo, Spawn


@dataclass(frozen=True, slots=True)
class DataInfo:
    name: str
    n_train: int
    n_test: int


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
    def load_data(self) -> DataInfo:
        """Load the job's dataset (raises ``WorkloadError`` naming the field)."""

    def nodes(self) -> list[NodeInfo]:
        """Alive nodes that can host one of this job's workers."""

    def spawn(self, spawn: Spawn) -> None:
        """Start a worker; :meth:`poll_started` reports when it is up (or failed)."""

    def poll_started(self, timeout_s: float) -> list[Started]:
        """Workers whose start finished, waiting up to ``timeout_s`` for the first one."""

    def kill(self, worker: str) -> None: ...

    def run_segment(self, plans: dict[str, SegmentPlan], grace_s: float) -> list[WorkerOutcome]:
        """Run the plans; a worker that has not answered ``grace_s`` after the first failure
        is reported as hung."""

    def regroup(
        self, generation: int, members: Sequence[str], state: dict[str, Any] | None,
        timeout_s: float,
    ) -> RegroupResult:
        """Form a new group (rank order as given) and broadcast rank 0's state, after
        loading ``state`` into it when given. A member whose join raised is not lost: it
        is alive and takes part in the next attempt."""

    def evaluate(self, worker: str, timeout_s: float) -> dict[str, float]:
        """``worker``'s model on the held-out set: ``{"loss": ..., <metric>: ...}`` (the
        job's metrics); raises ``WorkerCallError``."""

    def fetch_state(self, worker: str, timeout_s: float) -> dict[str, Any]:
        """``worker``'s model and optimizer state on the CPU; raises ``WorkerCallError``."""


class PipelinedRuntime(Runtime, Protocol):
    """A runtime that can queue a segment behind the one in flight (no bubble between
    segments: each worker starts the next as soon as it ends the last, while the
    coordinator reads the results). ``run_segment(p, g)`` is
    ``collect_segment(submit_segment(p), g)``."""

    def submit_segment(self, plans: dict[str, SegmentPlan]) -> Any:
        """Send the plans; returns a ticket for :meth:`collect_segment`."""

    def collect_segment(self, ticket: Any, grace_s: float) -> list[WorkerOutcome]:
        """The outcomes of a submitted segment, as :meth:`Runtime.run_segment`."""


def pipelined(runtime: Runtime) -> PipelinedRuntime | None:
    """``runtime`` when it can send segments ahead, else None."""
    ok = callable(getattr(runtime, "submit_segment", None)) and callable(
        getattr(runtime, "collect_segment", None))
    return runtime if ok else None  # type: ignore[return-value]


class WorkerCallError(RuntimeError):
    """A call to one worker failed or timed out. ``lost``: the worker is gone."""

    def __init__(self, worker: str, message: str, lost: bool):
        super().__init__(f"{worker}: {message}")
        self.worker = worker
        self.lost = lost

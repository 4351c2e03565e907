"""The events the parameter-server driver feeds its engine
(:class:`~dynabatch.scheduler.core.ps.engine.PSEngine`) and the commands it gets back, as
frozen values. Times are the driver's clock, passed in: the engine reads no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dynabatch.scheduler.core.membership import NodeAssignment

# --- events -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DataLoaded:
    """The job's dataset (``data``) is loaded; ``problem``: why the parameter server cannot
    train it (one line naming the field), or None."""

    problem: str | None = None
    data: Any = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class NodesListed:
    """The answer to :class:`ListNodes`: the alive nodes that can host a learner, in a stable
    order, at ``now``; ``assignment``: the node assignment in force, if any."""

    nodes: tuple[str, ...]
    now: float
    assignment: NodeAssignment | None = None


@dataclass(frozen=True, slots=True)
class ScaleRequested:
    """Run exactly ``workers`` learners (answered with :class:`ListNodes` first: new
    learners go round the nodes alive now)."""

    workers: int


@dataclass(frozen=True, slots=True)
class DrainRequested:
    """Learner ``worker`` leaves."""

    worker: str


@dataclass(frozen=True, slots=True)
class AssignRequested:
    """Learners on exactly these nodes' slots (the cluster scheduler's placement)."""

    nodes: NodeAssignment
    now: float


@dataclass(frozen=True, slots=True)
class LearnerEnded:
    """Learner ``worker``'s run ended (as the runtime reports it): normally (``error`` None),
    because its process or node died (``lost``: it leaves, no regroup), or because its own
    code raised (not ``lost``: every learner would, the job fails)."""

    worker: str
    error: str | None = None
    lost: bool = True


@dataclass(frozen=True, slots=True)
class NodeAdded:
    """A node was added for the job (the simulator's cluster joins); ``assigned``: the job
    trains on assigned nodes only."""

    node: str
    assigned: bool
    now: float


@dataclass(frozen=True, slots=True)
class EpochSeen:
    """One epoch the server finished: its number, when (the server's clock, ``t``), and
    whether the ledger verified it was trained exactly once (else ``problems``); ``record``:
    the server's own record of it, as it reported it."""

    epoch: int
    t: float
    verified: bool = True
    problems: tuple[str, ...] = ()
    record: Mapping[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True, slots=True)
class Polled:
    """The server's snapshot at ``now``, read once per step after the learners' exits:
    ``started_s`` (the start barrier, the first epoch's start, or None), every epoch it
    finished so far (in order), whether the job is ``finished``, and the samples each
    learner has had applied (``applied``: worker, samples). ``cancel``: the cancellation's
    reason, when one is pending."""

    now: float
    started_s: float | None = None
    epochs: tuple[EpochSeen, ...] = ()
    finished: bool = False
    applied: tuple[tuple[str, float], ...] = ()
    cancel: str | None = None


@dataclass(frozen=True, slots=True)
class DriverFailed:
    """Carrying out a command failed: the data or model cannot be used (the error's own
    message), or an internal error; the job fails with ``reason``."""

    reason: str


Event = (
    DataLoaded
    | NodesListed
    | ScaleRequested
    | DrainRequested
    | AssignRequested
    | LearnerEnded
    | NodeAdded
    | Polled
    | DriverFailed
)

# --- commands ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartServer:
    """Build the core (from the dataset ``data``) and start the server; its requests wait
    until ``learners`` have asked (the start barrier)."""

    learners: int
    data: Any = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class ListNodes:
    """List the nodes that can host a learner; answered with :class:`NodesListed`. Always
    the last command of its batch."""


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds`` on the driver's clock (no node yet)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class SpawnLearner:
    """Join learner ``worker`` (``ordinal``: its number, unique in the job) to the core and
    start it on ``node``."""

    worker: str
    ordinal: int
    node: str


@dataclass(frozen=True, slots=True)
class Kill:
    """Stop ``worker``'s process (it still has to :class:`Leave`)."""

    worker: str


@dataclass(frozen=True, slots=True)
class Leave:
    """``worker`` is gone: the core re-queues its in-flight samples (no regroup)."""

    worker: str


@dataclass(frozen=True, slots=True)
class Note:
    """Record a membership event (``kind``: join, leave or failure) in the job's events and
    log."""

    kind: str
    worker: str
    node: str
    reason: str


@dataclass(frozen=True, slots=True)
class Log:
    """A line in the job's log."""

    level: str
    message: str


@dataclass(frozen=True, slots=True)
class RecordEpoch:
    """Record the server's ``epoch`` (the history, tracking and the log), timed ``wall_s``
    from the epoch before (or the start)."""

    epoch: EpochSeen
    wall_s: float


@dataclass(frozen=True, slots=True)
class ExportModel:
    """Hand out the server's weights as the trained model (``reason``: end or cancel)."""

    reason: str


Command = (
    StartServer
    | ListNodes
    | Sleep
    | SpawnLearner
    | Kill
    | Leave
    | Note
    | Log
    | RecordEpoch
    | ExportModel
)

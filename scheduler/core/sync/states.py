"""Where the synchronous step loop stands: the states of
:class:`~dynabatch.scheduler.core.sync.engine.SyncEngine`, the loop's one vocabulary (what
the job is doing is its engine's state; its public
:class:`~dynabatch.scheduler.core.lifecycle.JobState` says only PENDING, RUNNING or how it
ended). Between boundaries the engine is :class:`AtRest`, or :class:`Waiting` for workers;
inside one, each state says which command's outcome (an event of ``messages``) the engine
waits for and carries what that outcome is judged by; the engine dispatches on them.
Frozen values, no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AtRest:
    """Between boundaries."""


@dataclass(frozen=True, slots=True)
class Waiting:
    """Between boundaries, with fewer workers than the job's minimum (``shortfall`` says
    which, and why) since ``since`` (the driver's clock): the next boundary looks again, and
    the job fails once the wait is over its limit. A boundary that does not wait again ends
    the wait (a later one starts over)."""

    since: float
    shortfall: str


@dataclass(frozen=True, slots=True)
class Watching:
    """A segment is in flight: waiting for started workers to be noticed and nodes
    listed (membership changes wait for the next boundary with nothing in flight)."""


@dataclass(frozen=True, slots=True)
class Requesting:
    """Nothing in flight: waiting for the requests to be taken into the membership (then
    what they drain leaves, the evaluations settled first). ``waiting``: the wait for
    workers this boundary began in (its reconcile states carry it on; None: none)."""

    waiting: Waiting | None = None


@dataclass(frozen=True, slots=True)
class Gathering:
    """Nothing in flight: waiting for the drains and for started workers to be taken in
    (then nodes are listed when due)."""

    waiting: Waiting | None = None


@dataclass(frozen=True, slots=True)
class Placing:
    """Waiting for workers to be started on the nodes listed."""

    waiting: Waiting | None = None


@dataclass(frozen=True, slots=True)
class GivingUp:
    """The first start's wait is over (the start timeout, or a cancel): waiting for the
    workers still starting to be given up."""

    waiting: Waiting | None = None


@dataclass(frozen=True, slots=True)
class AwaitingStarts:
    """The first start: waiting for its workers to come up, a little at a time, up to the
    start timeout. ``adopted``: the last command took in the workers that came up (once
    none is left starting, the ones that failed are started again); ``first``: the wait has
    not begun (its clock starts at its first wait)."""

    adopted: bool
    first: bool
    waiting: Waiting | None = None


@dataclass(frozen=True, slots=True)
class RollingBack:
    """Waiting for the last checkpoint to be loaded (or the job to fail) before the regroup:
    no member holds the committed state."""


@dataclass(frozen=True, slots=True)
class Regrouping:
    """Waiting for the next generation to form (:class:`Regrouped`: ``formed`` decides)."""


@dataclass(frozen=True, slots=True)
class Resplitting:
    """The group formed mid-epoch: waiting for the rest of the epoch to be re-planned over
    it."""


@dataclass(frozen=True, slots=True)
class Opening:
    """Waiting for the epoch to open and be planned (the segment is sent from what that
    leaves: its global batch decides whether the next epoch's first may go ahead)."""


@dataclass(frozen=True, slots=True)
class Checking:
    """Waiting for the re-plan of the rebalance rule's check after a segment."""


@dataclass(frozen=True, slots=True)
class Posting:
    """Waiting for a re-plan offered inside the segment in flight to be posted to its
    workers (a plan update). ``opening``: it was the epoch's opening plan, and the epoch's
    segment follows."""

    opening: bool


@dataclass(frozen=True, slots=True)
class Training:
    """Waiting for the segment (:class:`SegmentDone`: ``all_ran`` and the epoch's completion
    decide what follows)."""


@dataclass(frozen=True, slots=True)
class EndingToAbsorb:
    """A failed segment completed the epoch, and the next epoch's first was sent ahead of
    it: waiting for the epoch to end, before that one is absorbed in the next."""


@dataclass(frozen=True, slots=True)
class Absorbing:
    """After a failed segment: waiting for the one sent ahead of it to be collected (what
    it trained committed, the rest discarded)."""


@dataclass(frozen=True, slots=True)
class Ending:
    """Waiting for the epoch a segment completed to end (the job may be trained now)."""


@dataclass(frozen=True, slots=True)
class Judging:
    """The epoch ended and its evaluation was awaited: waiting for its judgement (best so
    far; early stopping), which decides the checkpoints written before the next epoch.
    ``then``: where the epoch's end returns; ``due``: the epoch's checkpoint is due anyway;
    ``keeps``: the job keeps checkpoints (early stopping's is written only then)."""

    then: Ending | EndingToAbsorb | CancelEndingEpoch
    due: bool
    keeps: bool


@dataclass(frozen=True, slots=True)
class Finishing:
    """Every epoch is trained: waiting for the last evaluations. ``cancelling``: a
    cancellation's last segment completed the last epoch, so the job succeeds."""

    cancelling: bool


@dataclass(frozen=True, slots=True)
class CancelCommitting:
    """Cancelling: waiting for the segment in flight to be committed."""


@dataclass(frozen=True, slots=True)
class CancelEndingEpoch:
    """Cancelling: the committed segment completed the epoch, which is ending (the job may
    have succeeded in it)."""


@dataclass(frozen=True, slots=True)
class CancelSettling:
    """Cancelling: waiting for the evaluations (they decide whether anything was trained
    that the model would hold)."""


LoopState = (
    AtRest
    | Waiting
    | Watching
    | Requesting
    | Gathering
    | Placing
    | GivingUp
    | AwaitingStarts
    | RollingBack
    | Regrouping
    | Resplitting
    | Opening
    | Checking
    | Posting
    | Training
    | EndingToAbsorb
    | Absorbing
    | Ending
    | Judging
    | Finishing
    | CancelCommitting
    | CancelEndingEpoch
    | CancelSettling
)

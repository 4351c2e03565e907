"""The segment pipeline's decisions: what may be sent ahead, and whose time a segment took.

Pure (no clock: the driver passes its readings in). The driver
(``dynabatch.scheduler.sync.pipeline``) sends the next segment before the current one's
results are read, so workers go from segment to segment without waiting for it. Whether it
may (:func:`can_send_ahead`, :func:`can_cross_epoch`), where that segment starts
(:func:`plan_ahead`, :func:`ahead_end`), and how a segment's wall time is split between the
epoch's training and the evaluation that ran on its workers first (:func:`attribute_wall`)
are decided here.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.scheduler.core.sync.protocol import Position


def can_send_ahead(*, cancel_requested: bool, retrying: bool, requests_pending: bool,
                   regroup_due: bool, stamps_fixed: bool) -> bool:
    """Whether the segment after the one just sent may be sent before its results are read.

    Not when the next boundary needs the group at rest: a cancellation, a scale or drain
    request, a regroup (a worker joined or was lost), or the retry after a failure
    (``retrying``: it runs alone, so a second failure costs one segment, not two). Not
    either when the next segment's stamps depend on this one's losses (``stamps_fixed``
    false: ISGD's chart)."""
    return (not cancel_requested and not retrying and not requests_pending
            and not regroup_due and stamps_fixed)


def can_cross_epoch(*, next_epoch: int, epochs: int, goodput: bool, next_batch: int,
                    batch: int, checkpoint_due: bool, replans_at_end: bool) -> bool:
    """Whether the next epoch's first segment can be sent before this epoch ends: there is
    a next epoch, it trains at the same global batch under the allocation carried over
    (the epoch's evaluation is queued in front of it), and no checkpoint (which reads the
    state with nothing in flight) is due in between. Goodput mode decides the next batch
    and its LR gain from the epoch's end, so it never does. Nor when the epoch's end
    re-plans (``replans_at_end``: ``rebalance: epoch`` under a speed-driven policy): a
    segment sent ahead keeps the carried allocation and takes no plan update, so the
    decision would wait a whole epoch; one round trip at the boundary costs less."""
    return (next_epoch < epochs and not goodput and next_batch == batch
            and not checkpoint_due and not replans_at_end)


@dataclass(frozen=True, slots=True)
class AheadPlan:
    """Where the segment after one starting at ``start`` of ``length`` steps begins."""

    position: Position
    crosses_epoch: bool  # the next epoch's first segment (after the epoch's evaluation)


def plan_ahead(start: Position, length: int, steps_per_epoch: int) -> AheadPlan:
    """The segment after the one at ``start``: in the same epoch, or the next epoch's first
    when this one ends the epoch (the driver sends that only if :func:`can_cross_epoch`)."""
    end = start.step + length
    if end < steps_per_epoch:
        return AheadPlan(Position(start.epoch, end), crosses_epoch=False)
    return AheadPlan(Position(start.epoch + 1, 0), crosses_epoch=True)


def ahead_end(ahead: Position | None, length: int, epoch: int) -> int | None:
    """The step after a segment in flight at ``ahead`` of ``length`` steps, when it lies in
    ``epoch``: a re-plan then takes effect there (the segment keeps its allocation)."""
    if ahead is None or ahead.epoch != epoch:
        return None
    return ahead.step + length


@dataclass(frozen=True, slots=True)
class WallShare:
    """A collected segment's wall time, attributed.

    ``evaluation``: the part the evaluation queued in front of it took (the previous
    epoch's, charged to this epoch's breakdown, not to its training); ``wall`` and
    ``worker_seconds``: what the epoch's training is charged, in proportion to the steps
    that completed; ``collected``: the reading the next segment's time starts from at
    the latest."""

    evaluation: float
    wall: float
    worker_seconds: float
    collected: float


def attribute_wall(*, sent: float, last_collected: float, now: float,
                   evaluation_s: float | None, done: int, planned: int,
                   workers: int, busy: float = 0.0) -> WallShare:
    """Attribute the time from a segment's start to ``now``, when its results are in.

    A segment sent ahead starts on the workers when the one before it ends, so it is timed
    from the later of its sending and the previous collection. ``evaluation_s``: the
    critical-path time of an evaluation its workers ran first, when it is done (None
    otherwise); it is taken out, at most what the segment's own training leaves of the
    time: ``busy`` is the longest a worker spent in the completed steps, by its clock. (A
    coordinator that collected the segment before late finds the evaluation run already,
    inside the time it charged that segment; taking it out again left an epoch of one
    short segment 0 s and utilization 0.) What is left is charged for the ``done`` of
    ``planned`` steps that completed, on each of ``workers`` workers."""
    wall = now - max(sent, last_collected)
    evaluation = 0.0
    if evaluation_s is not None:
        evaluation = min(max(0.0, wall - busy), evaluation_s)
        wall -= evaluation
    if not done:
        return WallShare(evaluation, 0.0, 0.0, now)
    frac = done / planned
    # Spelled as the coordinator always summed it, so the totals do not move by a rounding.
    return WallShare(evaluation, wall * frac, wall * frac * workers, now)

"""The segment pipeline's decisions: what may be sent ahead, and whose time a segment took.

Pure (no clock: the driver passes its readings in). The driver
(``dynabatch.scheduler.sync.pipeline``) sends the next segment before the current one's
results are read, so workers go from segment to segment without waiting for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.scheduler.core.sync.protocol import Position


def can_send_ahead(*, cancel_requested: bool, retrying: bool, requests_pending: bool,
                   regroup_due: bool, stamps_fixed: bool) -> bool:
    """Whether the segment after the one just sent may be sent before its results are read:
    not when the next boundary needs the group at rest (a cancellation, a scale or drain
    request, a regroup, the retry after a failure, which runs alone so a second failure
    costs one segment), nor when its stamps depend on this one's losses (ISGD's chart)."""
    return (not cancel_requested and not retrying and not requests_pending
            and not regroup_due and stamps_fixed)


def can_cross_epoch(*, next_epoch: int, epochs: int, goodput: bool, next_batch: int,
                    batch: int, checkpoint_due: bool, replans_at_end: bool) -> bool:
    """Whether the next epoch's first segment can be sent before this epoch ends: there is
    a next epoch at the same global batch, no checkpoint (which needs nothing in flight) is
    due, not in goodput mode (it decides the next batch from the epoch's end), and the
    epoch's end does not re-plan (``replans_at_end``: a segment sent ahead keeps the
    carried allocation, so the decision would wait a whole epoch)."""
    return (next_epoch < epochs and not goodput and next_batch == batch
            and not checkpoint_due and not replans_at_end)


def plan_ahead(start: Position, length: int, steps_per_epoch: int) -> Position:
    """Where the segment after the one at ``start`` of ``length`` steps begins: in the same
    epoch, or at the next epoch's first step when this one ends the epoch (the driver sends
    that only if :func:`can_cross_epoch`, behind the epoch's evaluation)."""
    end = start.step + length
    return Position(start.epoch, end) if end < steps_per_epoch else Position(start.epoch + 1, 0)


def ahead_end(ahead: Position | None, length: int, epoch: int) -> int | None:
    """The step after a segment in flight at ``ahead`` of ``length`` steps, when it lies in
    ``epoch``: a re-plan then takes effect there (the segment keeps its allocation)."""
    if ahead is None or ahead.epoch != epoch:
        return None
    return ahead.step + length


@dataclass(frozen=True, slots=True)
class WallShare:
    """A collected segment's wall time: ``evaluation`` (the previous epoch's, queued in
    front of it), ``wall`` and ``worker_seconds`` (the training's, for the steps that
    completed)."""

    evaluation: float
    wall: float
    worker_seconds: float


def attribute_wall(*, sent: float, last_collected: float, now: float,
                   evaluation_s: float | None, done: int, planned: int,
                   workers: int, busy: float = 0.0) -> WallShare:
    """Attribute the time from a segment's start (the later of its sending and the previous
    collection) to ``now``, when its results are in. ``evaluation_s``: the critical-path
    time of an evaluation its workers ran first (None: not done), taken out up to what
    the training leaves (``busy``: the longest a worker spent in the completed steps; an
    evaluation already charged to the segment before is not taken out twice). The rest is
    charged for the ``done`` of ``planned`` steps, on each of ``workers`` workers."""
    wall = now - max(sent, last_collected)
    evaluation = 0.0
    if evaluation_s is not None:
        evaluation = min(max(0.0, wall - busy), evaluation_s)
        wall -= evaluation
    if not done:
        return WallShare(evaluation, 0.0, 0.0)
    frac = done / planned
    # Spelled as the coordinator always summed it, so the totals do not move by a rounding.
    return WallShare(evaluation, wall * frac, wall * frac * workers)

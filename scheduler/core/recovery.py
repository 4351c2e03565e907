"""What to do when a live job's coordinator is lost: resume it from its checkpoint, or fail
it, with the reason either way. Pure: the service's reconciler gathers the facts
(:class:`LostCoordinator`) and carries out :func:`decide_lost`'s decision.

A job is resumed only from a checkpoint that exists, under a spec the settings still allow,
while ``auto_resume_limit`` > 0 and it has not been resumed automatically that many times in
a row without finishing an epoch: one that makes progress is resumed each time, one that
crash-loops ends FAILED.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from dynabatch.scheduler.core.lifecycle import JobState


class Action(StrEnum):
    RESUME = "resume"  # a new coordinator from the checkpoint; the job becomes PENDING
    FAIL = "fail"  # the job becomes FAILED with the reason
    NONE = "none"  # the job already finished: nothing to do


@dataclass(frozen=True, slots=True)
class LostCoordinator:
    """The facts about one job whose coordinator is gone."""

    state: JobState
    why: str
    """Why the coordinator is gone (the start of every reason given)."""
    checkpoint: bool
    """Whether the job's checkpoint file exists."""
    auto_resumes: int
    """Automatic resumes since the job last finished an epoch (or was resumed on request):
    the store counts them and sets the count back to 0 when an epoch is recorded, so this is
    both the resumes so far and whether the job made progress since the last one."""
    auto_resume_limit: int
    """The service's bound on automatic resumes in a row (0: automatic resume is off)."""
    not_allowed: str | None = None
    """Why the settings no longer allow the job's stored spec to be launched, or None."""


@dataclass(frozen=True, slots=True)
class RecoveryDecision:
    """The decision: what to do and the reason the job records."""

    action: Action
    reason: str


def decide_lost(lost: LostCoordinator) -> RecoveryDecision:
    """Resume ``lost``'s job from its checkpoint or fail it (see the module's policy)."""
    why = lost.why
    if lost.state.is_terminal:
        return RecoveryDecision(Action.NONE, f"job is already {lost.state.value}")
    if not lost.checkpoint:
        return RecoveryDecision(Action.FAIL, why)
    if lost.not_allowed:
        return RecoveryDecision(Action.FAIL, f"{why}; not resumed: {lost.not_allowed}")
    limit = lost.auto_resume_limit
    if limit <= 0:
        return RecoveryDecision(
            Action.FAIL, f"{why}; automatic resume is off: it can be resumed from its checkpoint"
        )
    if lost.auto_resumes >= limit:
        return RecoveryDecision(
            Action.FAIL,
            f"{why}; not resumed again: {lost.auto_resumes} automatic resumes without "
            f"finishing an epoch (limit {limit})",
        )
    attempt = lost.auto_resumes + 1
    return RecoveryDecision(
        Action.RESUME,
        f"{why}; resuming from its checkpoint (automatic resume {attempt} of {limit})",
    )

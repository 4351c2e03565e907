"""The lost-coordinator decision (scheduler/core/recovery.py), over every combination of
its inputs: resume only from an existing checkpoint, under an allowed spec, while automatic
resume is on and the job has not crash-looped to the limit; otherwise fail, saying which."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.recovery import Action, LostCoordinator, RecoveryDecision, decide_lost

WHY = "the job's coordinator actor died: boom"
CASES = list(
    itertools.product(
        list(JobState), [False, True], range(0, 6), range(-1, 5), [None, "spec not allowed"]
    )
)


def test_every_case() -> None:
    for case in CASES:
        _check(*case)


def _check(
    state: JobState, checkpoint: bool, auto_resumes: int, limit: int, refused: str | None
) -> None:
    lost = LostCoordinator(
        state=state,
        why=WHY,
        checkpoint=checkpoint,
        auto_resumes=auto_resumes,
        auto_resume_limit=limit,
        not_allowed=refused,
    )
    got = decide_lost(lost)
    assert decide_lost(lost) == got  # the same facts, the same decision
    if state.is_terminal:
        assert got.action is Action.NONE
        return
    resumes = checkpoint and refused is None and limit > 0 and auto_resumes < limit
    assert got.action is (Action.RESUME if resumes else Action.FAIL)
    assert got.reason.startswith(WHY)
    if resumes:
        assert auto_resumes + 1 <= limit
        assert f"automatic resume {auto_resumes + 1} of {limit}" in got.reason
        return
    if not checkpoint:
        assert got.reason == WHY
    elif refused:
        assert got.reason == f"{WHY}; not resumed: {refused}"
    elif limit <= 0:
        assert "automatic resume is off" in got.reason
    else:
        assert f"{auto_resumes} automatic resumes without finishing an epoch" in got.reason


def test_inputs_and_decision_are_frozen() -> None:
    lost = LostCoordinator(JobState.RUNNING, WHY, True, 0, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lost.checkpoint = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        decide_lost(lost).action = Action.FAIL  # type: ignore[misc]
    assert decide_lost(lost) == RecoveryDecision(
        Action.RESUME, f"{WHY}; resuming from its checkpoint (automatic resume 1 of 3)"
    )

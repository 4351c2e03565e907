"""The job lifecycle: an explicit enum with terminal flags and enforced transitions."""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

    def can_become(self, new: JobState) -> bool:
        return new in _TRANSITIONS[self]

    @property
    def can_resume(self) -> bool:
        """Whether a job in this state may start again from its checkpoint under a new
        coordinator (which starts PENDING): a FAILED or CANCELLED one (its checkpoint
        holds where it stopped) and a live one whose coordinator is gone; never one that
        SUCCEEDED (nothing is left to train)."""
        return self is not JobState.SUCCEEDED


_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # RUNNING -> PENDING happens when membership falls below min_workers and the job
    # waits for nodes.
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {JobState.PENDING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class InvalidTransition(ValueError):
    def __init__(self, old: JobState, new: JobState):
        super().__init__(f"job is {old.value}; it cannot become {new.value}")
        self.old, self.new = old, new

    def __reduce__(self):  # so it crosses Ray process boundaries intact
        return (InvalidTransition, (self.old, self.new))

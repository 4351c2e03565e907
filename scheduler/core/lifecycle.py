"""The job lifecycle: an explicit enum with terminal flags and enforced transitions.

Three kinds of move, each a rule here that the job store enforces on every write:
:meth:`JobState.can_become` (one step, asked for by the service: a cancel, a failure),
a coordinator's sampled snapshot (a live job may be seen in any state, since every state is
reachable from every live one; a finished one never moves) and :meth:`JobState.resumed` (a new
coordinator from the checkpoint: the one way out of FAILED or CANCELLED, back to PENDING).
"""

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

    def resumed(self) -> JobState:
        """The state a resume from the checkpoint leads to (PENDING, under a new
        coordinator); raises :class:`InvalidTransition` when this state cannot be resumed
        (:attr:`can_resume`)."""
        if not self.can_resume:
            raise InvalidTransition(self, JobState.PENDING)
        return JobState.PENDING


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


class InvalidEvent(RuntimeError):
    """An event an engine (the step loop's, the parameter server's) cannot take in its
    state: a bug in its executor."""


class InvalidTransition(ValueError):
    def __init__(self, old: JobState, new: JobState):
        super().__init__(f"job is {old.value}; it cannot become {new.value}")
        self.old, self.new = old, new

    def __reduce__(self):  # so it crosses Ray process boundaries intact
        return (InvalidTransition, (self.old, self.new))

"""The service's errors: what a Ray call, a lookup or a request can fail with.

The API maps each to its status (``dynabatch.api.app``): :class:`ClusterUnavailable` 503,
:class:`RayCallError` 502, :class:`JobNotFound` and :class:`WorkerNotFound` 404,
:class:`JobConflict` 409, :class:`InvalidRequest` 422.
"""

from __future__ import annotations

from dynabatch.scheduler.core.lifecycle import JobState


class RayCallError(RuntimeError):
    """A Ray call failed."""


class ClusterUnavailable(RayCallError):
    """Ray (or an actor) did not answer in time; the call may succeed later."""


class CoordinatorGone(RayCallError):
    """The job's coordinator actor is dead or does not exist."""


class JobNotFound(LookupError):
    def __init__(self, job_id: str):
        super().__init__(f"job {job_id!r} not found")
        self.job_id = job_id


class WorkerNotFound(LookupError):
    """The job has no such worker (404)."""


class JobConflict(Exception):
    """The request does not fit the job's current state (409): draining its last worker,
    resuming a job whose coordinator is alive or which has no checkpoint."""


def already_finished(state: JobState, job_id: str) -> JobConflict:
    """Cancelling a job that already ended (409), in the user's words rather than the
    lifecycle's ``job is CANCELLED; it cannot become CANCELLED``."""
    if state == JobState.CANCELLED:
        return JobConflict(f"job {job_id} is already CANCELLED")
    return JobConflict(f"job {job_id} already finished ({state.value}): there is nothing to "
                       "cancel")


def job_finished(state: JobState, job_id: str, why: str) -> JobConflict:
    """A request that only a live job takes, to one that finished (409): ``job 3f2a has
    finished (SUCCEEDED); WHY``."""
    return JobConflict(f"job {job_id} has finished ({state.value}); {why}")


class InvalidRequest(ValueError):
    """A well-formed request that this job cannot take (422), naming the body field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message

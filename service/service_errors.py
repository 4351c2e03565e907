"""The service's errors: what a Ray call, a lookup or a request can fail with.

The API maps each to its status (``dynabatch.api.app``): :class:`RayCallError` 503,
:class:`JobNotFound` and :class:`WorkerNotFound` 404, :class:`JobConflict` and
:class:`AlreadyFinished` 409, :class:`InvalidRequest` 422.
"""

from __future__ import annotations

from dynabatch.scheduler.core.lifecycle import InvalidTransition, JobState


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

    def __str__(self) -> str:  # KeyError-style quoting would wrap the message
        return str(self.args[0]) if self.args else "worker not found"


class JobConflict(Exception):
    """The request does not fit the job's current state (409): draining its last worker,
    resuming a job whose coordinator is alive or which has no checkpoint."""


class AlreadyFinished(InvalidTransition):
    """Cancelling a job that already ended (409): says so, rather than the lifecycle's
    ``job is CANCELLED; it cannot become CANCELLED``."""

    def __init__(self, old: JobState, job_id: str = ""):
        super().__init__(old, JobState.CANCELLED)
        job = f"job {job_id}" if job_id else "job"
        if old == JobState.CANCELLED:
            self.args = (f"{job} is already CANCELLED",)
        else:
            self.args = (f"{job} already finished ({old.value}): there is nothing to cancel",)
        self.job_id = job_id

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self):
        return (AlreadyFinished, (self.old, self.job_id))


class JobFinished(InvalidTransition):
    """A request that only a live job takes (scale, drain) to one that finished (409), in
    the user's words: ``job 3f2a has finished (SUCCEEDED); a finished job cannot be
    scaled``, rather than the lifecycle's ``job is SUCCEEDED; it cannot become RUNNING``."""

    def __init__(self, old: JobState, job_id: str = "", done: str = "changed"):
        super().__init__(old, JobState.RUNNING)
        self.args = (finished_message(old, job_id, f"a finished job cannot be {done}"),)
        self.job_id, self.done = job_id, done

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self):
        return (JobFinished, (self.old, self.job_id, self.done))


def finished_message(state: JobState, job_id: str, why: str) -> str:
    """``job ID has finished (STATE); WHY``: the refusal of a request a finished job cannot
    take."""
    job = f"job {job_id}" if job_id else "the job"
    return f"{job} has finished ({state.value}); {why}"


class InvalidRequest(ValueError):
    """A well-formed request that this job cannot take (422), naming the body field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message

"""The seam between the service and the cluster scheduler actor
(:mod:`dynabatch.scheduler.runtime.cluster`): :class:`Scheduling`, and its Ray implementation.

With the scheduler on (``DYNABATCH_CLUSTER_SCHEDULER=1``) a submitted job is registered with
it instead of launched: the scheduler starts its coordinator on the nodes it grants, and
the job stays PENDING with the queue's reason until then. Every sync tick the service tells
it every live job from the store (:meth:`Scheduling.sync`), which is how a new scheduler
rebuilds its state after the actor or the API restarted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.cluster.view import ClusterView
from dynabatch.service.errors import ClusterUnavailable, RayCallError

log = logging.getLogger("dynabatch.service")


class Refused(ValueError):
    """The scheduler refuses the job or the request; the message says why."""


class Scheduling(Protocol):
    def admissible(self, spec: JobSpec) -> str | None:
        """Why the scheduler could never place this job, or None."""
        ...

    def register(self, job_id: str, spec: JobSpec, submit_s: float, generation: int) -> None:
        """Place the job (its coordinator of ``generation`` once granted). Raises
        :class:`Refused`."""
        ...

    def sync(self, jobs: Sequence[tuple[str, JobSpec, float, int]]) -> set[str]:
        """Every live job (id, spec, submit time, generation); returns those the scheduler
        started (or adopted). Keeps the last round's view for :meth:`view`."""
        ...

    def finished(self, job_id: str) -> None: ...

    def request_scale(self, job_id: str, workers: int) -> str:
        """The job's own scale, as a request to the scheduler: its answer, or
        :class:`Refused`."""
        ...

    def refuse_drain(self, job_id: str, worker: str) -> str: ...

    def view(self) -> ClusterView | None:
        """The last round's view as of the last :meth:`sync` (no I/O)."""
        ...


class RayScheduling:
    """:class:`Scheduling` over the named actor, created when missing (each call that finds
    it gone makes a new one, which rebuilds at the next :meth:`sync`)."""

    def __init__(self, policy: str, round_s: float, hold_s: float, call_timeout_s: float = 10.0):
        self._args = (policy, round_s, hold_s, call_timeout_s)
        self._timeout = call_timeout_s
        self._handle: Any = None
        self._lock = threading.Lock()
        self._view: ClusterView | None = None

    def _actor(self) -> Any:
        with self._lock:
            if self._handle is None:
                from dynabatch.scheduler.runtime.cluster import ensure_scheduler

                self._handle = ensure_scheduler(*self._args)
            return self._handle

    def _call(self, method: str, *args: Any) -> Any:
        import ray
        import ray.exceptions as rex

        for attempt in (0, 1):
            handle = self._actor()
            try:
                return ray.get(getattr(handle, method).remote(*args), timeout=self._timeout)
            except rex.RayActorError as err:
                with self._lock:
                    self._handle = None
                if attempt:
                    raise ClusterUnavailable(f"the cluster scheduler is gone: {err}") from err
                log.warning("the cluster scheduler actor is gone; starting a new one")
            except rex.GetTimeoutError as err:
                raise ClusterUnavailable("the cluster scheduler did not answer in time") from err
            except rex.RayTaskError as err:
                cause = getattr(err, "cause", None)
                if isinstance(cause, ValueError):
                    raise Refused(str(cause)) from None
                raise RayCallError(str(cause or err).strip().splitlines()[-1][:300]) from err
        raise AssertionError("unreachable")

    def admissible(self, spec: JobSpec) -> str | None:
        return self._call("admissible", spec)

    def register(self, job_id: str, spec: JobSpec, submit_s: float, generation: int) -> None:
        from dynabatch.scheduler.runtime.cluster import JobEntry

        self._call("register", JobEntry(job_id, spec, submit_s, generation))

    def sync(self, jobs: Sequence[tuple[str, JobSpec, float, int]]) -> set[str]:
        from dynabatch.scheduler.runtime.cluster import JobEntry

        started, view = self._call("sync", [JobEntry(*j) for j in jobs])
        self._view = view
        return set(started)

    def finished(self, job_id: str) -> None:
        self._call("finished", job_id)

    def request_scale(self, job_id: str, workers: int) -> str:
        return self._call("request_scale", job_id, workers)

    def refuse_drain(self, job_id: str, worker: str) -> str:
        return self._call("refuse_drain", job_id, worker)

    def view(self) -> ClusterView | None:
        return self._view

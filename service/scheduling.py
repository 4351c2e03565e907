"""The seam between the service and the cluster scheduler actor
(:mod:`dynabatch.scheduler.runtime.cluster_scheduler`): :class:`RayScheduling`.

A submitted job is registered with it instead of launched: the scheduler starts its
coordinator on the nodes it grants. Every sync tick the service tells it every live job
(:meth:`RayScheduling.sync`), which is how a new scheduler rebuilds after a restart.
``dynabatch run --address`` registers as a client job (:func:`run_placed`): its own driver
launches the coordinator on the granted nodes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.cluster.view import ClusterView
from dynabatch.service.service_errors import ClusterUnavailable, RayCallError
from dynabatch.service.settings import Settings

log = logging.getLogger("dynabatch.service")
KEEP_ALIVE_S = 5.0  # how often it re-registers its job while it trains


class Refused(ValueError):
    """The scheduler refuses the job or the request; the message says why."""


class RayScheduling:
    """The named scheduler actor, created when missing (each call that finds it gone makes a
    new one, which rebuilds at the next :meth:`sync`). A refusal raises :class:`Refused`
    with the scheduler's reason. Tests stand in a fake over the pure rounds."""

    def __init__(self, settings: Settings, synced: bool = False):
        """With ``settings``' policy, round and hold (``DYNABATCH_CLUSTER_*``); ``synced``:
        the scheduler runs rounds at once, since no service rebuilds it."""
        s = settings
        self._args = (s.cluster_policy, s.cluster_round_s, s.cluster_hold_s,
                      s.ray_call_timeout_s, synced)
        self._timeout = s.ray_call_timeout_s
        self._handle: Any = None
        self._lock = threading.Lock()
        self._view: ClusterView | None = None

    def _call(self, method: str, *args: Any) -> Any:
        import ray
        import ray.exceptions as rex

        for attempt in (0, 1):
            with self._lock:
                if self._handle is None:
                    from dynabatch.scheduler.runtime.cluster_scheduler import ensure_scheduler

                    self._handle = ensure_scheduler(*self._args)
                handle = self._handle
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
        from dynabatch.scheduler.runtime.cluster_scheduler import JobEntry

        self._call("register", JobEntry(job_id, spec, submit_s, generation))

    def sync(self, jobs: Sequence[tuple[str, JobSpec, float, int]]) -> set[str]:
        """Every live job (id, spec, submit time, generation); returns those the scheduler
        started (or adopted). Keeps the last round's view for :meth:`view` (no I/O)."""
        from dynabatch.scheduler.runtime.cluster_scheduler import JobEntry

        started, view = self._call("sync", [JobEntry(*j) for j in jobs])
        self._view = view
        return set(started)

    def finished(self, job_id: str) -> None:
        self._call("finished", job_id)
        # The job leaves the views now, not at the next sync.
        self._view = self._call("view")

    def request_scale(self, job_id: str, workers: int) -> str:
        return self._call("request_scale", job_id, workers)

    def request_drain(self, job_id: str, node: str, worker: str) -> str:
        return self._call("request_drain", job_id, node, worker)

    def view(self) -> ClusterView | None:
        return self._view

    def register_client(self, job_id: str, spec: JobSpec, submit_s: float) -> None:
        """Register (or, repeated, keep alive) a job whose own driver launches it."""
        from dynabatch.scheduler.runtime.cluster_scheduler import JobEntry

        self._call("register", JobEntry(job_id, spec, submit_s, 0, client=True))

    def grant(self, job_id: str) -> tuple[tuple[tuple[str, int], ...] | None, str]:
        return self._call("grant", job_id)

    def launched(self, job_id: str, slots: Sequence[tuple[str, int]]) -> None:
        self._call("launched", job_id, list(slots))


def scheduler_for_run(address_given: bool, want: bool | None) -> RayScheduling | None:
    """The scheduler ``dynabatch run`` goes through on a cluster (``address_given``) unless
    ``want`` is False: the cluster's, or a new one with the service's settings
    (``DYNABATCH_CLUSTER_*``), running rounds at once since no service rebuilds it."""
    if want is False or not address_given:
        return None
    return RayScheduling(Settings(), synced=True)


def run_placed(
    scheduling: RayScheduling,
    spec: JobSpec,
    launch: Callable[[str, dict[str, int]], Any],
    *,
    on_wait: Callable[[str], None],
    interrupted: Callable[[], bool] = lambda: False,
    job_id: str | None = None,
) -> tuple[str, Any]:
    """Register ``dynabatch run``'s job with the scheduler, wait for its grant (``on_wait``
    hears each new reason it waits for) and launch its coordinator there; returns (job id,
    the coordinator). An interruption takes it out of the queue (``KeyboardInterrupt``)."""
    job_id = job_id or uuid.uuid4().hex[:12]
    scheduling.register_client(job_id, spec, time.time())
    shown = None
    try:
        while True:
            slots, why = scheduling.grant(job_id)
            if slots is not None:
                break
            if why != shown:
                on_wait(why)
                shown = why
            if interrupted():
                raise KeyboardInterrupt
            time.sleep(0.5)
        handle = launch(job_id, dict(slots))
    except BaseException:
        quietly(scheduling.finished, job_id)
        raise
    scheduling.launched(job_id, slots)
    return job_id, handle


def quietly(call: Callable[..., Any], *args: Any) -> None:
    """A courtesy to the scheduler that must not mask what the run reports."""
    try:
        call(*args)
    except Exception as err:
        log.warning("cluster scheduler: %s", err)


def keep_alive(
    scheduling: RayScheduling, job_id: str, spec: JobSpec, submit_s: float
) -> Callable[[], None]:
    """A tick for the run's follow loop: re-registers its job every :data:`KEEP_ALIVE_S`, so
    that a new scheduler (the old one died) adopts it; failures are logged, never raised."""
    last = [time.monotonic()]

    def tick() -> None:
        if time.monotonic() - last[0] >= KEEP_ALIVE_S:
            last[0] = time.monotonic()
            quietly(scheduling.register_client, job_id, spec, submit_s)

    return tick

"""The service's cluster client: every Ray call the service makes, with Ray's errors
translated (:mod:`dynabatch.service.service_errors`). ``tests.fakes.FakeCluster`` stands in
for it in route and service tests.

Coordinator handles are cached per job; one without (after an API restart) is looked up by
its actor name. Ray is imported lazily, so the API process pays for it only when it connects.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
from typing import TYPE_CHECKING, Any

from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import InvalidTransition, JobState
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine
from dynabatch.service.cluster_client import NodeStatus
from dynabatch.service.scheduling import RayScheduling
from dynabatch.service.service_errors import (
    ClusterUnavailable,
    CoordinatorGone,
    JobConflict,
    RayCallError,
    WorkerNotFound,
)

if TYPE_CHECKING:
    from dynabatch.service.settings import Settings

log = logging.getLogger("dynabatch.ray")
PING_TIMEOUT_S = 3.0  # a readiness check of Ray, and the first connection to its GCS


class RayClusterClient:
    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: int | None = None,
        call_timeout_s: float = 10.0,
    ):
        self._requested = address
        self._num_cpus = num_cpus
        self._timeout = call_timeout_s
        self._address = address or "local"
        self._handles: dict[str, Any] = {}
        self._generations: dict[str, int] = {}  # the coordinator generation each job is at
        self._lock = threading.Lock()
        self._connected = False
        self._pinger = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ray-ping")

    @property
    def embedded(self) -> bool:
        """True when Ray lives in this process and ends with it."""
        return self._requested in (None, "", "local")

    @property
    def address(self) -> str:
        """The cluster's address, for the record of where a job ran."""
        return self._address

    def connect(self) -> None:
        if self._connected:
            return
        from dynabatch.service.raycluster import connect

        if not self.embedded:
            _probe(self._address, PING_TIMEOUT_S)
        try:
            info = connect(self._requested, num_cpus=self._num_cpus)
        except Exception as err:  # ConnectionError, RuntimeError, ... from ray.init
            raise ClusterUnavailable(f"cannot connect to Ray at {self._address}: {err}") from err
        self._address = str(info.get("address") or self._address)
        self._connected = True
        import dynabatch.scheduler.runtime.launch  # noqa: F401  (pay for the engine's imports now, not on submit)

        log.info(
            "connected to Ray at %s (%s)",
            self._address,
            "embedded" if self.embedded else "external",
        )

    def close(self) -> None:
        self._pinger.shutdown(wait=False, cancel_futures=True)
        if self._connected:
            import ray

            self._handles.clear()
            gone = self.embedded and not self.reachable()
            self._connected = False
            if gone:
                # The embedded Ray is gone already (a signal to the whole process group):
                # shutting it down would wait on Ray's 60-second reconnect timeout.
                log.warning("the embedded Ray ended before the API; not shutting it down")
                return
            ray.shutdown()

    def reachable(self, timeout_s: float = 0.5) -> bool:
        """Whether Ray's GCS accepts a connection now: a bounded check that never waits on
        Ray's own reconnect timeout (a dead embedded GCS refuses at once)."""
        if not self._connected:
            return False
        import ray

        try:
            host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                return True
        except (OSError, ValueError, RuntimeError):
            return False

    def ping(self) -> bool:
        if not self._connected:
            return False
        import ray

        def alive() -> bool:
            return any(n.get("Alive") for n in ray.nodes())

        try:
            return bool(self._pinger.submit(alive).result(timeout=PING_TIMEOUT_S))
        except Exception:
            return False

    # Coordinators -----------------------------------------------------------------------
    def launch(self, job_id: str, spec: JobSpec, generation: int = 0) -> None:
        """Start the job's coordinator of ``generation`` (the job's count of resumes, as
        the store keeps it): each generation's actor has a name of its own."""
        from dynabatch.scheduler.runtime.launch import launch_coordinator

        with self._lock:
            self._generations[job_id] = generation
        try:
            handle = launch_coordinator(
                job_id, spec, detached=not self.embedded, generation=generation
            )
        except Exception as err:
            raise _translate(err, job_id) from err
        with self._lock:
            self._handles[job_id] = handle

    def find(self, job_id: str, generation: int = 0) -> bool:
        """Whether the job's coordinator of ``generation`` is there; later calls for the job
        go to it."""
        from dynabatch.scheduler.runtime.launch import find_coordinator

        with self._lock:
            self._generations[job_id] = generation
        try:
            handle = find_coordinator(job_id, generation)
        except Exception as err:
            raise _translate(err, job_id) from err
        if handle is None:
            return False
        with self._lock:
            self._handles[job_id] = handle
        return True

    def _handle(self, job_id: str) -> Any:
        with self._lock:
            handle = self._handles.get(job_id)
            generation = self._generations.get(job_id, 0)
        if handle is None and not self.find(job_id, generation):
            raise CoordinatorGone(f"no coordinator actor for job {job_id}")
        with self._lock:
            return self._handles[job_id]

    def _call(self, job_id: str, method: str, *args: Any) -> Any:
        import ray

        handle = self._handle(job_id)
        try:
            return ray.get(getattr(handle, method).remote(*args), timeout=self._timeout)
        except Exception as err:
            translated = _translate(err, job_id)
            if isinstance(translated, CoordinatorGone):
                with self._lock:
                    self._handles.pop(job_id, None)
                # Ray lets go of a dead actor (and its name) now, not when every handle to it
                # is gone. Best effort: a resumed coordinator does not need its name.
                try:
                    ray.kill(handle, no_restart=True)
                except Exception as kill_err:
                    log.debug("releasing a dead coordinator: %s", kill_err)
            raise translated from err

    def snapshot(self, job_id: str) -> JobSnapshot:
        return JobSnapshot.model_validate(self._call(job_id, "snapshot"))

    def history(self, job_id: str, since: int = 0) -> list[EpochRecord]:
        return [EpochRecord.model_validate(r) for r in self._call(job_id, "history", since)]

    def logs(self, job_id: str, since: int = 0) -> list[LogLine]:
        return [LogLine.model_validate(x) for x in self._call(job_id, "logs", since)]

    def cancel(self, job_id: str, reason: str) -> JobSnapshot:
        return JobSnapshot.model_validate(self._call(job_id, "cancel", reason))

    def scale(self, job_id: str, workers: int) -> JobSnapshot:
        return JobSnapshot.model_validate(self._membership_call(job_id, "scale", workers))

    def drain(self, job_id: str, worker: str) -> JobSnapshot:
        """Remove ``worker`` at the next step boundary. Raises :class:`WorkerNotFound`,
        :class:`JobConflict` (its last worker) or ``InvalidTransition`` (terminal)."""
        return JobSnapshot.model_validate(self._membership_call(job_id, "drain", worker))

    def _membership_call(self, job_id: str, method: str, *args: Any) -> Any:
        """scale/drain: the coordinator's KeyError (no such worker) and ValueError (the last
        worker) are the caller's mistakes, not Ray failures."""
        try:
            return self._call(job_id, method, *args)
        except RayCallError as err:
            cause = getattr(err.__cause__, "cause", None)
            if isinstance(cause, KeyError):
                raise WorkerNotFound(str(cause.args[0]) if cause.args else str(cause)) from None
            if isinstance(cause, ValueError) and not isinstance(cause, InvalidTransition):
                raise JobConflict(str(cause)) from None
            raise

    def model_files(self, job_id: str) -> dict[str, bytes] | None:
        """The trained model's files the coordinator keeps, None when it has none (yet)."""
        return self._call(job_id, "model_files")

    def release(self, job_id: str) -> None:
        import ray

        with self._lock:
            handle = self._handles.pop(job_id, None)
        if handle is None:
            return
        try:
            ray.kill(handle, no_restart=True)
        except Exception as err:
            raise RayCallError(f"cannot stop the coordinator of job {job_id}: {err}") from err

    # Nodes ------------------------------------------------------------------------------
    def nodes(self) -> list[NodeStatus]:
        import ray

        try:
            raw = ray.nodes()
        except Exception as err:
            raise ClusterUnavailable(f"cannot list Ray nodes: {err}") from err
        try:
            from ray._private.state import available_resources_per_node

            free: dict[str, dict[str, float]] | None = available_resources_per_node()
        except Exception:  # a DeveloperAPI; the view works without it
            free = None
        out = []
        for n in raw:
            node_id = str(n.get("NodeID", ""))
            resources = {k: float(v) for k, v in (n.get("Resources") or {}).items()}
            alive = bool(n.get("Alive"))
            out.append(
                NodeStatus(
                    node_id=node_id,
                    address=str(n.get("NodeManagerAddress", "")),
                    hostname=str(n.get("NodeManagerHostname", "")),
                    alive=alive,
                    head=any(k.startswith("node:__internal_head__") for k in resources),
                    resources=resources,
                    available=(
                        {k: float(v) for k, v in free.get(node_id, {}).items()}
                        if free is not None and alive
                        else None
                    ),
                )
            )
        return out

    def scheduling(self, settings: Settings) -> RayScheduling:
        """The named cluster-scheduler actor on this Ray (created at its first call), with
        ``settings``' policy, round and hold. (A cluster without one answers None.)"""
        return RayScheduling(settings)


def _probe(address: str, timeout: float) -> None:
    """Fail fast when a ``host:port`` GCS address does not accept connections (ray.init
    would retry for minutes). Other address forms are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            pass
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise ClusterUnavailable(f"cannot reach Ray at {address}: {why}") from None


def _translate(err: BaseException, job_id: str) -> BaseException:
    """Map Ray's exceptions onto the service's; InvalidTransition passes through."""
    import ray.exceptions as rex

    if isinstance(err, RayCallError | InvalidTransition):
        return err
    if isinstance(err, rex.GetTimeoutError):
        return ClusterUnavailable(f"the coordinator of job {job_id} did not answer in time")
    if isinstance(err, rex.ActorUnavailableError):
        return ClusterUnavailable(f"the coordinator of job {job_id} is unreachable for now")
    if isinstance(err, rex.RayActorError):
        return CoordinatorGone(_short(err))
    if isinstance(err, rex.RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, InvalidTransition):
            return InvalidTransition(cause.old, cause.new)
    if "cannot become" in str(err):
        # An InvalidTransition that did not survive pickling (Ray then raises
        # UnserializableException). JobService re-reads the real state before answering 409.
        return InvalidTransition(JobState.SUCCEEDED, JobState.CANCELLED)
    if isinstance(err, rex.RayTaskError):
        cause = getattr(err, "cause", None)
        return RayCallError(_short(cause if cause is not None else err))
    if isinstance(err, ConnectionError | rex.RaySystemError):
        return ClusterUnavailable(_short(err))
    return RayCallError(_short(err))


def _short(err: BaseException) -> str:
    lines = [x for x in str(err).strip().splitlines() if x.strip()]
    return (lines[-1] if lines else type(err).__name__)[:300]

"""``JobService``: submit, list, inspect and cancel jobs; keep the store in step with Ray.

Every Ray call goes through a :class:`ClusterClient`, so routes and this service run against
``tests.fakes.FakeCluster`` as well as the real :class:`service.ray_client.RayClusterClient`.

Reads (get, list, history, logs, metrics) come from the store. A background sync loop polls
each live job's coordinator (snapshot, new epochs, new log lines) into the store, notices a
coordinator that died (the job becomes FAILED with the reason), and releases a finished job's
detached coordinator once its results are stored. On start, jobs left live by an earlier API
process are re-attached by name; in embedded mode their Ray ended with that process, so they
are marked FAILED instead of being forgotten.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from scheduler.state import InvalidTransition, JobState
from scheduler.telemetry import EpochRecord, JobSnapshot, LogLine
from service.spec import JobSpec
from service.store import EMBEDDED_CLUSTER, JobRecord, JobStore

log = logging.getLogger("dynabatch.service")

JOB_ID_PATTERN = r"^[0-9a-f]{12}$"
EMBEDDED_ENDED = "the embedded Ray cluster ended with the API process"


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


# Errors ---------------------------------------------------------------------------------
class ClusterError(RuntimeError):
    """A Ray call failed."""


class ClusterUnavailable(ClusterError):
    """Ray (or an actor) did not answer in time; the call may succeed later."""


class CoordinatorGone(ClusterError):
    """The job's coordinator actor is dead or does not exist."""


class JobNotFound(LookupError):
    def __init__(self, job_id: str):
        super().__init__(f"job {job_id!r} not found")
        self.job_id = job_id


# Cluster view ---------------------------------------------------------------------------
class NodeJob(BaseModel):
    model_config = ConfigDict(frozen=True)

    job_id: str
    name: str
    workers: list[str] = Field(description="Names of this job's workers on the node.")


class NodeInfo(BaseModel):
    """A Ray node, its resources, and the live jobs whose workers it hosts."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    address: str
    hostname: str = ""
    alive: bool = True
    head: bool = False
    resources: dict[str, float] = Field(default_factory=dict, description="Total resources.")
    available: dict[str, float] | None = Field(
        default=None, description="Resources free now, when Ray reports them."
    )
    jobs: list[NodeJob] = Field(default_factory=list)

    def matches(self, node: str) -> bool:
        """Whether a worker's ``node`` field names this node (id, address or hostname)."""
        return bool(node) and node in (self.node_id, self.address, self.hostname)


class ClusterClient(Protocol):
    """Every Ray call the service makes. Implementations raise :class:`ClusterError`s."""

    @property
    def embedded(self) -> bool:
        """True when Ray lives in this process and ends with it."""
        ...

    @property
    def address(self) -> str:
        """The cluster's address, for the record of where a job ran."""
        ...

    def connect(self) -> None: ...

    def close(self) -> None: ...

    def ping(self) -> bool: ...

    def launch(self, job_id: str, spec: JobSpec) -> None: ...

    def find(self, job_id: str) -> bool: ...

    def snapshot(self, job_id: str) -> JobSnapshot: ...

    def history(self, job_id: str, since: int = 0) -> list[EpochRecord]: ...

    def logs(self, job_id: str, since: int = 0) -> list[LogLine]: ...

    def cancel(self, job_id: str, reason: str) -> JobSnapshot: ...

    def release(self, job_id: str) -> None: ...

    def nodes(self) -> list[NodeInfo]: ...


class JobService:
    def __init__(
        self,
        store: JobStore,
        cluster: ClusterClient,
        *,
        sync_interval_s: float = 1.0,
        metrics_retention_s: float = 3600.0,
        release_finished: bool = True,
        cancel_wait_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ):
        self.store = store
        self.cluster = cluster
        self.sync_interval_s = sync_interval_s
        self.metrics_retention_s = metrics_retention_s
        self.release_finished = release_finished
        self.cancel_wait_s = cancel_wait_s
        self.clock = clock
        self._sync_lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._alive_nodes: int | None = None
        self._started = False
        # Jobs stored but not yet launched: the sync loop must not take the missing
        # coordinator for a dead one.
        self._launching: set[str] = set()
        self._launching_lock = threading.Lock()

    # Lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Re-attach jobs left live by an earlier process, then start the sync loop."""
        self.reattach()
        self._started = True
        if self.sync_interval_s > 0:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="dynabatch-sync", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the sync loop. In embedded mode, live jobs end with Ray: mark them FAILED."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.sync_interval_s))
            self._thread = None
        if self._started and self.cluster.embedded:
            self.sync_once()
            for rec in self.store.live():
                self._fail(rec.id, EMBEDDED_ENDED)
        self._started = False

    @property
    def ready(self) -> bool:
        return self.cluster.ping()

    def reattach(self) -> list[str]:
        """Find the coordinators of jobs the store says are live; returns the ids found."""
        found = []
        for rec in self.store.live():
            if rec.cluster == EMBEDDED_CLUSTER or self.cluster.embedded:
                reason = EMBEDDED_ENDED
                if rec.cluster != EMBEDDED_CLUSTER:
                    reason = (
                        f"the API restarted with an embedded Ray; the job's cluster "
                        f"({rec.cluster}) is no longer attached"
                    )
                self._fail(rec.id, reason)
                continue
            try:
                ok = self.cluster.find(rec.id)
            except ClusterUnavailable as err:
                log.warning("job %s: cannot re-attach yet (%s); will retry", rec.id, err)
                continue
            except ClusterError as err:
                ok, why = False, str(err)
            else:
                why = "no coordinator actor on the Ray cluster after the API restarted"
            if ok:
                log.info("job %s: re-attached to its coordinator", rec.id)
                found.append(rec.id)
            else:
                self._fail(rec.id, f"lost while the API was down: {why}")
        return found

    def _loop(self) -> None:
        while not self._stop.wait(self.sync_interval_s):
            try:
                self.sync_once()
            except Exception:  # the loop must survive anything one tick does
                log.exception("sync loop tick failed")

    # Sync -------------------------------------------------------------------------------
    def sync_once(self) -> None:
        """Poll every live job once, and refresh the count of alive nodes."""
        for rec in self.store.live():
            if self._stop.is_set() and self._thread is not None:
                return
            with self._launching_lock:
                if rec.id in self._launching:
                    continue
            self.sync_job(rec.id)
        try:
            self._alive_nodes = sum(1 for n in self.cluster.nodes() if n.alive)
        except ClusterError as err:
            log.warning("cannot list Ray nodes: %s", err)
            self._alive_nodes = None

    def sync_job(self, job_id: str, snapshot: JobSnapshot | None = None) -> JobRecord | None:
        """Bring one job's stored state, history and logs up to date with its coordinator."""
        with self._sync_lock:
            rec = self.store.get(job_id)
            if rec is None or rec.state.is_terminal:
                return rec
            try:
                snap = snapshot if snapshot is not None else self.cluster.snapshot(job_id)
                last_epoch = self.store.last_epoch(job_id)
                records = self.cluster.history(job_id, 0 if last_epoch is None else last_epoch + 1)
                last_seq = self.store.last_log_seq(job_id)
                lines = self.cluster.logs(job_id, 0 if last_seq is None else last_seq + 1)
            except CoordinatorGone as err:
                return self._fail(job_id, f"the job's coordinator actor died: {_first_line(err)}")
            except ClusterError as err:
                log.warning("job %s: sync failed (%s)", job_id, _first_line(err))
                return rec
            self.store.add_history(job_id, records)
            self.store.add_logs(job_id, lines)
            self.store.save_snapshot(snap, now=self.clock())
            if snap.state.is_terminal and self.release_finished:
                try:
                    self.cluster.release(job_id)
                except ClusterError as err:
                    log.warning("job %s: cannot release coordinator (%s)", job_id, err)
            return self.store.get(job_id)

    def _fail(self, job_id: str, reason: str) -> JobRecord | None:
        try:
            rec = self.store.transition(job_id, JobState.FAILED, reason, now=self.clock())
        except (KeyError, InvalidTransition):
            return self.store.get(job_id)
        log.warning("job %s: FAILED (%s)", job_id, reason)
        return rec

    # Commands ---------------------------------------------------------------------------
    def submit(self, spec: JobSpec) -> JobRecord:
        """Store the job and start its coordinator. A launch that fails leaves it FAILED.

        Raises :class:`ClusterUnavailable` (after recording the failure) when Ray did not
        answer; other launch errors are the job's reason and the record is returned.
        """
        job_id = new_job_id()
        cluster = EMBEDDED_CLUSTER if self.cluster.embedded else self.cluster.address
        with self._launching_lock:
            self._launching.add(job_id)
        try:
            rec = self.store.create(job_id, spec, cluster=cluster, now=self.clock())
            self.cluster.launch(job_id, spec)
        except ClusterUnavailable as err:
            self._fail(job_id, f"could not start the job's coordinator: {_first_line(err)}")
            raise
        except ClusterError as err:
            failed = self._fail(
                job_id, f"could not start the job's coordinator: {_first_line(err)}"
            )
            return failed or rec
        finally:
            with self._launching_lock:
                self._launching.discard(job_id)
        log.info("job %s (%s) submitted", job_id, spec.name)
        return rec

    def cancel(self, job_id: str, reason: str = "cancelled by user") -> JobRecord:
        """Cancel a live job. Raises ``InvalidTransition`` (409) when it already finished.

        The coordinator stops at its next step boundary; this waits up to ``cancel_wait_s``
        for that, so the answer is usually the final CANCELLED state.
        """
        with self._sync_lock:
            rec = self._get_record(job_id)
            if rec.state.is_terminal:
                raise InvalidTransition(rec.state, JobState.CANCELLED)
            try:
                snap = self.cluster.cancel(job_id, reason)
            except CoordinatorGone:
                return self.store.transition(job_id, JobState.CANCELLED, reason, now=self.clock())
            except InvalidTransition:
                # It finished between our read and the coordinator's; report what it is.
                done = self.sync_job(job_id) or rec
                raise InvalidTransition(done.state, JobState.CANCELLED) from None
            log.info("job %s: cancel requested (%s)", job_id, reason)
        deadline = time.monotonic() + self.cancel_wait_s
        while not snap.state.is_terminal and time.monotonic() < deadline:
            time.sleep(0.1)
            try:
                snap = self.cluster.snapshot(job_id)
            except ClusterError:
                break
        return self.sync_job(job_id, snapshot=snap) or rec

    # Queries ----------------------------------------------------------------------------
    def _get_record(self, job_id: str) -> JobRecord:
        rec = self.store.get(job_id)
        if rec is None:
            raise JobNotFound(job_id)
        return rec

    def get(self, job_id: str) -> JobRecord:
        return self._get_record(job_id)

    def list(
        self, state: JobState | None = None, *, offset: int = 0, limit: int = 50
    ) -> tuple[list[JobRecord], int]:
        return self.store.list(state, offset=offset, limit=limit)

    def history(self, job_id: str, since: int = 0) -> list[EpochRecord]:
        self._get_record(job_id)
        return self.store.history(job_id, since)

    def logs(self, job_id: str, since: int = 0, limit: int = 1000) -> list[LogLine]:
        self._get_record(job_id)
        return self.store.logs(job_id, since, limit)

    def nodes(self) -> list[NodeInfo]:
        """Ray's nodes, each with the live jobs whose workers it hosts."""
        nodes = self.cluster.nodes()
        hosted: dict[str, dict[str, NodeJob]] = {n.node_id: {} for n in nodes}
        for rec in self.store.live():
            snap = rec.current_snapshot()
            for w in snap.workers:
                for n in nodes:
                    if n.matches(w.node):
                        jobs = hosted[n.node_id]
                        prev = jobs.get(rec.id)
                        workers = [*prev.workers, w.worker] if prev else [w.worker]
                        jobs[rec.id] = NodeJob(job_id=rec.id, name=rec.name, workers=workers)
                        break
        return [n.model_copy(update={"jobs": list(hosted[n.node_id].values())}) for n in nodes]

    # Metrics ----------------------------------------------------------------------------
    def metric_snapshots(self) -> list[JobSnapshot]:
        """Live jobs and those that finished within the retention window, oldest first."""
        recs = self.store.live() + self.store.finished_since(
            self.clock() - self.metrics_retention_s
        )
        recs.sort(key=lambda r: (r.created_at, r.id))
        return [r.current_snapshot() for r in recs]

    def job_counts(self) -> dict[JobState, int]:
        return self.store.count_by_state()

    @property
    def alive_nodes(self) -> int | None:
        return self._alive_nodes


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:300]

"""The read model: every view of the jobs (get, list, history, logs, the nodes' jobs and the
job state /metrics exports), read from the store, never from Ray.

A live job that the cluster scheduler's last round queues is shown with the queue's reason
(``queued: position 2 of 3 (...)``): the REST job, the list, ``dynabatch status`` and the
job page all read it from here. /metrics reads go through a cache kept for one sync interval
at most (the store changes no more often than the sync loop writes it), which the registry
drops at each write.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from dynabatch.scheduler.core.cluster.view import ClusterView
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine
from dynabatch.service.cluster_client import ClusterClient, NodeJob, NodeStatus
from dynabatch.service.cluster_schemas import GRANTED, scheduler_note
from dynabatch.service.service_errors import JobNotFound
from dynabatch.service.store import JobRecord, JobStore


@dataclass(frozen=True)
class MetricState:
    """One read of the job state /metrics exports (:meth:`JobReads.metric_state`)."""

    read_at: float
    snapshots: list[JobSnapshot]
    last_records: dict[str, EpochRecord]
    job_counts: dict[JobState, int]


def shown(rec: JobRecord, view: ClusterView | None) -> JobRecord:
    """``rec`` with the cluster scheduler's word on it (:func:`scheduler_note`) while it is
    live: the queue's reason while its round ``view`` queues it, what an owner's scale
    still waits for, and, while the job is PENDING, that its coordinator is starting on the
    nodes it was granted."""
    if rec.state.is_terminal:
        return rec
    why = scheduler_note(view, rec.id)
    if why is None or why == rec.reason:
        return rec
    if rec.state != JobState.PENDING and why.startswith(GRANTED.split("{", 1)[0]):
        return rec  # it runs: its own report says so until the scheduler has heard it
    return replace(rec, reason=why)


class JobReads:
    """The jobs as every view shows them."""

    def __init__(
        self,
        store: JobStore,
        cluster: ClusterClient,
        *,
        view: Callable[[], ClusterView | None],
        clock: Callable[[], float],
        metrics_retention_s: float,
        metrics_ttl_s: float,
    ):
        self.store = store
        self.cluster = cluster
        self.view = view  # the cluster scheduler's last round (no I/O)
        self.clock = clock
        self.metrics_retention_s = metrics_retention_s
        self.metrics_ttl_s = metrics_ttl_s  # how long one metrics read serves (0: none)
        self._metric_lock = threading.Lock()
        self._metric_cache: MetricState | None = None

    # Jobs -------------------------------------------------------------------------------
    def record(self, job_id: str) -> JobRecord:
        """The job as stored; raises :class:`JobNotFound` (404) for an unknown id."""
        rec = self.store.get(job_id)
        if rec is None:
            raise JobNotFound(job_id)
        return rec

    def get(self, job_id: str) -> JobRecord:
        return shown(self.record(job_id), self.view())

    def list(
        self, state: JobState | None = None, *, offset: int = 0, limit: int = 50
    ) -> tuple[list[JobRecord], int]:
        records, total = self.store.list(state, offset=offset, limit=limit)
        view = self.view()
        return [shown(r, view) for r in records], total

    def scheduler_note(self, job_id: str) -> str | None:
        return scheduler_note(self.view(), job_id)

    def history(self, job_id: str, since: int = 0) -> list[EpochRecord]:
        self.record(job_id)
        return self.store.history(job_id, since)

    def logs(self, job_id: str, since: int = 0, limit: int = 1000) -> list[LogLine]:
        self.record(job_id)
        return self.store.logs(job_id, since, limit)

    def nodes(self) -> list[NodeStatus]:
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
    def changed(self) -> None:
        """The store changed: the next /metrics read reads it again."""
        self._metric_cache = None

    def metric_snapshots(self) -> list[JobSnapshot]:
        """Live jobs and those that finished within the retention window, oldest first."""
        recs = self.store.live() + self.store.finished_since(
            self.clock() - self.metrics_retention_s
        )
        recs.sort(key=lambda r: (r.created_at, r.id))
        return [r.current_snapshot() for r in recs]

    def metric_state(self) -> MetricState:
        """:meth:`metric_snapshots`, each job's last epoch record (its held-out loss and
        metrics) and the job counts, read at most once per ``metrics_ttl_s``, so scrapes
        under load share one read instead of each queueing on the store."""
        now = time.monotonic()
        with self._metric_lock:
            cached = self._metric_cache
            if cached is not None and now - cached.read_at < self.metrics_ttl_s:
                return cached
            snaps = self.metric_snapshots()
            state = MetricState(
                read_at=now,
                snapshots=snaps,
                last_records=self.store.last_records(s.job_id for s in snaps),
                job_counts=self.job_counts(),
            )
            self._metric_cache = state
            return state

    def kept_metric_state(self) -> MetricState | None:
        """The state :meth:`metric_state` would return without reading the store, or None
        when it would read it. No I/O, no lock."""
        cached = self._metric_cache
        if cached is not None and time.monotonic() - cached.read_at < self.metrics_ttl_s:
            return cached
        return None

    def job_counts(self) -> dict[JobState, int]:
        return self.store.count_by_state()

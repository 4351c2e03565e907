"""``JobService``: submit, list, inspect, cancel, scale, drain and resume jobs; keep the store
in step with Ray. What ``api/``, the CLI and the tests call.

The service is a facade over its parts, each in a module of its own:

- :mod:`~dynabatch.service.commands`: submit, cancel, scale, drain, resume;
- :mod:`~dynabatch.service.registry`: every write to the jobs' stored state, each move
  checked against the lifecycle by the store;
- :mod:`~dynabatch.service.reconciler`: the sync loop, the re-attach on start and the
  recovery of a lost coordinator (the pure policy in
  :mod:`dynabatch.scheduler.core.recovery`: resume from the checkpoint or fail);
- :mod:`~dynabatch.service.reads`: the read model (get, list, history, logs, nodes, the
  job state /metrics exports);
- :mod:`~dynabatch.service.launch_checks`: whether a spec may be launched;
- :mod:`~dynabatch.service.scheduler_link`: the cluster scheduler, when it is on.

Every Ray call goes through a :class:`~dynabatch.service.cluster_client.ClusterClient`, so
routes and this service run against ``tests.fakes.FakeCluster`` as well as the real
:class:`dynabatch.service.ray_client.RayClusterClient`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.cluster.view import ClusterView
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.telemetry import EpochRecord, LogLine
from dynabatch.service.cluster_client import ClusterClient, NodeStatus
from dynabatch.service.commands import JobCommands
from dynabatch.service.reads import JobReads, MetricState
from dynabatch.service.reconciler import EMBEDDED_ENDED, Reconciler
from dynabatch.service.registry import JobRegistry
from dynabatch.service.scheduler_link import SchedulerLink
from dynabatch.service.scheduling import Scheduling
from dynabatch.service.store import EMBEDDED_CLUSTER, JobRecord, JobStore
from dynabatch.service.submit_policy import SubmitPolicy

__all__ = ["EMBEDDED_ENDED", "JOB_ID_PATTERN", "WORKER_ID_PATTERN", "JobService", "MetricState"]

JOB_ID_PATTERN = r"^[0-9a-f]{12}$"
WORKER_ID_PATTERN = r"^w[0-9]{1,6}$"
AUTO_RESUME_LIMIT = 3


class JobService:
    """Jobs on one Ray cluster, kept in one store (see the module docstring)."""

    def __init__(
        self,
        store: JobStore,
        cluster: ClusterClient,
        *,
        sync_interval_s: float = 1.0,
        metrics_retention_s: float = 3600.0,
        release_finished: bool = True,
        cancel_wait_s: float = 5.0,
        auto_resume_limit: int = AUTO_RESUME_LIMIT,
        submit_policy: SubmitPolicy | None = None,
        clock: Callable[[], float] = time.time,
        scheduling: Scheduling | None = None,
    ):
        self.store = store
        self.cluster = cluster
        self.cancel_wait_s = cancel_wait_s
        # What specs may name (user code, paths). The default allows nothing.
        self.submit_policy = submit_policy if submit_policy is not None else SubmitPolicy()
        self.clock = clock
        # The cluster scheduler (None: off, every job is launched at once).
        self.scheduling = scheduling
        self.link = None if scheduling is None else SchedulerLink(scheduling, cluster)
        # Looked up at each read, so a test may stand in a round of its own.
        self.reads = JobReads(
            store,
            cluster,
            view=lambda: self.cluster_view(),
            clock=clock,
            metrics_retention_s=metrics_retention_s,
            metrics_ttl_s=min(sync_interval_s, 1.0),
        )
        self.registry = JobRegistry(
            store, cluster_name=self._cluster_name, clock=clock, on_change=self.reads.changed
        )
        self.reconciler = Reconciler(
            self.registry,
            cluster,
            self.link,
            sync_interval_s=sync_interval_s,
            release_finished=release_finished,
            auto_resume_limit=auto_resume_limit,
            submit_policy=self.submit_policy,
        )
        self.commands = JobCommands(
            self.registry,
            self.reads,
            self.reconciler,
            cluster,
            scheduling,
            self.link,
            submit_policy=self.submit_policy,
            cancel_wait_s=cancel_wait_s,
        )

    def _cluster_name(self) -> str:
        """Where this service starts coordinators, as stored with each job."""
        return EMBEDDED_CLUSTER if self.cluster.embedded else self.cluster.address

    # Lifecycle and sync (the reconciler) ------------------------------------------------
    def start(self) -> None:
        """Re-attach jobs left live by an earlier process, then start the sync loop."""
        self.reconciler.start()

    def begin_shutdown(self) -> None:
        """``serve`` got SIGTERM or SIGINT (see :meth:`Reconciler.begin_shutdown`)."""
        self.reconciler.begin_shutdown()

    def stop(self) -> None:
        """Stop the sync loop. In embedded mode, live jobs end with Ray: those with a
        checkpoint stay live (PENDING) to be resumed when the API starts again; the others
        are marked FAILED."""
        self.reconciler.stop()

    def interrupt_live(self) -> None:
        self.reconciler.interrupt_live()

    @property
    def ready(self) -> bool:
        return self.cluster.ping()

    @property
    def alive_nodes(self) -> int | None:
        return self.reconciler.alive_nodes

    # Commands (service/commands.py) ----------------------------------------------------
    def submit(self, spec: JobSpec) -> JobRecord:
        """Store the job and start its coordinator (:meth:`JobCommands.submit`)."""
        return self.commands.submit(spec)

    def cancel(self, job_id: str, reason: str = "cancelled by user") -> JobRecord:
        """Cancel a live job (:meth:`JobCommands.cancel`)."""
        return self.commands.cancel(job_id, reason)

    def scale(self, job_id: str, workers: int) -> JobRecord:
        """Run the job with exactly ``workers`` workers (:meth:`JobCommands.scale`)."""
        return self.commands.scale(job_id, workers)

    def drain(self, job_id: str, worker: str) -> JobRecord:
        """Remove ``worker`` from the job (:meth:`JobCommands.drain`)."""
        return self.commands.drain(job_id, worker)

    def resume(self, job_id: str) -> JobRecord:
        """Start a new coordinator for the job from its checkpoint
        (:meth:`JobCommands.resume`)."""
        return self.commands.resume(job_id)

    # Queries (the read model) -----------------------------------------------------------
    def get(self, job_id: str) -> JobRecord:
        """The job as every view shows it: a live job has the cluster scheduler's word on
        it (:meth:`scheduler_note`: the queue's reason, what a scale waits for)."""
        return self.reads.get(job_id)

    def list(
        self, state: JobState | None = None, *, offset: int = 0, limit: int = 50
    ) -> tuple[list[JobRecord], int]:
        return self.reads.list(state, offset=offset, limit=limit)

    def cluster_view(self) -> ClusterView | None:
        """The cluster scheduler's last round; None when no scheduler runs. Answers from
        what the service keeps, without I/O: the job views' caches ask it on the event
        loop (api/cached.py)."""
        return None if self.scheduling is None else self.scheduling.view()

    def scheduler_note(self, job_id: str) -> str | None:
        """The cluster scheduler's word on the job
        (:func:`~dynabatch.service.cluster_schemas.scheduler_note`); None when it has none.
        No I/O."""
        return self.reads.scheduler_note(job_id)

    def history(self, job_id: str, since: int = 0) -> list[EpochRecord]:
        return self.reads.history(job_id, since)

    def logs(self, job_id: str, since: int = 0, limit: int = 1000) -> list[LogLine]:
        return self.reads.logs(job_id, since, limit)

    def nodes(self) -> list[NodeStatus]:
        """Ray's nodes, each with the live jobs whose workers it hosts."""
        return self.reads.nodes()

    def metric_state(self) -> MetricState:
        """What /metrics exports (:meth:`JobReads.metric_state`)."""
        return self.reads.metric_state()

    def kept_metric_state(self) -> MetricState | None:
        return self.reads.kept_metric_state()

    @property
    def metrics_ttl_s(self) -> float:
        """How long one read of the metrics' job state serves (0: every scrape reads)."""
        return self.reads.metrics_ttl_s

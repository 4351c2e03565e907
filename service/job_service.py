"""``JobService``: submit, list, inspect, cancel, scale, drain and resume jobs.

Each command holds the reconciler's lock, so that no sync of the job interleaves, while it
calls the job's coordinator (or the cluster scheduler) and records the outcome in the store.
Every view of the jobs is read from the store, never from Ray.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace

from dynabatch.actors.errors import first_line
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.cluster.ray_nodes import RayNode, gang_error
from dynabatch.scheduler.core.cluster.view import ClusterView
from dynabatch.scheduler.core.lifecycle import InvalidTransition, JobState
from dynabatch.scheduler.core.membership import scale_error
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine
from dynabatch.service.cluster_client import NodeJob, NodeStatus
from dynabatch.service.cluster_schemas import GRANTED, scheduler_note
from dynabatch.service.ray_client import RayClusterClient
from dynabatch.service.reconciler import (
    Reconciler,
    SchedulerLink,
    checkpoint_exists,
    relaunch_refusal,
)
from dynabatch.service.scheduling import RayScheduling, Refused
from dynabatch.service.service_errors import (
    ClusterUnavailable,
    CoordinatorGone,
    InvalidRequest,
    JobConflict,
    JobNotFound,
    RayCallError,
    WorkerNotFound,
    already_finished,
    job_finished,
)
from dynabatch.service.settings import Settings
from dynabatch.service.store import QUEUED, STARTING, JobRecord, JobStore
from dynabatch.service.submit_policy import SpecNotAllowed, check_submission

log = logging.getLogger("dynabatch.service")

JOB_ID_PATTERN = r"^[0-9a-f]{12}$"
WORKER_ID_PATTERN = r"^w[0-9]{1,6}$"


def shown(rec: JobRecord, view: ClusterView | None) -> JobRecord:
    """``rec`` with the cluster scheduler's word on it (:func:`scheduler_note`) while it is
    live."""
    if rec.state.is_terminal:
        return rec
    why = scheduler_note(view, rec.id)
    if why is None or why == rec.reason:
        return rec
    if rec.state != JobState.PENDING and why.startswith(GRANTED.split("{", 1)[0]):
        return rec  # it runs: its own report says so until the scheduler has heard it
    return replace(rec, reason=why)


def min_workers_problem(spec: JobSpec, nodes: Sequence[NodeStatus]) -> str | None:
    """Why no set of the alive ``nodes`` can ever hold the job's ``min_workers`` together
    (such a job would wait in the queue for ever), or None: the cluster scheduler's worker
    slots (:func:`gang_error`) and what Ray can place on each node (:func:`capacity_problem`)."""
    need = spec.min_workers
    alive = [n for n in nodes if n.alive]
    if need is None or not alive:
        return None
    problem = gang_error(
        [RayNode(n.node_id, n.resources) for n in alive],
        need,
        spec.node_resource,
        worker_cpus=spec.worker_cpus,
        worker_gpus=spec.worker_gpus,
    )
    if problem:
        return problem
    short = capacity_problem(spec, alive, need)
    return f"min_workers {need}: {short}; the job could never start" if short else None


def capacity_problem(spec: JobSpec, nodes: Sequence[NodeStatus], workers: int) -> str | None:
    """Why the alive ``nodes`` could never hold ``workers`` of the job's workers at once
    (:meth:`JobSpec.workers_on`), or None."""
    alive = [n for n in nodes if n.alive]
    if not alive:
        return None
    held = sum(spec.workers_on(n.resources) for n in alive)
    if held >= workers:
        return None
    each = f"{spec.worker_cpus:g} CPU"
    if spec.worker_gpus == "auto" or spec.worker_gpus > 0:
        each += f", {spec.worker_gpus} GPU"
    if spec.node_resource:
        each += f", node_resource {spec.node_resource!r}"
    return (
        f"the cluster's {len(alive)} alive nodes hold {held} of this job's workers ({each} "
        "each)"
    )


class JobService:
    """Jobs on one Ray cluster, kept in one store (see the module docstring)."""

    def __init__(
        self,
        store: JobStore,
        cluster: RayClusterClient,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        scheduling: RayScheduling | None = None,
    ):
        self.store = store
        self.cluster = cluster
        self.settings = settings
        # What specs may name (user code, paths). The default allows nothing.
        self.submit_policy = settings.submit_policy
        self.clock = clock
        # The cluster scheduler (None: off, every job is launched at once).
        self.scheduling = scheduling
        self.link = None if scheduling is None else SchedulerLink(scheduling, cluster)
        # How long one /metrics render serves.
        self.metrics_ttl_s = min(settings.sync_interval_s, 1.0)
        self.reconciler = Reconciler(store, cluster, self.link, settings, clock=clock)

    # Commands ---------------------------------------------------------------------------
    def submit(self, spec: JobSpec) -> JobRecord:
        """Store the job and start its coordinator (or queue it with the cluster scheduler).
        A refused spec stores nothing; a launch that fails leaves the job FAILED."""
        problems = check_submission(spec, self.submit_policy)
        if problems:
            raise SpecNotAllowed(problems)
        # No set of the cluster's alive nodes could ever hold its min_workers (422).
        if spec.min_workers is not None and (
                problem := min_workers_problem(spec, self._nodes("min_workers"))):
            raise InvalidRequest("min_workers", problem)
        if self.link is not None:
            try:  # why the scheduler could never place it: one line, the field first
                why = self.scheduling.admissible(spec)
            except RayCallError as err:  # it cannot be asked now: not refused for that
                log.warning("cannot ask the cluster scheduler about a new job: %s", err)
                why = None
            if why:
                raise InvalidRequest(why.split(" ", 1)[0], why)
        job_id = uuid.uuid4().hex[:12]
        with self.reconciler.launching(job_id):
            rec = self.store.create(
                job_id, spec, cluster=self.reconciler.cluster_name(), now=self.clock(),
                reason=STARTING if self.link is None else QUEUED,
            )
            try:
                if self.link is not None:
                    self.link.register(rec)  # queued: started on the nodes it is granted
                else:
                    self.cluster.launch(job_id, spec)
            except Refused as err:  # the cluster changed since the check above
                why = f"refused by the cluster scheduler: {err}"
                return self.reconciler.fail(job_id, why) or rec
            except RayCallError as err:
                failed = self.reconciler.fail(
                    job_id, f"could not start the job's coordinator: {first_line(err, typed=False)}"
                )
                if isinstance(err, ClusterUnavailable):
                    raise  # Ray is not reachable (503): the job is stored FAILED
                return failed or rec
        log.info("job %s (%s) submitted", job_id, spec.name)
        return rec

    def _nodes(self, what: str) -> list[NodeStatus]:
        """Ray's nodes, to check ``what`` against; none (nothing is refused for them) when
        Ray cannot list them now."""
        try:
            return self.cluster.nodes()
        except RayCallError as err:
            log.warning("cannot list Ray nodes to check %s: %s", what, err)
            return []

    def cancel(self, job_id: str, reason: str = "cancelled by user") -> JobRecord:
        """Cancel a live job; waits up to ``cancel_wait_s`` for its coordinator to stop at
        its next step boundary, so the answer is usually the final CANCELLED state."""
        with self.reconciler.lock:
            rec = self.record(job_id)
            if rec.state.is_terminal:
                raise already_finished(rec.state, job_id)
            if self.link is not None and job_id not in self.link.started:
                self.link.finished(job_id)  # still queued: it leaves the queue unstarted
            try:
                snap = self.cluster.cancel(job_id, reason)
            except CoordinatorGone:
                if self.link is not None:  # queued (as of a stale answer): it leaves now
                    self.link.finished(job_id)
                return self.store.transition(job_id, JobState.CANCELLED, reason, now=self.clock())
            except InvalidTransition:
                # It finished between our read and the coordinator's; report what it is.
                done = self.reconciler.sync_job(job_id) or rec
                raise already_finished(done.state, job_id) from None
            log.info("job %s: cancel requested (%s)", job_id, reason)
        deadline = time.monotonic() + self.settings.cancel_wait_s
        while not snap.state.is_terminal and time.monotonic() < deadline:
            time.sleep(0.1)
            try:
                snap = self.cluster.snapshot(job_id)
            except RayCallError:
                break
        return self.reconciler.sync_job(job_id, snapshot=snap) or rec

    def _live_record(self, job_id: str, done: str) -> JobRecord:
        """The job's record; :class:`JobConflict` (409, "a finished job cannot be
        ``done``") when it finished."""
        rec = self.record(job_id)
        if rec.state.is_terminal:
            raise job_finished(rec.state, job_id, f"a finished job cannot be {done}")
        return rec

    def _membership_call(self, rec: JobRecord, call: Callable[[], JobSnapshot],
                         done: str) -> JobSnapshot:
        """Run a scale or drain call on the job's coordinator. A coordinator that finished
        meanwhile is a 409 with the state it finished in."""
        try:
            return call()
        except InvalidTransition:
            ended = self.reconciler.sync_job(rec.id) or rec
            why = f"a finished job cannot be {done}"
            raise job_finished(ended.state, rec.id, why) from None

    def scale(self, job_id: str, workers: int) -> JobRecord:
        """Run the job with exactly ``workers`` workers from its next step boundary on."""
        with self.reconciler.lock:
            rec = self._live_record(job_id, "scaled")
            spec = rec.spec
            problem = scale_error(workers, *spec.batch_range, spec.max_batch)
            if problem:
                raise InvalidRequest("workers", problem)
            if self.scheduling is not None:
                # A request to the cluster scheduler, answered at once (not held): the job's
                # bounds become at most ``workers``; what it still waits for is its status's.
                try:
                    answer = self.scheduling.request_scale(job_id, workers)
                except Refused as err:
                    raise JobConflict(str(err)) from None
                self.store.set_target_workers(job_id, workers)
                log.info("job %s: %s", job_id, answer)
                return self.store.get(job_id) or rec
            # The cluster's alive nodes could never hold that many of its workers (409; the
            # cluster scheduler refuses the same scale with the same words).
            problem = capacity_problem(spec, self._nodes("a scale"), workers)
            if problem:
                raise JobConflict(f"scale to {workers}: above the cluster's capacity: {problem}")
            try:
                snap = self._membership_call(
                    rec, lambda: self.cluster.scale(job_id, workers), "scaled")
            except CoordinatorGone as err:
                # The size holds for the coordinator that resumes the job (if it can be).
                self.store.set_target_workers(job_id, workers)
                done = self.reconciler.coordinator_lost(rec, Reconciler.died(err))
                if done is None or done.state.is_terminal:
                    raise job_finished(
                        done.state if done else JobState.FAILED, job_id,
                        "a finished job cannot be scaled"
                    ) from None
                return done
            self.store.set_target_workers(job_id, workers)
            log.info("job %s: scale to %d workers requested", job_id, workers)
            return self.reconciler.sync_job(job_id, snapshot=snap) or rec

    def _scheduled_drain(self, rec: JobRecord, worker: str) -> JobRecord:
        """With the cluster scheduler on, a drain is a request to it: the job gives up the
        worker's slot on its node (that worker leaves: a synchronous job's worker or a
        parameter-server job's learner, by the same placement rule) and its max_workers
        drops by one."""
        try:
            snap = self._membership_call(
                rec, lambda: self.cluster.snapshot(rec.id), "drained")
        except CoordinatorGone:  # queued (nothing runs yet), or lost: the sync loop sees to it
            raise WorkerNotFound(
                f"worker {worker!r} is not a member of job {rec.id}: it has no running coordinator"
            ) from None
        member = next((w for w in snap.workers if w.worker == worker), None)
        if member is None:
            raise WorkerNotFound(f"worker {worker!r} is not a member of job {rec.id}")
        # Its workers less those already leaving (a drained worker is listed until its step
        # boundary): the size last asked for bounds them.
        staying = len(snap.workers)
        if rec.target_workers is not None:
            staying = min(staying, rec.target_workers)
        if staying <= 1:  # the driver's own words, as without the scheduler
            raise JobConflict(
                f"cannot drain the last worker ({worker}) of job {rec.id}: cancel the job to "
                "stop it"
            )
        try:
            answer = self.scheduling.request_drain(rec.id, member.node, worker)
        except Refused as err:
            raise JobConflict(str(err)) from None
        self.store.set_target_workers(rec.id, staying - 1)
        log.info("job %s: drain of %s: %s", rec.id, worker, answer)
        return self.reconciler.sync_job(rec.id, snapshot=snap) or rec

    def drain(self, job_id: str, worker: str) -> JobRecord:
        """Remove ``worker`` from the job at its next step boundary (its share of the epoch
        goes to the others)."""
        with self.reconciler.lock:
            rec = self._live_record(job_id, "drained")
            if self.scheduling is not None:
                return self._scheduled_drain(rec, worker)
            try:
                snap = self._membership_call(
                    rec, lambda: self.cluster.drain(job_id, worker), "drained")
            except CoordinatorGone as err:
                done = self.reconciler.coordinator_lost(rec, Reconciler.died(err))
                what = "it is being resumed" if done and not done.state.is_terminal else "it failed"
                raise WorkerNotFound(
                    f"worker {worker!r} is not a member of job {job_id}: the job's coordinator "
                    f"was lost and its workers with it ({what})"
                ) from None
            # The size a resumed coordinator starts with. The drained worker may be listed
            # until the step boundary, and so may others drained before it: the size last
            # asked for, less one, is then the smaller number.
            others = sum(1 for w in snap.workers if w.worker != worker)
            if rec.target_workers is not None:
                others = min(others, rec.target_workers - 1)
            self.store.set_target_workers(job_id, max(1, others))
            log.info("job %s: drain of %s requested", job_id, worker)
            return self.reconciler.sync_job(job_id, snapshot=snap) or rec

    def resume(self, job_id: str) -> JobRecord:
        """Start a new coordinator for a FAILED or CANCELLED job (a cancel writes a
        checkpoint where it stopped), or a live one whose coordinator is gone, from its
        checkpoint."""
        with self.reconciler.lock:
            rec = self.record(job_id)
            if not rec.state.can_resume:
                raise job_finished(
                    rec.state, job_id, "a job that succeeded cannot be resumed (only a FAILED "
                    "or CANCELLED job, or a live one whose coordinator is gone, can be)")
            alive = self.cluster.find(job_id, rec.resumes)
            if alive and not rec.state.is_terminal:
                raise JobConflict(
                    f"job is {rec.state.value} and its coordinator is alive: nothing to resume"
                )
            if not rec.spec.checkpoint.dir:
                raise JobConflict(
                    f"job {job_id} has no checkpoint.dir in its spec: nothing to resume from"
                )
            if not checkpoint_exists(rec):
                raise JobConflict(
                    f"job {job_id} has no checkpoint yet in {rec.spec.checkpoint.dir}"
                )
            refused = relaunch_refusal(rec.spec, self.submit_policy)
            if refused:
                raise JobConflict(f"job {job_id} cannot be resumed: {refused}")
            if alive:
                # The finished job's coordinator was kept (release_finished off, or the
                # release failed): it goes. The new one has a name of its own (the next
                # generation), so nothing waits for Ray to free the old one's.
                self.cluster.release(job_id)
            was = f"job was {rec.state.value}" + (f" ({rec.reason})" if rec.reason else "")
            try:
                rec = self.reconciler.relaunch(rec, f"resume requested; {was}", automatic=False)
            except Refused as err:  # the job is left FAILED with the same reason
                raise JobConflict(f"job {job_id} cannot be resumed: {err}") from None
            log.info("job %s: resumed on request", job_id)
            return rec

    # Reads ------------------------------------------------------------------------------
    def record(self, job_id: str) -> JobRecord:
        """The job as stored; raises :class:`JobNotFound` (404) for an unknown id."""
        rec = self.store.get(job_id)
        if rec is None:
            raise JobNotFound(job_id)
        return rec

    def get(self, job_id: str) -> JobRecord:
        return shown(self.record(job_id), self.cluster_view())

    def list(
        self, state: JobState | None = None, *, offset: int = 0, limit: int = 50
    ) -> tuple[list[JobRecord], int]:
        records, total = self.store.list(state, offset=offset, limit=limit)
        view = self.cluster_view()
        return [shown(r, view) for r in records], total

    def cluster_view(self) -> ClusterView | None:
        """The cluster scheduler's last round (None: no scheduler), without I/O: the job
        views' caches ask it on the event loop."""
        return None if self.scheduling is None else self.scheduling.view()

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


def build_service(settings: Settings, cluster: RayClusterClient | None = None) -> JobService:
    """The JobService the settings describe: SQLite store and (by default) Ray."""
    if cluster is None:
        cluster = RayClusterClient(
            settings.ray_address,
            num_cpus=settings.ray_num_cpus,
            call_timeout_s=settings.ray_call_timeout_s,
        )
    scheduling = cluster.scheduling(settings) if settings.cluster_scheduler else None
    return JobService(JobStore(settings.db_path), cluster, settings, scheduling=scheduling)

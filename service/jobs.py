"""``JobService``: submit, list, inspect, cancel, scale, drain and resume jobs; keep the store
in step with Ray.

Every Ray call goes through a :class:`~dynabatch.service.cluster_client.ClusterClient`, so
routes and this service run against
``tests.fakes.FakeCluster`` as well as the real
:class:`dynabatch.service.ray_client.RayClusterClient`.

Reads (get, list, history, logs, metrics) come from the store. A background sync loop polls
each live job's coordinator (snapshot, new epochs, new log lines) into the store, and releases
a finished job's detached coordinator once its results are stored.

A coordinator found dead is *resumed*: when the job's spec has ``checkpoint.dir`` and its
checkpoint file exists, a new coordinator for the same job id starts from it. Without a
checkpoint the job becomes FAILED with the reason. Each coordinator of a job is a generation
with an actor name of its own (the store's count of resumes), so a resume never waits for
Ray to free a dead coordinator's name. ``auto_resume_limit`` bounds the automatic
resumes since the job last finished an epoch (or was resumed on request): a job that keeps
losing its coordinator but makes progress is resumed each time; one that crash-loops ends
FAILED with the reason. On start, jobs left live by an earlier API process are re-attached by
name, or resumed the same way when their coordinator is gone (in embedded mode their Ray ended
with that process); the rest are marked FAILED instead of being forgotten. ``resume()`` does
it on request, also for a FAILED or CANCELLED job.

Specs come from REST clients: ``submit`` refuses
(:class:`dynabatch.service.submit_policy.SpecNotAllowed`, 422, nothing stored) one that names
user code, a dataset path or a checkpoint dir that ``submit_policy`` (from the settings) does
not allow, and every relaunch of a stored spec is checked again, so settings tightened since
the job was stored hold too.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from dynabatch.actors.errors import first_line
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.cluster.nodes import RayNode, gang_error
from dynabatch.scheduler.core.cluster.view import ClusterView
from dynabatch.scheduler.core.lifecycle import InvalidTransition, JobState
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine
from dynabatch.service.cluster_client import ClusterClient, ClusterNode, NodeJob
from dynabatch.service.cluster_schemas import queue_reason
from dynabatch.service.errors import (
    AlreadyFinished,
    ClusterUnavailable,
    CoordinatorGone,
    InvalidRequest,
    JobConflict,
    JobNotFound,
    RayCallError,
    WorkerNotFound,
)
from dynabatch.service.scheduling import Refused, Scheduling
from dynabatch.service.store import EMBEDDED_CLUSTER, JobRecord, JobStore
from dynabatch.service.submit_policy import SpecNotAllowed, SubmitPolicy, check_submission

log = logging.getLogger("dynabatch.service")

JOB_ID_PATTERN = r"^[0-9a-f]{12}$"
WORKER_ID_PATTERN = r"^w[0-9]{1,6}$"
EMBEDDED_ENDED = "the embedded Ray cluster ended with the API process"
AUTO_RESUME_LIMIT = 3
STOP_JOIN_S = 1.0  # how long stop() waits for a sync tick in progress
# With an embedded Ray, a coordinator found gone may be the process going down: a signal to
# the whole process group (systemd, `kill -- -PGID`) ends Ray's processes at the same
# instant as this one, and the sync loop can see the coordinator dead before the signal
# handler has run. It waits this long for the shutdown to begin before calling it a loss.
EMBEDDED_GONE_WAIT_S = 0.5


def _reachable(cluster: object) -> bool:
    """Whether the cluster answers now, by its bounded check when it has one."""
    check = getattr(cluster, "reachable", None)
    return bool(check()) if callable(check) else True


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


def min_workers_problem(spec: JobSpec, nodes: Sequence[ClusterNode]) -> str | None:
    """Why no set of the alive ``nodes`` can ever hold the job's ``min_workers`` together,
    or None when they can (or the spec sets no minimum, or no node is listed). Two limits:
    the cluster scheduler's worker slots (:func:`gang_error`, what it can grant) and what
    each node's resources hold of this job's workers (:meth:`JobSpec.workers_on`, what Ray
    can place: a GPU job on CPU nodes, workers of several CPUs). Such a job would only wait
    in the queue for ever."""
    need = spec.min_workers
    alive = [n for n in nodes if n.alive]
    if need is None or not alive:
        return None
    problem = gang_error([RayNode(n.node_id, n.resources) for n in alive], need,
                         spec.node_resource)
    if problem:
        return problem
    held = sum(spec.workers_on(n.resources) for n in alive)
    if held >= need:
        return None
    each = f"{spec.worker_cpus:g} CPU"
    if spec.worker_gpus == "auto" or spec.worker_gpus > 0:
        each += f", {spec.worker_gpus} GPU"
    if spec.node_resource:
        each += f", node_resource {spec.node_resource!r}"
    return (
        f"min_workers {need}: the cluster's {len(alive)} alive nodes hold {held} of this "
        f"job's workers ({each} each); the job could never start"
    )


@dataclass(frozen=True)
class MetricState:
    """One read of the job state /metrics exports (:meth:`JobService.metric_state`)."""

    read_at: float
    snapshots: list[JobSnapshot]
    last_records: dict[str, EpochRecord]
    job_counts: dict[JobState, int]


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
        auto_resume_limit: int = AUTO_RESUME_LIMIT,
        submit_policy: SubmitPolicy | None = None,
        clock: Callable[[], float] = time.time,
        scheduling: Scheduling | None = None,
    ):
        self.store = store
        self.cluster = cluster
        self.sync_interval_s = sync_interval_s
        self.metrics_retention_s = metrics_retention_s
        self.release_finished = release_finished
        self.cancel_wait_s = cancel_wait_s
        self.auto_resume_limit = auto_resume_limit
        # What specs may name (user code, paths). The default allows nothing.
        self.submit_policy = submit_policy if submit_policy is not None else SubmitPolicy()
        self.clock = clock
        self._sync_lock = threading.RLock()
        self._stop = threading.Event()
        self._ending = threading.Event()  # the process is going down (begin_shutdown)
        self._thread: threading.Thread | None = None
        self._alive_nodes: int | None = None
        self._started = False
        # Jobs stored but not yet launched: the sync loop must not take the missing
        # coordinator for a dead one.
        self._launching: set[str] = set()
        self._launching_lock = threading.Lock()
        # /metrics reads (metric_state): kept for one sync interval.
        self._metric_lock = threading.Lock()
        self._metric_cache: MetricState | None = None
        self._metric_ttl_s = min(sync_interval_s, 1.0)
        # The cluster scheduler (None: off, every job is launched at once). With it on, a
        # job is registered and its coordinator started by the scheduler once granted;
        # until then the job has no coordinator to poll (``_scheduled``: the jobs it
        # started, as of the last sync with it).
        self.scheduling = scheduling
        self._scheduled: set[str] = set()

    # Lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Re-attach jobs left live by an earlier process, then start the sync loop."""
        self._ending.clear()
        self.reattach()
        self._started = True
        if self.sync_interval_s > 0:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="dynabatch-sync", daemon=True)
            self._thread.start()

    def begin_shutdown(self) -> None:
        """The process is going down (``serve`` got SIGTERM or SIGINT): with an embedded
        Ray, a coordinator found gone from now on went with it (recorded by
        :meth:`interrupt_live`), not on its own. Safe from a signal handler."""
        self._ending.set()

    def stop(self) -> None:
        """Stop the sync loop. In embedded mode, live jobs end with Ray: those with a
        checkpoint stay live (PENDING) to be resumed when the API starts again; the others
        are marked FAILED."""
        self._ending.set()
        self._stop.set()
        if self._thread is not None:
            # A tick blocked on a Ray that is gone must not hold the shutdown long: the loop
            # is a daemon thread and checks the stop flag between jobs.
            self._thread.join(timeout=STOP_JOIN_S)
            self._thread = None
        if self._started and self.cluster.embedded:
            if _reachable(self.cluster):
                self.sync_once()
            else:
                log.warning("the embedded Ray is gone: live jobs are recorded as they were")
            self.interrupt_live()
        self._started = False

    def interrupt_live(self) -> None:
        """Record the end of the embedded Ray in every live job: those with a checkpoint
        stay live (PENDING) to be resumed when the API starts again, the others FAIL. Store
        writes only: safe when Ray is gone, and from another thread."""
        for rec in self.store.live():
            if self.auto_resume_limit > 0 and self.checkpoint_exists(rec):
                self._changed()
                self.store.interrupt(
                    rec.id,
                    f"{EMBEDDED_ENDED}; the job resumes from its checkpoint when the "
                    "API starts again",
                    now=self.clock(),
                )
            else:
                self._fail(rec.id, EMBEDDED_ENDED)

    @property
    def ready(self) -> bool:
        return self.cluster.ping()

    def reattach(self) -> list[str]:
        """Find the coordinators of jobs the store says are live; returns the ids found.

        A job whose coordinator is gone is resumed from its checkpoint when it has one
        (see :meth:`_coordinator_lost`), and marked FAILED otherwise.
        """
        found = []
        queued = self._queued_now()
        for rec in self.store.live():
            if rec.id in queued:
                continue  # the cluster scheduler has not started it: nothing to re-attach
            if rec.cluster == EMBEDDED_CLUSTER or self.cluster.embedded:
                if rec.cluster != EMBEDDED_CLUSTER:
                    # Its own cluster may still be running it: never start a second copy.
                    self._fail(
                        rec.id,
                        f"the API restarted with an embedded Ray; the job's cluster "
                        f"({rec.cluster}) is no longer attached",
                    )
                    continue
                with self._sync_lock:
                    self._coordinator_lost(rec, EMBEDDED_ENDED)
                continue
            try:
                ok = self.cluster.find(rec.id, rec.resumes)
            except ClusterUnavailable as err:
                log.warning("job %s: cannot re-attach yet (%s); will retry", rec.id, err)
                continue
            except RayCallError as err:
                ok, why = False, str(err)
            else:
                why = "no coordinator actor on the Ray cluster after the API restarted"
            if ok:
                log.info("job %s: re-attached to its coordinator", rec.id)
                found.append(rec.id)
            else:
                with self._sync_lock:
                    self._coordinator_lost(rec, f"lost while the API was down: {why}")
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
        queued = self._queued_now()
        for rec in self.store.live():
            if self._stop.is_set() and self._thread is not None:
                return
            with self._launching_lock:
                if rec.id in self._launching or rec.id in queued:
                    continue
            self.sync_job(rec.id)
        try:
            self._alive_nodes = sum(1 for n in self.cluster.nodes() if n.alive)
        except RayCallError as err:
            log.warning("cannot list Ray nodes: %s", err)
            self._alive_nodes = None

    def _queued_now(self) -> set[str]:
        """With the cluster scheduler on: tell it every live job (so a new scheduler
        rebuilds from the store and the live coordinators), and return the live jobs it
        has not started, which have no coordinator to poll yet. If it cannot be reached,
        the jobs it started as of the last sync are polled and the others wait."""
        if self.scheduling is None:
            return set()
        live = self.store.live()
        try:
            started = self.scheduling.sync(
                [(r.id, self._launch_spec(r), r.created_at, r.resumes) for r in live]
            )
        except RayCallError as err:
            log.warning("cannot sync with the cluster scheduler: %s", err)
            started = self._scheduled
        for rec in live:
            if rec.id in started and rec.id not in self._scheduled:
                try:  # later calls for the job go to the generation the scheduler started
                    self.cluster.find(rec.id, rec.resumes)
                except RayCallError as err:
                    log.warning("job %s: cannot find its coordinator yet (%s)", rec.id, err)
        self._scheduled = set(started)
        return {r.id for r in live if r.id not in started}

    def sync_job(self, job_id: str, snapshot: JobSnapshot | None = None) -> JobRecord | None:
        """Bring one job's stored state, history and logs up to date with its coordinator."""
        with self._sync_lock:
            rec = self.store.get(job_id)
            if rec is None or rec.state.is_terminal:
                return rec
            try:
                snap = snapshot if snapshot is not None else self.cluster.snapshot(job_id)
                last_epoch = None if rec.resync else self.store.last_epoch(job_id)
                records = self.cluster.history(job_id, 0 if last_epoch is None else last_epoch + 1)
                # The coordinator numbers its lines from 0; a resumed job's lines are stored
                # after the earlier coordinators' (log_offset).
                last_seq = self.store.last_log_seq(job_id)
                since = 0 if last_seq is None else max(0, last_seq + 1 - rec.log_offset)
                lines = self.cluster.logs(job_id, since)
            except CoordinatorGone as err:
                if self.cluster.embedded and self._ending.wait(EMBEDDED_GONE_WAIT_S):
                    return rec  # gone with this process's Ray: interrupt_live records it
                return self._coordinator_lost(
                    rec, f"the job's coordinator actor died: {first_line(err, typed=False)}"
                )
            except RayCallError as err:
                log.warning("job %s: sync failed (%s)", job_id, first_line(err, typed=False))
                return rec
            if rec.resync:
                self.store.replace_history(job_id, records)
            else:
                self.store.add_history(job_id, records)
                if records and rec.auto_resumes:
                    # A resumed job that finishes an epoch is not crash-looping.
                    self.store.reset_auto_resumes(job_id)
            if rec.log_offset:
                lines = [x.model_copy(update={"seq": x.seq + rec.log_offset}) for x in lines]
            self.store.add_logs(job_id, lines)
            self.store.save_snapshot(snap, now=self.clock())
            self._changed()
            if snap.state.is_terminal and self.scheduling is not None:
                try:  # its nodes go to the next job now, not at the next sync
                    self.scheduling.finished(job_id)
                except RayCallError as err:
                    log.warning("job %s: cannot tell the cluster scheduler (%s)", job_id, err)
            if snap.state.is_terminal and self.release_finished:
                try:
                    self.cluster.release(job_id)
                except RayCallError as err:
                    log.warning("job %s: cannot release coordinator (%s)", job_id, err)
            return self.store.get(job_id)

    # Resume -----------------------------------------------------------------------------
    def checkpoint_exists(self, rec: JobRecord) -> bool:
        """Whether the job's spec names a checkpoint dir and its checkpoint file is there.

        The API reads the file where the coordinator writes it: the same filesystem in
        embedded mode, the shared checkpoint volume in compose and k8s.
        """
        if not rec.spec.checkpoint.dir:
            return False
        from dynabatch.scheduler.checkpoint import (
            checkpoint_path,  # imports torch: only when needed
        )

        try:
            return checkpoint_path(rec.spec.checkpoint.dir, rec.id).is_file()
        except OSError:
            return False

    def _coordinator_lost(self, rec: JobRecord, why: str) -> JobRecord | None:
        """The live job ``rec``'s coordinator is gone: resume it from its checkpoint, or fail
        it with ``why`` when it has none or has been resumed too often in a row."""
        if not self.checkpoint_exists(rec):
            return self._fail(rec.id, why)
        refused = self._not_allowed(rec)
        if refused:
            return self._fail(rec.id, f"{why}; not resumed: {refused}")
        if self.auto_resume_limit <= 0:
            return self._fail(
                rec.id, f"{why}; automatic resume is off: it can be resumed from its checkpoint"
            )
        if rec.auto_resumes >= self.auto_resume_limit:
            return self._fail(
                rec.id,
                f"{why}; not resumed again: {rec.auto_resumes} automatic resumes without "
                f"finishing an epoch (limit {self.auto_resume_limit})",
            )
        attempt = f"automatic resume {rec.auto_resumes + 1} of {self.auto_resume_limit}"
        try:
            return self._relaunch(rec, f"{why}; resuming from its checkpoint ({attempt})", True)
        except RayCallError:
            return self.store.get(rec.id)  # _relaunch recorded the failure

    def _not_allowed(self, rec: JobRecord) -> str | None:
        """Why the stored spec of ``rec`` may not be launched again under this service's
        settings (stored by an earlier, more permissive one, say); None when it may."""
        problems = check_submission(rec.spec, self.submit_policy)
        if not problems:
            return None
        return f"its spec is not allowed by this service's settings ({SpecNotAllowed(problems)})"

    def _launch_spec(self, rec: JobRecord) -> JobSpec:
        """The spec a resumed coordinator starts with: the job's own, at the size last
        asked for with scale or drain (which the checkpoint does not hold)."""
        n = rec.target_workers
        spec = rec.spec
        if n is None or spec.workers == n:
            return spec
        update: dict[str, object] = {"workers": n, "max_workers": n}
        if spec.min_workers is not None and spec.min_workers > n:
            update["min_workers"] = n
        return spec.model_copy(update=update)

    def _relaunch(self, rec: JobRecord, reason: str, automatic: bool) -> JobRecord:
        """Start a new coordinator for ``rec`` (it picks up the checkpoint). A launch that
        fails leaves the job FAILED and re-raises the RayCallError.

        The new coordinator is the job's next generation (its count of resumes, which the
        store keeps, so that the service finds it again after a restart), under a name of
        its own: Ray may keep the old one's name taken for as long as it likes."""
        rec = self.store.mark_resumed(
            rec.id, reason, automatic=automatic, cluster=self._cluster_name(), now=self.clock()
        )
        self._changed()
        log.warning("job %s: %s", rec.id, reason)
        with self._launching_lock:
            self._launching.add(rec.id)
        try:
            if self.scheduling is not None:
                # The scheduler starts the next generation once its nodes are granted.
                self.scheduling.register(rec.id, self._launch_spec(rec), rec.created_at,
                                         rec.resumes)
                self._scheduled.discard(rec.id)
            else:
                self.cluster.launch(rec.id, self._launch_spec(rec), rec.resumes)
        except Refused as err:
            self._fail(rec.id, f"{reason}; not resumed: {err}")
            raise RayCallError(str(err)) from None
        except RayCallError as err:
            self._fail(rec.id, f"{reason}; could not start a new coordinator: "
                               f"{first_line(err, typed=False)}")
            raise
        finally:
            with self._launching_lock:
                self._launching.discard(rec.id)
        return rec

    def _cluster_name(self) -> str:
        """Where this service starts coordinators, as stored with each job."""
        return EMBEDDED_CLUSTER if self.cluster.embedded else self.cluster.address

    def _changed(self) -> None:
        """The store changed: the next /metrics scrape reads it again."""
        self._metric_cache = None

    def _fail(self, job_id: str, reason: str) -> JobRecord | None:
        self._changed()
        try:
            rec = self.store.transition(job_id, JobState.FAILED, reason, now=self.clock())
        except (KeyError, InvalidTransition):
            return self.store.get(job_id)
        log.warning("job %s: FAILED (%s)", job_id, reason)
        return rec

    # Commands ---------------------------------------------------------------------------
    def submit(self, spec: JobSpec) -> JobRecord:
        """Store the job and start its coordinator. A launch that fails leaves it FAILED.

        Raises :class:`SpecNotAllowed` (422; nothing is stored) when the spec names user code
        or paths that ``submit_policy`` does not allow, :class:`InvalidRequest` (422; nothing
        is stored) when no set of the cluster's nodes can hold its ``min_workers``,
        :class:`ClusterUnavailable` (after recording the failure) when Ray did not answer;
        other launch errors are the job's reason and the record is returned.
        """
        problems = check_submission(spec, self.submit_policy)
        if problems:
            raise SpecNotAllowed(problems)
        self._check_fits(spec)
        if self.scheduling is not None:
            why = self._scheduler_refusal(spec)
            if why:
                raise InvalidRequest(why.split(" ", 1)[0], why)
        job_id = new_job_id()
        cluster = self._cluster_name()
        with self._launching_lock:
            self._launching.add(job_id)
        try:
            rec = self.store.create(job_id, spec, cluster=cluster, now=self.clock())
            if self.scheduling is not None:
                # Queued: the scheduler starts its coordinator on the nodes it grants.
                self.scheduling.register(job_id, spec, rec.created_at, 0)
            else:
                self.cluster.launch(job_id, spec)
        except Refused as err:  # the cluster changed since the check above
            failed = self._fail(job_id, f"refused by the cluster scheduler: {err}")
            return failed or rec
        except ClusterUnavailable as err:
            self._fail(job_id, "could not start the job's coordinator: "
                               f"{first_line(err, typed=False)}")
            raise
        except RayCallError as err:
            failed = self._fail(
                job_id, f"could not start the job's coordinator: {first_line(err, typed=False)}"
            )
            return failed or rec
        finally:
            with self._launching_lock:
                self._launching.discard(job_id)
        self._changed()
        log.info("job %s (%s) submitted", job_id, spec.name)
        return rec

    def _scheduler_refusal(self, spec: JobSpec) -> str | None:
        """Why the cluster scheduler could never place this job (a one-line reason that
        starts with the field), or None; None too when it cannot be asked now."""
        try:
            return self.scheduling.admissible(spec)
        except RayCallError as err:
            log.warning("cannot ask the cluster scheduler about a new job: %s", err)
            return None

    def _check_fits(self, spec: JobSpec) -> None:
        """Refuse (:class:`InvalidRequest` on ``min_workers``, 422, nothing stored) a job
        whose ``min_workers`` no set of the cluster's alive nodes can hold. When Ray cannot
        list its nodes now, the job is not refused for it."""
        if spec.min_workers is None:
            return
        try:
            nodes = self.cluster.nodes()
        except RayCallError as err:
            log.warning("cannot list Ray nodes to check min_workers: %s", err)
            return
        problem = min_workers_problem(spec, nodes)
        if problem:
            raise InvalidRequest("min_workers", problem)

    def cancel(self, job_id: str, reason: str = "cancelled by user") -> JobRecord:
        """Cancel a live job. Raises :class:`AlreadyFinished` (an ``InvalidTransition``, 409)
        when it already ended.

        The coordinator stops at its next step boundary; this waits up to ``cancel_wait_s``
        for that, so the answer is usually the final CANCELLED state.
        """
        with self._sync_lock:
            rec = self._get_record(job_id)
            if rec.state.is_terminal:
                raise AlreadyFinished(rec.state, job_id)
            if self.scheduling is not None and job_id not in self._scheduled:
                try:  # still queued: it leaves the queue before it can be started
                    self.scheduling.finished(job_id)
                except RayCallError as err:
                    log.warning("job %s: cannot tell the cluster scheduler (%s)", job_id, err)
            try:
                snap = self.cluster.cancel(job_id, reason)
            except CoordinatorGone:
                self._changed()
                return self.store.transition(job_id, JobState.CANCELLED, reason, now=self.clock())
            except InvalidTransition:
                # It finished between our read and the coordinator's; report what it is.
                done = self.sync_job(job_id) or rec
                raise AlreadyFinished(done.state, job_id) from None
            log.info("job %s: cancel requested (%s)", job_id, reason)
        deadline = time.monotonic() + self.cancel_wait_s
        while not snap.state.is_terminal and time.monotonic() < deadline:
            time.sleep(0.1)
            try:
                snap = self.cluster.snapshot(job_id)
            except RayCallError:
                break
        return self.sync_job(job_id, snapshot=snap) or rec

    def _live_record(self, job_id: str) -> JobRecord:
        rec = self._get_record(job_id)
        if rec.state.is_terminal:
            raise InvalidTransition(rec.state, JobState.RUNNING)
        return rec

    def _membership_call(self, rec: JobRecord, call: Callable[[], JobSnapshot]) -> JobSnapshot:
        """Run a scale or drain call on the job's coordinator. A coordinator that finished
        meanwhile is a 409 with the state it finished in."""
        try:
            return call()
        except InvalidTransition:
            done = self.sync_job(rec.id) or rec
            raise InvalidTransition(done.state, JobState.RUNNING) from None

    def scale(self, job_id: str, workers: int) -> JobRecord:
        """Run the job with exactly ``workers`` workers from its next step boundary on.

        Raises ``InvalidTransition`` (409) when it finished, :class:`InvalidRequest` (422)
        when the job's global batch cannot be split that many ways.
        """
        with self._sync_lock:
            rec = self._live_record(job_id)
            spec = rec.spec
            smallest, largest = spec.batch_range  # a batch schedule trains several
            if workers > smallest:
                raise InvalidRequest(
                    "workers",
                    f"workers ({workers}) is above the job's global_batch ({smallest}): "
                    "every worker needs at least one sample per step",
                )
            if spec.max_batch is not None and spec.max_batch * workers < largest:
                raise InvalidRequest(
                    "workers",
                    f"{workers} workers with max_batch {spec.max_batch} cannot hold the job's "
                    f"global_batch ({largest})",
                )
            if self.scheduling is not None:
                return self._scheduled_scale(rec, workers)
            try:
                snap = self._membership_call(rec, lambda: self.cluster.scale(job_id, workers))
            except CoordinatorGone as err:
                # The size holds for the coordinator that resumes the job (if it can be).
                self.store.set_target_workers(job_id, workers)
                done = self._coordinator_lost(
                    rec, f"the job's coordinator actor died: {first_line(err, typed=False)}"
                )
                if done is None or done.state.is_terminal:
                    raise InvalidTransition(
                        done.state if done else JobState.FAILED, JobState.RUNNING
                    ) from None
                return done
            self.store.set_target_workers(job_id, workers)
            log.info("job %s: scale to %d workers requested", job_id, workers)
            return self.sync_job(job_id, snapshot=snap) or rec

    def _scheduled_scale(self, rec: JobRecord, workers: int) -> JobRecord:
        """With the cluster scheduler on, a scale is a request to it: recorded as the job's
        max_workers for its next round (:class:`JobConflict`, 409, when it refuses)."""
        try:
            answer = self.scheduling.request_scale(rec.id, workers)
        except Refused as err:
            raise JobConflict(str(err)) from None
        self.store.set_target_workers(rec.id, workers)
        log.info("job %s: %s", rec.id, answer)
        return self.store.get(rec.id) or rec

    def drain(self, job_id: str, worker: str) -> JobRecord:
        """Remove ``worker`` from the job at its next step boundary (gracefully: its share of
        the epoch goes to the others).

        Raises :class:`WorkerNotFound` (404), :class:`JobConflict` (409) for the job's last
        worker and ``InvalidTransition`` (409) when the job finished.
        """
        with self._sync_lock:
            rec = self._live_record(job_id)
            if self.scheduling is not None:
                raise JobConflict(self.scheduling.refuse_drain(job_id, worker))
            try:
                snap = self._membership_call(rec, lambda: self.cluster.drain(job_id, worker))
            except CoordinatorGone as err:
                done = self._coordinator_lost(
                    rec, f"the job's coordinator actor died: {first_line(err, typed=False)}"
                )
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
            return self.sync_job(job_id, snapshot=snap) or rec

    def resume(self, job_id: str) -> JobRecord:
        """Start a new coordinator for the job from its checkpoint.

        For a FAILED or CANCELLED job (a cancel writes a checkpoint where it stopped), or a
        live one whose coordinator is gone. Raises :class:`JobConflict` (409) for a job
        that SUCCEEDED, that has no checkpoint, or whose coordinator is alive;
        :class:`ClusterUnavailable` (503, after recording the failure) when Ray did not
        answer.
        """
        with self._sync_lock:
            rec = self._get_record(job_id)
            if not rec.state.can_resume:
                raise JobConflict(
                    f"job is {rec.state.value}; only a FAILED or CANCELLED job, or a live one "
                    "whose coordinator is gone, can be resumed"
                )
            alive = self.cluster.find(job_id, rec.resumes)
            if alive and not rec.state.is_terminal:
                raise JobConflict(
                    f"job is {rec.state.value} and its coordinator is alive: nothing to resume"
                )
            if not rec.spec.checkpoint.dir:
                raise JobConflict(
                    f"job {job_id} has no checkpoint.dir in its spec: nothing to resume from"
                )
            if not self.checkpoint_exists(rec):
                raise JobConflict(
                    f"job {job_id} has no checkpoint yet in {rec.spec.checkpoint.dir}"
                )
            refused = self._not_allowed(rec)
            if refused:
                raise JobConflict(f"job {job_id} cannot be resumed: {refused}")
            if alive:
                # The finished job's coordinator was kept (release_finished off, or the
                # release failed): it goes. The new one has a name of its own (the next
                # generation), so nothing waits for Ray to free the old one's.
                self.cluster.release(job_id)
            was = f"job was {rec.state.value}" + (f" ({rec.reason})" if rec.reason else "")
            rec = self._relaunch(rec, f"resume requested; {was}", automatic=False)
            log.info("job %s: resumed on request", job_id)
            return rec

    # Queries ----------------------------------------------------------------------------
    def _get_record(self, job_id: str) -> JobRecord:
        rec = self.store.get(job_id)
        if rec is None:
            raise JobNotFound(job_id)
        return rec

    def get(self, job_id: str) -> JobRecord:
        """The job as every view shows it: a job the cluster scheduler queues has the
        queue's reason (:meth:`queue_reason`)."""
        return self._shown(self._get_record(job_id), self.cluster_view())

    def list(
        self, state: JobState | None = None, *, offset: int = 0, limit: int = 50
    ) -> tuple[list[JobRecord], int]:
        records, total = self.store.list(state, offset=offset, limit=limit)
        view = self.cluster_view()
        return [self._shown(r, view) for r in records], total

    def cluster_view(self) -> ClusterView | None:
        """The cluster scheduler's last round; None when no scheduler runs. Answers from
        what the service keeps, without I/O: the job views' caches ask it on the event
        loop (api/cached.py)."""
        return None if self.scheduling is None else self.scheduling.view()

    def queue_reason(self, job_id: str) -> str | None:
        """Why the job waits, when the cluster scheduler's last round queued it
        (``queued: position 2 of 3 (...)``); None otherwise. No I/O."""
        return queue_reason(self.cluster_view(), job_id)

    @staticmethod
    def _shown(rec: JobRecord, view: ClusterView | None) -> JobRecord:
        """``rec`` with the queue's reason while the cluster scheduler's round ``view``
        queues it: the REST job, the list, ``dynabatch status`` and the job page all read
        it from here."""
        if rec.state.is_terminal:
            return rec
        why = queue_reason(view, rec.id)
        return rec if why is None or why == rec.reason else replace(rec, reason=why)

    def history(self, job_id: str, since: int = 0) -> list[EpochRecord]:
        self._get_record(job_id)
        return self.store.history(job_id, since)

    def logs(self, job_id: str, since: int = 0, limit: int = 1000) -> list[LogLine]:
        self._get_record(job_id)
        return self.store.logs(job_id, since, limit)

    def nodes(self) -> list[ClusterNode]:
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

    def metric_state(self) -> MetricState:
        """What /metrics exports: :meth:`metric_snapshots`, each job's last epoch record (its
        held-out loss and metrics) and the job counts, read at most once per
        ``sync_interval_s`` (the store changes no more often than the sync loop writes it), so
        scrapes under load share one read instead of each queueing on the store."""
        now = time.monotonic()
        with self._metric_lock:
            cached = self._metric_cache
            if cached is not None and now - cached.read_at < self._metric_ttl_s:
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
        if cached is not None and time.monotonic() - cached.read_at < self._metric_ttl_s:
            return cached
        return None

    @property
    def metrics_ttl_s(self) -> float:
        """How long one read of the metrics' job state serves (0: every scrape reads)."""
        return self._metric_ttl_s

    def job_counts(self) -> dict[JobState, int]:
        return self.store.count_by_state()

    @property
    def alive_nodes(self) -> int | None:
        return self._alive_nodes

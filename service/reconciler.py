"""The reconciler: the sync loop that keeps the store in step with Ray, the re-attach of
jobs an earlier API process left live, and the recovery of a lost coordinator
(:func:`dynabatch.scheduler.core.recovery.decide_lost`). A resume starts the job's next
generation, a coordinator named by the store's count of resumes, so it never waits for Ray
to free a dead one's name.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from dynabatch.actors.errors import first_line
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import InvalidTransition, JobState
from dynabatch.scheduler.core.recovery import Action, LostCoordinator, decide_lost
from dynabatch.scheduler.telemetry import JobSnapshot
from dynabatch.service.artifacts import keep_model, models_dir
from dynabatch.service.ray_client import RayClusterClient
from dynabatch.service.scheduling import RayScheduling, Refused
from dynabatch.service.service_errors import ClusterUnavailable, CoordinatorGone, RayCallError
from dynabatch.service.settings import Settings
from dynabatch.service.store import EMBEDDED_CLUSTER, JobRecord, JobStore
from dynabatch.service.submit_policy import SpecNotAllowed, SubmitPolicy, check_submission

log = logging.getLogger("dynabatch.service")

EMBEDDED_ENDED = "the embedded Ray cluster ended with the API process"
STOP_JOIN_S = 1.0  # how long stop() waits for a sync tick in progress
# With an embedded Ray, a coordinator found gone may be the process going down (a signal to
# the process group ends Ray's processes too, maybe before our handler runs): the sync loop
# waits this long for the shutdown to begin before calling it a loss.
EMBEDDED_GONE_WAIT_S = 0.5


# A relaunch: the stored spec checked again (settings tightened since it was stored hold
# too), the job's checkpoint, and the spec the new coordinator starts with.
def relaunch_refusal(spec: JobSpec, policy: SubmitPolicy) -> str | None:
    """Why a stored ``spec`` may not be launched again under ``policy`` (stored by an
    earlier, more permissive service, say); None when it may."""
    problems = check_submission(spec, policy)
    if not problems:
        return None
    return f"its spec is not allowed by this service's settings ({SpecNotAllowed(problems)})"


def checkpoint_exists(rec: JobRecord) -> bool:
    """Whether the job's spec names a checkpoint dir and its checkpoint file is there (the
    coordinator's filesystem: the same in embedded mode, a shared volume in compose and k8s)."""
    if not rec.spec.checkpoint.dir:
        return False
    # Imports torch: only when needed.
    from dynabatch.scheduler.checkpoint import checkpoint_exists as found

    # A local path or a URI (s3://...): False when it cannot be looked at.
    return found(rec.spec.checkpoint.dir, rec.id)


def launch_spec(rec: JobRecord) -> JobSpec:
    """The spec a job's coordinator starts with: the job's own, at the size last asked for
    with scale or drain (which a checkpoint does not hold)."""
    n = rec.target_workers
    spec = rec.spec
    if n is None or spec.workers == n:
        return spec
    update: dict[str, object] = {"workers": n, "max_workers": n}
    if spec.min_workers is not None and spec.min_workers > n:
        update["min_workers"] = n
    return spec.model_copy(update=update)


class SchedulerLink:
    """The service's side of the cluster scheduler: a job has no coordinator to poll until
    the scheduler starts it on the nodes it grants. ``started`` is the scheduler's last
    answer to :meth:`queued`, kept for when it cannot be reached."""

    def __init__(self, scheduling: RayScheduling, cluster: RayClusterClient):
        self.scheduling = scheduling
        self.cluster = cluster
        self.started: frozenset[str] = frozenset()  # the scheduler's last answer
        # The (job, generation) coordinators looked up since the scheduler started them: a
        # resumed job's next generation is looked up too, even when no answer in between
        # had it queued (its launch was quicker than a sync tick).
        self.found: frozenset[tuple[str, int]] = frozenset()

    def queued(self, live: Sequence[JobRecord]) -> set[str]:
        """Tell the scheduler every live job (a new scheduler rebuilds from them) and return
        those it has not started (no coordinator to poll yet)."""
        try:
            started = self.scheduling.sync(
                [(r.id, launch_spec(r), r.created_at, r.resumes) for r in live]
            )
        except RayCallError as err:
            log.warning("cannot sync with the cluster scheduler: %s", err)
            started = self.started
        found = {(r.id, r.resumes) for r in live if r.id in started}
        for job_id, generation in sorted(found - self.found):
            try:  # later calls for the job go to the generation the scheduler started
                self.cluster.find(job_id, generation)
            except RayCallError as err:
                log.warning("job %s: cannot find its coordinator yet (%s)", job_id, err)
        self.started, self.found = frozenset(started), frozenset(found)
        return {r.id for r in live if r.id not in started}

    def register(self, rec: JobRecord) -> None:
        """Queue the job's current generation: the scheduler starts it once its nodes are
        granted (its next answer says so). Raises ``Refused`` or ``RayCallError``."""
        self.scheduling.register(rec.id, launch_spec(rec), rec.created_at, rec.resumes)

    def finished(self, job_id: str) -> None:
        """Tell the scheduler the job is done or leaves its queue: its nodes go to the next
        job now, not at the next round."""
        try:
            self.scheduling.finished(job_id)
        except RayCallError as err:
            log.warning("job %s: cannot tell the cluster scheduler (%s)", job_id, err)


class Reconciler:
    """The sync loop and the recovery of lost coordinators (see the module docstring)."""

    def __init__(
        self,
        store: JobStore,
        cluster: RayClusterClient,
        link: SchedulerLink | None,
        settings: Settings,
        *,
        clock: Callable[[], float],
    ):
        self.store = store
        self.cluster = cluster
        self.clock = clock
        self.link = link  # the cluster scheduler's; None when it is off
        self.settings = settings
        self.submit_policy = settings.submit_policy
        # Held by a sync of a job and by each command on one, so they never interleave.
        self.lock = threading.RLock()
        self._stop = threading.Event()
        self._ending = threading.Event()  # the process is going down (begin_shutdown)
        self._thread: threading.Thread | None = None
        self.alive_nodes: int | None = None
        self._started = False
        # Jobs stored but not yet launched: the sync loop must not take the missing
        # coordinator for a dead one.
        self._launching: set[str] = set()
        self._launching_lock = threading.Lock()

    # Lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Re-attach jobs left live by an earlier process, then start the sync loop."""
        self._ending.clear()
        self.reattach()
        self._started = True
        if self.settings.sync_interval_s > 0:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="dynabatch-sync", daemon=True)
            self._thread.start()

    def begin_shutdown(self) -> None:
        """The process is going down: with an embedded Ray, a coordinator found gone from
        now on went with it (recorded by :meth:`interrupt_live`). Safe from a signal
        handler."""
        self._ending.set()

    def stop(self) -> None:
        """Stop the sync loop; in embedded mode, record the end of Ray in the live jobs."""
        self._ending.set()
        self._stop.set()
        if self._thread is not None:
            # A tick blocked on a Ray that is gone must not hold the shutdown long: the loop
            # is a daemon thread and checks the stop flag between jobs.
            self._thread.join(timeout=STOP_JOIN_S)
            self._thread = None
        if self._started and self.cluster.embedded:
            if self.cluster.reachable():
                self.sync_once()
                self._stop_coordinators()
            else:
                log.warning("the embedded Ray is gone: live jobs are recorded as they were")
            self.interrupt_live()
        self._started = False

    def _stop_coordinators(self) -> None:
        """Stop the live jobs' coordinators right after the last sync: they end with this
        process's Ray anyway, and what one logged or trained between that sync and Ray's
        shutdown (a second or more) would be lost, not copied (a resume goes on from the
        checkpoint)."""
        for rec in self.store.live():
            try:
                self.cluster.release(rec.id)
            except RayCallError as err:
                log.warning("job %s: %s", rec.id, first_line(err, typed=False))

    def interrupt_live(self) -> None:
        """Record the end of the embedded Ray in every live job: those with a checkpoint
        stay PENDING, to be resumed when the API starts again; the others FAIL. Store
        writes only: safe when Ray is gone."""
        for rec in self.store.live():
            if self.settings.auto_resume_limit > 0 and checkpoint_exists(rec):
                self.store.interrupt(
                    rec.id,
                    f"{EMBEDDED_ENDED}; the job resumes from its checkpoint when the "
                    "API starts again",
                    now=self.clock(),
                )
            else:
                self.fail(rec.id, EMBEDDED_ENDED)

    def reattach(self) -> None:
        """Find the coordinators of jobs the store says are live. A job whose coordinator
        is gone is recovered by :meth:`coordinator_lost`."""
        live = self.store.live()  # one read: see sync_once
        if self.cluster.embedded:
            # This process's Ray is new: the coordinators of the last one ended with it.
            # Each job that had one is recovered before a new cluster scheduler hears of it,
            # which would start it again as the same generation, unrecorded (no resume
            # counted, its log's lines taken for those the store has). A job the scheduler
            # had not started (it never reported: no snapshot) waits in its queue again.
            for rec in live:
                if self.link is None or rec.snapshot is not None:
                    self._embedded_ended(rec)
            self._queued(self.store.live())  # a new scheduler hears of every live job
            return
        queued = self._queued(live)
        for rec in live:
            if rec.id in queued:
                continue  # the cluster scheduler has not started it: nothing to re-attach
            if rec.cluster == EMBEDDED_CLUSTER:
                self._embedded_ended(rec)
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
            else:
                with self.lock:
                    self.coordinator_lost(rec, f"lost while the API was down: {why}")

    def _embedded_ended(self, rec: JobRecord) -> None:
        """``rec``'s coordinator ran on an embedded Ray that is gone: resumed or failed as
        :meth:`coordinator_lost` decides; failed when the job ran on another cluster (which
        may still run it: never start a second copy)."""
        if rec.cluster != EMBEDDED_CLUSTER:
            self.fail(rec.id, f"the API restarted with an embedded Ray; the job's cluster "
                              f"({rec.cluster}) is no longer attached")
            return
        with self.lock:
            self.coordinator_lost(rec, EMBEDDED_ENDED)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.sync_interval_s):
            try:
                self.sync_once()
            except Exception:  # the loop must survive anything one tick does
                log.exception("sync loop tick failed")

    @contextmanager
    def launching(self, job_id: str) -> Iterator[None]:
        """While the job is stored but its coordinator not launched yet: the sync loop
        leaves it alone."""
        with self._launching_lock:
            self._launching.add(job_id)
        try:
            yield
        finally:
            with self._launching_lock:
                self._launching.discard(job_id)

    # Sync -------------------------------------------------------------------------------
    def sync_once(self) -> None:
        """Poll every live job once, and refresh the count of alive nodes. One read of the
        live jobs decides both which are queued and which are polled, so a job submitted
        after it is left to the next tick, never taken for one whose coordinator is gone."""
        live = self.store.live()
        queued = self._queued(live)
        for rec in live:
            if self._stop.is_set() and self._thread is not None:
                return
            with self._launching_lock:
                if rec.id in self._launching or rec.id in queued:
                    continue
            self.sync_job(rec.id)
        try:
            self.alive_nodes = sum(1 for n in self.cluster.nodes() if n.alive)
        except RayCallError as err:
            log.warning("cannot list Ray nodes: %s", err)
            self.alive_nodes = None

    def _queued(self, live: list[JobRecord]) -> set[str]:
        """Of the ``live`` jobs, those the cluster scheduler has not started (none when it
        is off)."""
        return set() if self.link is None else self.link.queued(live)

    def sync_job(self, job_id: str, snapshot: JobSnapshot | None = None) -> JobRecord | None:
        """Bring one job's stored state, history and logs up to date with its coordinator."""
        with self.lock:
            rec = self.store.get(job_id)
            if rec is None or rec.state.is_terminal:
                return rec
            try:
                snap = snapshot if snapshot is not None else self.cluster.snapshot(job_id)
                # A resumed job's history is read whole (``resync``), as is one that rolled
                # back since the last sync (its history went back to a checkpoint's, and the
                # epochs after it are trained again); a resumed coordinator numbers its log
                # lines from 0, stored after the earlier ones' by ``log_offset``.
                whole = rec.resync or snap.rollbacks_total != (
                    rec.snapshot.rollbacks_total if rec.snapshot else 0)
                last_epoch = None if whole else self.store.last_epoch(job_id)
                last_seq = self.store.last_log_seq(job_id)
                since = 0 if last_seq is None else max(0, last_seq + 1 - rec.log_offset)
                records = self.cluster.history(job_id, 0 if last_epoch is None else last_epoch + 1)
                lines = self.cluster.logs(job_id, since)
            except CoordinatorGone as err:
                if self.cluster.embedded and self._ending.wait(EMBEDDED_GONE_WAIT_S):
                    return rec  # gone with this process's Ray: interrupt_live records it
                return self.coordinator_lost(rec, self.died(err))
            except RayCallError as err:
                log.warning("job %s: sync failed (%s)", job_id, first_line(err, typed=False))
                return rec
            if whole:
                self.store.replace_history(job_id, records)
            else:
                self.store.add_history(job_id, records)
                if records and rec.auto_resumes:
                    # A resumed job that finished an epoch is not crash-looping.
                    self.store.reset_auto_resumes(job_id)
            if rec.log_offset:
                lines = [x.model_copy(update={"seq": x.seq + rec.log_offset}) for x in lines]
            self.store.add_logs(job_id, lines)
            self.store.save_snapshot(snap, now=self.clock())
            done = self.store.get(job_id)
            if snap.state.is_terminal and self.link is not None:
                self.link.finished(job_id)
            if snap.state.is_terminal and self.settings.release_finished:
                # The coordinator may hold the only copy of the trained model.
                keep_model(self.cluster, job_id, models_dir(self.store.path))
                try:
                    self.cluster.release(job_id)
                except RayCallError as err:
                    log.warning("job %s: cannot release coordinator (%s)", job_id, err)
            return done

    def cluster_name(self) -> str:
        """Where this service starts coordinators, as stored with each job."""
        return EMBEDDED_CLUSTER if self.cluster.embedded else self.cluster.address

    def fail(self, job_id: str, reason: str) -> JobRecord | None:
        """The job FAILED with ``reason``; one that already finished is left as it is (and
        returned as stored)."""
        try:
            rec = self.store.transition(job_id, JobState.FAILED, reason, now=self.clock())
        except (KeyError, InvalidTransition):
            return self.store.get(job_id)
        log.warning("job %s: FAILED (%s)", job_id, reason)
        return rec

    @staticmethod
    def died(err: Exception) -> str:
        """The reason a job records for a coordinator found dead by ``err``."""
        return f"the job's coordinator actor died: {first_line(err, typed=False)}"

    # Recovery ---------------------------------------------------------------------------
    def coordinator_lost(self, rec: JobRecord, why: str) -> JobRecord | None:
        """The live job ``rec``'s coordinator is gone: do what :func:`decide_lost` says."""
        checkpoint = checkpoint_exists(rec)
        decision = decide_lost(
            LostCoordinator(
                state=rec.state,
                why=why,
                checkpoint=checkpoint,
                auto_resumes=rec.auto_resumes,
                auto_resume_limit=self.settings.auto_resume_limit,
                not_allowed=relaunch_refusal(rec.spec, self.submit_policy) if checkpoint else None,
            )
        )
        if decision.action is Action.NONE:
            return rec
        if decision.action is Action.FAIL:
            failed = self.fail(rec.id, decision.reason)
            if self.link is not None:  # it leaves the scheduler's queue and views now
                self.link.finished(rec.id)
            return failed
        try:
            return self.relaunch(rec, decision.reason, automatic=True)
        except (RayCallError, Refused):
            return self.store.get(rec.id)  # relaunch recorded the failure

    def relaunch(self, rec: JobRecord, reason: str, automatic: bool) -> JobRecord:
        """Start the job's next generation from its checkpoint. A launch that fails leaves
        the job FAILED and re-raises."""
        rec = self.store.mark_resumed(
            rec.id, reason, automatic=automatic, cluster=self.cluster_name(), now=self.clock()
        )
        log.warning("job %s: %s", rec.id, reason)
        with self.launching(rec.id):
            try:
                if self.link is not None:
                    self.link.register(rec)
                else:
                    self.cluster.launch(rec.id, launch_spec(rec), rec.resumes)
            except (Refused, RayCallError) as err:
                why = (f"not resumed: {err}" if isinstance(err, Refused) else
                       f"could not start a new coordinator: {first_line(err, typed=False)}")
                self.fail(rec.id, f"{reason}; {why}")
                raise
        return rec

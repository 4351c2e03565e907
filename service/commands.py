"""The commands on jobs: submit, cancel, scale, drain and resume (``JobService`` forwards
them here). Each checks what it is asked against the job's stored state, calls the job's
coordinator (or the cluster scheduler, when it is on) and records the outcome through the
registry, holding the reconciler's lock so that no sync of the job interleaves.

``submit`` refuses (:class:`dynabatch.service.submit_policy.SpecNotAllowed`, 422, nothing
stored) a spec that names user code, a dataset path or a checkpoint dir that
``submit_policy`` does not allow, and a resume checks the stored spec again
(:func:`~dynabatch.service.launch_checks.relaunch_refusal`), so settings tightened since the job
was stored hold too.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from dynabatch.actors.errors import first_line
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import InvalidTransition, JobState
from dynabatch.scheduler.core.membership import scale_error
from dynabatch.scheduler.telemetry import JobSnapshot
from dynabatch.service.cluster_client import ClusterClient
from dynabatch.service.launch_checks import (
    capacity_problem,
    checkpoint_exists,
    min_workers_problem,
    relaunch_refusal,
)
from dynabatch.service.reads import JobReads
from dynabatch.service.reconciler import Reconciler
from dynabatch.service.registry import JobRegistry
from dynabatch.service.scheduler_link import SchedulerLink
from dynabatch.service.scheduling import Refused, Scheduling
from dynabatch.service.service_errors import (
    AlreadyFinished,
    ClusterUnavailable,
    CoordinatorGone,
    InvalidRequest,
    JobConflict,
    JobFinished,
    RayCallError,
    WorkerNotFound,
    finished_message,
)
from dynabatch.service.store import JobRecord
from dynabatch.service.submit_policy import SpecNotAllowed, SubmitPolicy, check_submission

log = logging.getLogger("dynabatch.service")


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


class JobCommands:
    """The commands, over the service's parts."""

    def __init__(
        self,
        registry: JobRegistry,
        reads: JobReads,
        reconciler: Reconciler,
        cluster: ClusterClient,
        scheduling: Scheduling | None,
        link: SchedulerLink | None,
        *,
        submit_policy: SubmitPolicy,
        cancel_wait_s: float,
    ):
        self.registry = registry
        self.reads = reads
        self.reconciler = reconciler
        self.cluster = cluster
        self.scheduling = scheduling
        self.link = link
        self.submit_policy = submit_policy
        self.cancel_wait_s = cancel_wait_s

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
        if self.link is not None:
            why = self._scheduler_refusal(spec)
            if why:
                raise InvalidRequest(why.split(" ", 1)[0], why)
        job_id = new_job_id()
        with self.reconciler.launching(job_id):
            rec = self.registry.create(job_id, spec, queued=self.link is not None)
            try:
                if self.link is not None:
                    self.link.register(rec)  # queued: started on the nodes it is granted
                else:
                    self.cluster.launch(job_id, spec)
            except Refused as err:  # the cluster changed since the check above
                return self.registry.fail(job_id, f"refused by the cluster scheduler: {err}") or rec
            except ClusterUnavailable as err:
                self.registry.fail(
                    job_id, f"could not start the job's coordinator: {first_line(err, typed=False)}"
                )
                raise
            except RayCallError as err:
                failed = self.registry.fail(
                    job_id, f"could not start the job's coordinator: {first_line(err, typed=False)}"
                )
                return failed or rec
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
        with self.reconciler.lock:
            rec = self.reads.record(job_id)
            if rec.state.is_terminal:
                raise AlreadyFinished(rec.state, job_id)
            if self.link is not None and job_id not in self.link.started:
                self.link.finished(job_id)  # still queued: it leaves the queue unstarted
            try:
                snap = self.cluster.cancel(job_id, reason)
            except CoordinatorGone:
                if self.link is not None:  # queued (as of a stale answer): it leaves now
                    self.link.finished(job_id)
                return self.registry.cancelled(job_id, reason)
            except InvalidTransition:
                # It finished between our read and the coordinator's; report what it is.
                done = self.reconciler.sync_job(job_id) or rec
                raise AlreadyFinished(done.state, job_id) from None
            log.info("job %s: cancel requested (%s)", job_id, reason)
        deadline = time.monotonic() + self.cancel_wait_s
        while not snap.state.is_terminal and time.monotonic() < deadline:
            time.sleep(0.1)
            try:
                snap = self.cluster.snapshot(job_id)
            except RayCallError:
                break
        return self.reconciler.sync_job(job_id, snapshot=snap) or rec

    def _live_record(self, job_id: str, done: str) -> JobRecord:
        """The job's record; :class:`JobFinished` (409, "a finished job cannot be
        ``done``") when it finished."""
        rec = self.reads.record(job_id)
        if rec.state.is_terminal:
            raise JobFinished(rec.state, job_id, done)
        return rec

    def _membership_call(self, rec: JobRecord, call: Callable[[], JobSnapshot],
                         done: str) -> JobSnapshot:
        """Run a scale or drain call on the job's coordinator. A coordinator that finished
        meanwhile is a 409 with the state it finished in."""
        try:
            return call()
        except InvalidTransition:
            ended = self.reconciler.sync_job(rec.id) or rec
            raise JobFinished(ended.state, rec.id, done) from None

    def scale(self, job_id: str, workers: int) -> JobRecord:
        """Run the job with exactly ``workers`` workers from its next step boundary on.

        Raises ``InvalidTransition`` (409) when it finished, :class:`InvalidRequest` (422)
        when the job's global batch cannot be split that many ways (the membership's
        bounds: :func:`~dynabatch.scheduler.core.membership.scale_error`).
        """
        with self.reconciler.lock:
            rec = self._live_record(job_id, "scaled")
            spec = rec.spec
            problem = scale_error(workers, *spec.batch_range, spec.max_batch)
            if problem:
                raise InvalidRequest("workers", problem)
            if self.scheduling is not None:
                return self._scheduled_scale(rec, workers)
            self._check_capacity(spec, workers)
            try:
                snap = self._membership_call(
                    rec, lambda: self.cluster.scale(job_id, workers), "scaled")
            except CoordinatorGone as err:
                # The size holds for the coordinator that resumes the job (if it can be).
                self.registry.set_target_workers(job_id, workers)
                done = self.reconciler.coordinator_lost(rec, Reconciler.died(err))
                if done is None or done.state.is_terminal:
                    raise JobFinished(
                        done.state if done else JobState.FAILED, job_id, "scaled"
                    ) from None
                return done
            self.registry.set_target_workers(job_id, workers)
            log.info("job %s: scale to %d workers requested", job_id, workers)
            return self.reconciler.sync_job(job_id, snapshot=snap) or rec

    def _check_capacity(self, spec: JobSpec, workers: int) -> None:
        """Without the cluster scheduler: :class:`JobConflict` (409) when the cluster's
        alive nodes could never hold ``workers`` of this job's workers at once (the
        scheduler refuses the same scale with the same words). When Ray cannot list its
        nodes now, the scale is not refused for it."""
        try:
            nodes = self.cluster.nodes()
        except RayCallError as err:
            log.warning("cannot list Ray nodes to check a scale: %s", err)
            return
        problem = capacity_problem(spec, nodes, workers)
        if problem:
            raise JobConflict(f"scale to {workers}: above the cluster's capacity: {problem}")

    def _scheduled_scale(self, rec: JobRecord, workers: int) -> JobRecord:
        """With the cluster scheduler on, a scale is a request to it, answered at once (not
        held): the job's bounds become at most ``workers`` and it is assigned what free
        slots allow now; what it still waits for is in its status. :class:`JobConflict`
        (409) when the scheduler refuses, with its reason (above the cluster's capacity for
        the job, or a job it does not hold)."""
        try:
            answer = self.scheduling.request_scale(rec.id, workers)
        except Refused as err:
            raise JobConflict(str(err)) from None
        self.registry.set_target_workers(rec.id, workers)
        log.info("job %s: %s", rec.id, answer)
        return self.registry.get(rec.id) or rec

    def _scheduled_drain(self, rec: JobRecord, worker: str) -> JobRecord:
        """With the cluster scheduler on, a drain is a request to it: the job gives up the
        worker's slot on its node (a worker there leaves at the next step boundary: this
        one when it is the only one there, else the slowest of them) and its max_workers
        drops by one (:class:`JobConflict`, 409, when it refuses: below min_workers)."""
        try:
            snap = self._membership_call(
                rec, lambda: self.cluster.snapshot(rec.id), "drained")
        except CoordinatorGone:  # queued (nothing runs yet), or lost: the sync loop sees to it
            raise WorkerNotFound(
                f"worker {worker!r} is not a member of job {rec.id}: it has no running coordinator"
            ) from None
        if snap.ps is not None:  # its snapshot names no learner's node
            raise JobConflict(
                f"drain {worker}: the cluster scheduler places this parameter-server job; "
                "scale it down instead (its slowest learners leave)"
            )
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
            answer = self.scheduling.request_drain(rec.id, member.node)
        except Refused as err:
            raise JobConflict(str(err)) from None
        self.registry.set_target_workers(rec.id, staying - 1)
        log.info("job %s: drain of %s: %s", rec.id, worker, answer)
        return self.reconciler.sync_job(rec.id, snapshot=snap) or rec

    def drain(self, job_id: str, worker: str) -> JobRecord:
        """Remove ``worker`` from the job at its next step boundary (gracefully: its share of
        the epoch goes to the others).

        Raises :class:`WorkerNotFound` (404), :class:`JobConflict` (409) for the job's last
        worker and ``InvalidTransition`` (409) when the job finished.
        """
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
            self.registry.set_target_workers(job_id, max(1, others))
            log.info("job %s: drain of %s requested", job_id, worker)
            return self.reconciler.sync_job(job_id, snapshot=snap) or rec

    def resume(self, job_id: str) -> JobRecord:
        """Start a new coordinator for the job from its checkpoint.

        For a FAILED or CANCELLED job (a cancel writes a checkpoint where it stopped), or a
        live one whose coordinator is gone. Raises :class:`JobConflict` (409) for a job
        that SUCCEEDED, that has no checkpoint, or whose coordinator is alive;
        :class:`ClusterUnavailable` (503, after recording the failure) when Ray did not
        answer.
        """
        with self.reconciler.lock:
            rec = self.reads.record(job_id)
            if not rec.state.can_resume:
                raise JobConflict(finished_message(
                    rec.state, job_id, "a job that succeeded cannot be resumed (only a FAILED "
                    "or CANCELLED job, or a live one whose coordinator is gone, can be)"))
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

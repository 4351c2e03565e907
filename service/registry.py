"""The job registry: every write the service makes to its jobs' stored state.

Each state change goes through the store's checked writes, which refuse a move the
lifecycle does not allow (:mod:`dynabatch.scheduler.core.lifecycle`): a failure or a cancel
is a transition (``can_become``), what the coordinator reports a sampled state
(``can_observe``), a relaunch from the checkpoint a resume (``resumed``) and the embedded
Ray's end an interrupt back to PENDING. After each write the registry tells the read model
(``on_change``), so the next /metrics read sees it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import InvalidTransition, JobState
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine
from dynabatch.service.store import QUEUED, STARTING, JobRecord, JobStore

log = logging.getLogger("dynabatch.service")


class JobRegistry:
    """The store-facing side of ``JobService``: its writes, and the reads the sync loop and
    the commands act on (the views read the store through ``JobService``).
    """

    def __init__(
        self,
        store: JobStore,
        *,
        cluster_name: Callable[[], str],
        clock: Callable[[], float],
        on_change: Callable[[], None],
    ):
        self.store = store
        self.cluster_name = cluster_name  # where new coordinators start, stored per job
        self.clock = clock
        self.on_change = on_change

    # Reads ------------------------------------------------------------------------------
    def get(self, job_id: str) -> JobRecord | None:
        return self.store.get(job_id)

    def live(self) -> list[JobRecord]:
        return self.store.live()

    # State changes ----------------------------------------------------------------------
    def create(self, job_id: str, spec: JobSpec, *, queued: bool = False) -> JobRecord:
        """A new job, PENDING, to start where this service starts coordinators (``queued``:
        it waits for the cluster scheduler, and says so, not that it is starting)."""
        rec = self.store.create(
            job_id, spec, cluster=self.cluster_name(), now=self.clock(),
            reason=QUEUED if queued else STARTING,
        )
        self.on_change()
        return rec

    def fail(self, job_id: str, reason: str) -> JobRecord | None:
        """The job FAILED with ``reason``; one that already finished is left as it is (and
        returned as stored)."""
        self.on_change()
        try:
            rec = self.store.transition(job_id, JobState.FAILED, reason, now=self.clock())
        except (KeyError, InvalidTransition):
            return self.store.get(job_id)
        log.warning("job %s: FAILED (%s)", job_id, reason)
        return rec

    def cancelled(self, job_id: str, reason: str) -> JobRecord:
        """The job was CANCELLED with ``reason``; raises ``InvalidTransition`` when it
        already finished."""
        self.on_change()
        return self.store.transition(job_id, JobState.CANCELLED, reason, now=self.clock())

    def interrupt(self, job_id: str, reason: str) -> JobRecord | None:
        """The live job's coordinator ended with the embedded Ray: PENDING with ``reason``,
        to be resumed when the API starts again."""
        self.on_change()
        return self.store.interrupt(job_id, reason, now=self.clock())

    def resumed(self, job_id: str, reason: str, *, automatic: bool) -> JobRecord:
        """A new coordinator is starting for the job from its checkpoint: PENDING, its
        resume counted (see :meth:`JobStore.mark_resumed`). Raises ``InvalidTransition``
        for a job that SUCCEEDED."""
        rec = self.store.mark_resumed(
            job_id, reason, automatic=automatic, cluster=self.cluster_name(), now=self.clock()
        )
        self.on_change()
        return rec

    def set_target_workers(self, job_id: str, workers: int | None) -> None:
        """The size last asked for (scale, drain), which a resumed coordinator starts with."""
        self.store.set_target_workers(job_id, workers)

    def record_sync(
        self,
        rec: JobRecord,
        snapshot: JobSnapshot,
        records: Sequence[EpochRecord],
        lines: Sequence[LogLine],
    ) -> JobRecord | None:
        """What one poll of ``rec``'s coordinator read: its new epoch records (all of them
        after a resume: ``rec.resync``), its new log lines (numbered from 0 by each
        coordinator, stored after the earlier ones' by ``rec.log_offset``) and its
        snapshot. A resumed job that finished an epoch is not crash-looping: its count of
        automatic resumes goes back to 0."""
        job_id = rec.id
        if rec.resync:
            self.store.replace_history(job_id, records)
        else:
            self.store.add_history(job_id, records)
            if records and rec.auto_resumes:
                self.store.reset_auto_resumes(job_id)
        if rec.log_offset:
            lines = [x.model_copy(update={"seq": x.seq + rec.log_offset}) for x in lines]
        self.store.add_logs(job_id, lines)
        self.store.save_snapshot(snapshot, now=self.clock())
        self.on_change()
        return self.store.get(job_id)

    def log_cursor(self, rec: JobRecord) -> tuple[int | None, int]:
        """Where the next poll of ``rec``'s coordinator starts: the last epoch stored (None:
        read the whole history, also when it is to be re-read after a resume) and the
        first log line of the current coordinator not stored yet."""
        last_epoch = None if rec.resync else self.store.last_epoch(rec.id)
        last_seq = self.store.last_log_seq(rec.id)
        since = 0 if last_seq is None else max(0, last_seq + 1 - rec.log_offset)
        return last_epoch, since

"""The service's side of the cluster scheduler (:mod:`dynabatch.service.scheduling`): which
live jobs it has started, and the calls the sync loop and the commands make to it.

With the scheduler on, a job is registered with it and its coordinator started by it once
its nodes are granted; until then the job has no coordinator to poll. Which jobs it started
is the scheduler's fact (its round state): ``started`` is only its last answer to
:meth:`SchedulerLink.queued`, kept as it said it (never changed here) for when it cannot be
reached.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from dynabatch.service.launch_checks import launch_spec
from dynabatch.service.ray_client import RayClusterClient
from dynabatch.service.scheduling import RayScheduling
from dynabatch.service.service_errors import RayCallError
from dynabatch.service.store import JobRecord

log = logging.getLogger("dynabatch.service")


class SchedulerLink:
    def __init__(self, scheduling: RayScheduling, cluster: RayClusterClient):
        self.scheduling = scheduling
        self.cluster = cluster
        self.started: frozenset[str] = frozenset()  # the scheduler's last answer

    def queued(self, live: Sequence[JobRecord]) -> set[str]:
        """Tell the scheduler every live job (so a new scheduler rebuilds from the store
        and the live coordinators), and return those it has not started, which have no
        coordinator to poll yet. If it cannot be reached, the jobs it started as of the last
        sync are polled and the others wait."""
        try:
            started = self.scheduling.sync(
                [(r.id, launch_spec(r), r.created_at, r.resumes) for r in live]
            )
        except RayCallError as err:
            log.warning("cannot sync with the cluster scheduler: %s", err)
            started = self.started
        for rec in live:
            if rec.id in started and rec.id not in self.started:
                try:  # later calls for the job go to the generation the scheduler started
                    self.cluster.find(rec.id, rec.resumes)
                except RayCallError as err:
                    log.warning("job %s: cannot find its coordinator yet (%s)", rec.id, err)
        self.started = frozenset(started)
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

"""JobService with the cluster scheduler on (service/job_service.py, service/scheduling.py): a
submitted job is registered, not launched; a queued job stays PENDING with the queue's
reason and is never taken for a lost one; it starts when granted; the job's own scale and
drain become requests the scheduler answers. The scheduler here is the pure rounds
(scheduler/core/cluster/rounds.py) launching through the fake cluster."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.cluster import rounds
from dynabatch.scheduler.core.cluster.ray_nodes import job_bounds
from dynabatch.scheduler.core.cluster.rounds import (
    Drained,
    Entry,
    JobGone,
    NodesSeen,
    Reassign,
    ResizeRequested,
    RoundState,
    Start,
    Tick,
    step,
)
from dynabatch.scheduler.core.cluster.values import ClusterKnobs, ClusterNode
from dynabatch.scheduler.core.cluster.view import ClusterView
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.service.job_service import JobService
from dynabatch.service.scheduling import Refused
from dynabatch.service.service_errors import InvalidRequest, JobConflict, WorkerNotFound
from dynabatch.service.settings import Settings
from dynabatch.service.store import JobStore

from tests.fakes import FakeCluster


class RoundsScheduling:
    """:class:`~dynabatch.service.scheduling.RayScheduling` over the pure rounds; ``tick()``
    runs a round and launches what it starts on the fake cluster."""

    def __init__(self, cluster: FakeCluster, slots: int = 2):
        self.cluster = cluster
        self.knobs = ClusterKnobs(policy="fifo", hold_s=0.0)
        # The fake cluster's nodes, where its coordinators place their workers.
        nodes = tuple(ClusterNode(n, "cpu", 1) for n in cluster.node_ids[:slots])
        self.state, _ = step(RoundState(), NodesSeen(nodes), self.knobs)
        self.specs: dict[str, tuple[JobSpec, int]] = {}
        self.now = 0.0
        self.syncs = 0
        self.assigned: list = []  # the Reassign commands of owners' requests
        self.ended: list[str] = []  # the jobs the service said finished

    def _step(self, event) -> tuple:
        self.state, commands = step(self.state, event, self.knobs)
        return commands

    def admissible(self, spec: JobSpec) -> str | None:
        lo, _ = job_bounds(spec)
        cap = sum(n.capacity for n in self.state.nodes)
        return None if lo <= cap else f"min_workers {lo}: the cluster has {cap} worker slots"

    def register(self, job_id: str, spec: JobSpec, submit_s: float, generation: int) -> None:
        if job_id in self.specs and self.specs[job_id][1] >= generation:
            return
        if job_id in self.specs:
            self._step(JobGone(job_id))
        self.specs[job_id] = (spec, generation)
        lo, hi = job_bounds(spec)
        self._step(Entry(job_id, lo, hi, spec.priority, submit_s, generation=generation))

    def sync(self, jobs: Sequence[tuple[str, JobSpec, float, int]]) -> set[str]:
        self.syncs += 1
        for job_id, spec, submit_s, generation in jobs:
            self.register(job_id, spec, submit_s, generation)
        listed = {j[0] for j in jobs}
        for j in self.state.jobs:
            if j.job_id not in listed:
                self._step(JobGone(j.job_id))
        return {j.job_id for j in self.state.jobs if j.started}

    def finished(self, job_id: str) -> None:
        self.ended.append(job_id)
        self._step(JobGone(job_id))

    def _relayed(self, commands: tuple, what: str) -> None:
        """As the actor does: a refusal is raised with its reason, an assignment sent."""
        for c in commands:
            if isinstance(c, rounds.RequestRefused):
                raise Refused(f"{what}the cluster scheduler places this job; {c.why}")
        self.assigned.extend(c for c in commands if isinstance(c, Reassign))

    def request_scale(self, job_id: str, workers: int) -> str:
        self._relayed(self._step(ResizeRequested(job_id, workers, self.now)), "")
        return f"the cluster scheduler places this job; scale to {workers}"

    def request_drain(self, job_id: str, node: str, worker: str) -> str:
        entry = self.state.job(job_id)
        self._relayed(self._step(Drained(job_id, node, self.now, entry.min_workers, worker)),
                      "drain: ")
        return f"the cluster scheduler places this job; its slot on node {node} is freed"

    def view(self) -> ClusterView | None:
        return self.state.view

    def tick(self) -> None:
        self.now += 1.0
        for c in self._step(Tick(self.now)):
            if isinstance(c, Start):
                spec, generation = self.specs[c.job_id]
                self.cluster.launch(c.job_id, spec, generation, client=False)


@pytest.fixture
def setup():
    cluster = FakeCluster(steps_per_epoch=1)
    cluster.connect()
    sched = RoundsScheduling(cluster)
    service = JobService(
        JobStore(":memory:"), cluster, Settings(sync_interval_s=0), scheduling=sched
    )
    yield service, cluster, sched
    service.store.close()


def _gang(name: str, epochs: int = 1) -> JobSpec:
    return JobSpec(name=name, epochs=epochs, workers=2, min_workers=2, max_workers=2)


def test_a_queued_job_waits_pending_with_its_reason_and_starts_when_granted(setup):
    service, cluster, sched = setup
    a = service.submit(_gang("a"))
    b = service.submit(_gang("b"))
    assert cluster.launches == {}  # registered, not launched
    sched.tick()
    assert list(cluster.launches) == [a.id]
    for _ in range(3):  # b has no coordinator: never taken for a lost one
        service.reconciler.sync_once()
    got = service.get(b.id)
    assert got.state == JobState.PENDING
    assert got.reason.startswith("queued: position 1 of 1")
    assert ("snapshot", b.id) not in cluster.calls
    while not service.get(a.id).state.is_terminal:
        service.reconciler.sync_once()
    assert service.get(a.id).state == JobState.SUCCEEDED
    assert sched.state.job(a.id) is None  # reported finished
    sched.tick()
    assert list(cluster.launches) == [a.id, b.id]
    while not service.get(b.id).state.is_terminal:
        service.reconciler.sync_once()
    assert service.get(b.id).state == JobState.SUCCEEDED


def test_a_job_the_scheduler_cannot_place_is_refused_at_submit(setup):
    service, _, _ = setup
    with pytest.raises(InvalidRequest) as err:
        service.submit(JobSpec(name="big", workers=3, min_workers=3, max_workers=3))
    assert err.value.field == "min_workers"
    assert service.list()[1] == 0  # nothing stored


def test_a_job_of_workers_auto_is_granted_every_slot_it_may_use(setup):
    """``workers: auto`` is one worker per eligible node: the scheduler places it between 1
    and as many workers as the slots hold, not on one worker."""
    service, _, sched = setup
    job = service.submit(JobSpec(name="auto", epochs=1, workers="auto"))
    sched.tick()
    assert sum(n for _, n in sched.state.job(job.id).allocation) == 2


def test_an_owners_scale_is_carried_out_at_once_or_refused_with_the_reason(setup):
    """Under a long hold, an owner's scale is assigned at once, above the spec's
    max_workers too (the owner's size becomes the job's bounds, as without the scheduler);
    0 workers, a size the batch cannot be split into and a size above what the cluster
    could ever hold are refused at once, one line each; the job's coordinator is never
    asked to scale by itself."""
    service, cluster, sched = setup
    sched.knobs = ClusterKnobs(policy="fifo", hold_s=120.0)
    job = service.submit(JobSpec(name="a", epochs=5, workers=1, global_batch=8))
    sched.tick()
    service.reconciler.sync_once()
    service.scale(job.id, 2)
    (assign,) = sched.assigned
    assert sum(k for _, k in assign.slots) == 2
    assert sched.state.job(job.id).max_workers == 2
    assert ("scale", job.id) not in cluster.calls  # the job's coordinator is not asked
    with pytest.raises(JobConflict) as err:
        service.scale(job.id, 3)
    assert str(err.value) == (
        "the cluster scheduler places this job; scale to 3: above the cluster's capacity "
        "for this job: the nodes of its types hold 2 of its workers"
    )
    with pytest.raises(InvalidRequest, match="above the job's global_batch"):
        service.scale(job.id, 9)
    assert len(sched.assigned) == 1  # nothing else changed


def test_a_scale_above_the_clusters_capacity_is_refused_without_the_scheduler_too() -> None:
    """The same meaning in both modes: without the scheduler, a size no set of the alive
    nodes could hold is a 409 in the same words, before the job is asked."""
    cluster = FakeCluster(steps_per_epoch=1)
    cluster.connect()
    service = JobService(JobStore(":memory:"), cluster, Settings(sync_interval_s=0))
    try:
        job = service.submit(JobSpec(name="a", epochs=5, workers=1, worker_cpus=2))
        held = sum(JobSpec(name="x", worker_cpus=2).workers_on(n.resources)
                   for n in cluster.nodes())
        with pytest.raises(JobConflict) as err:
            service.scale(job.id, held + 1)
        assert str(err.value).startswith(
            f"scale to {held + 1}: above the cluster's capacity: the cluster's ")
        assert ("scale", job.id) not in cluster.calls
    finally:
        service.store.close()


def test_a_job_submitted_between_the_sync_loops_reads_is_left_queued(setup):
    """The sync loop decides which jobs are queued and which it polls from one read of the
    live jobs: a job submitted while it asks the scheduler is not taken for one whose
    coordinator died (it was FAILED, "no coordinator actor", 28 ms after its submit)."""
    service, cluster, sched = setup
    a = service.submit(_gang("a", epochs=5))
    sched.tick()
    service.reconciler.sync_once()
    late: list = []
    sync = sched.sync

    def sync_then_submit(jobs):
        started = sync(jobs)
        if not late:  # the submit lands between the loop's read and its polls
            late.append(service.submit(_gang("b")))
        return started

    sched.sync = sync_then_submit
    service.reconciler.sync_once()
    b = service.get(late[0].id)
    assert b.state == JobState.PENDING, b.reason
    assert ("snapshot", b.id) not in cluster.calls
    assert service.get(a.id).state == JobState.RUNNING


def test_a_queued_job_says_it_is_queued_not_that_its_coordinator_starts(setup):
    service, _, sched = setup
    service.submit(_gang("a"))
    b = service.submit(_gang("b"))
    # Before a round has seen it: queued, waiting for the round (no coordinator starts).
    assert service.get(b.id).reason == "queued: waiting for the cluster scheduler's next round"
    sched.tick()
    assert service.get(b.id).reason.startswith("queued: position 1 of 1")


def test_a_job_failed_for_a_lost_coordinator_leaves_the_scheduler_at_once(setup):
    service, cluster, sched = setup
    a = service.submit(_gang("a", epochs=5))
    sched.tick()
    service.reconciler.sync_once()
    cluster.kill(a.id)  # no checkpoint: it fails
    service.reconciler.sync_job(a.id)
    assert service.get(a.id).state == JobState.FAILED
    assert sched.ended == [a.id] and sched.state.job(a.id) is None
    assert all(j.job_id != a.id for j in service.cluster_view().jobs)


def test_a_drain_frees_the_workers_slot_through_the_scheduler(setup):
    """The owner drains a worker: the scheduler takes the slot on that worker's node off the
    job's nodes (the job is assigned the rest) and lowers its max_workers, so no round gives
    it back; a non-member is a 404 and a drain below min_workers a 409, both with the
    reason; the job's coordinator is never asked to drain by itself."""
    service, cluster, sched = setup
    job = service.submit(JobSpec(name="a", epochs=5, workers=2, min_workers=1, max_workers=2))
    sched.tick()
    service.reconciler.sync_once()
    with pytest.raises(WorkerNotFound, match="'w9' is not a member"):
        service.drain(job.id, "w9")
    member = cluster.snapshot(job.id).workers[0]
    service.drain(job.id, member.worker)
    entry = sched.state.job(job.id)
    assert sum(k for _, k in entry.allocation) == 1 and entry.max_workers == 1
    assert [(c.slots, c.leaving) for c in sched.assigned] == [(entry.allocation,
                                                               (member.worker,))]
    assert member.node not in dict(entry.allocation) or dict(entry.allocation)[member.node] < 2
    assert ("drain", job.id) not in cluster.calls
    sched.tick()  # a round keeps it at one: the slot stays free
    assert sum(k for _, k in sched.state.job(job.id).allocation) == 1
    other = cluster.snapshot(job.id).workers[1].worker
    with pytest.raises(JobConflict) as err:
        service.drain(job.id, other)
    assert str(err.value) == (
        f"cannot drain the last worker ({other}) of job {job.id}: cancel the job to stop it"
    )


def test_a_restarted_api_leaves_queued_jobs_queued_and_tells_a_new_scheduler(setup):
    service, cluster, _ = setup
    a = service.submit(_gang("a"))
    b = service.submit(_gang("b"))
    service.scheduling.tick()
    # A new API process and a new scheduler, over the same store and cluster.
    fresh = RoundsScheduling(cluster)
    again = JobService(service.store, cluster, Settings(sync_interval_s=0), scheduling=fresh)
    again.reconciler.start()
    try:
        assert fresh.syncs >= 1 and {j.job_id for j in fresh.state.jobs} == {a.id, b.id}
        assert again.get(b.id).state == JobState.PENDING  # not failed as "lost"
        assert again.get(a.id).state != JobState.FAILED
    finally:
        again.reconciler.stop()


def test_a_parameter_server_learner_is_drained_through_the_scheduler(setup, monkeypatch):
    """As a synchronous job's worker: the scheduler takes the slot on the learner's node off
    the job, naming the learner (its driver places learners by the same rule, so that one
    leaves: test_ps_assign.py)."""
    from dynabatch.scheduler.telemetry import PSStatus

    service, cluster, sched = setup
    job = service.submit(JobSpec(name="a", epochs=5, workers=2, min_workers=1, max_workers=2))
    sched.tick()
    service.reconciler.sync_once()
    snap = cluster.snapshot(job.id)
    ps = PSStatus(mode="async", version=0, applied=0, refused=0, pushes=0, pushes_per_s=0.0)
    monkeypatch.setattr(cluster, "snapshot", lambda _: snap.model_copy(update={"ps": ps}))
    member = snap.workers[0]
    service.drain(job.id, member.worker)
    entry = sched.state.job(job.id)
    assert sum(k for _, k in entry.allocation) == 1 and entry.max_workers == 1
    assert [(c.slots, c.leaving) for c in sched.assigned] == [(entry.allocation,
                                                               (member.worker,))]


def test_a_resume_the_scheduler_refuses_is_a_409_with_its_reason(setup, tmp_path, monkeypatch):
    """Not a 503 as if Ray were gone: the scheduler's reason, and the job FAILED with it."""
    _, cluster, sched = setup
    service = JobService(
        JobStore(":memory:"), cluster,
        Settings(sync_interval_s=0, checkpoint_root=str(tmp_path)), scheduling=sched,
    )
    spec = JobSpec(name="a", epochs=5, workers=1, checkpoint={"dir": str(tmp_path)})
    job = service.submit(spec)
    sched.tick()
    service.reconciler.sync_once()
    service.reconciler.sync_once()  # an epoch trained and checkpointed
    assert service.cancel(job.id).state == JobState.CANCELLED
    why = "min_workers 1: the cluster has 0 worker slots; the job could never start"

    def refuse(*_):
        raise Refused(why)

    monkeypatch.setattr(sched, "register", refuse)
    with pytest.raises(JobConflict) as err:
        service.resume(job.id)
    assert str(err.value) == f"job {job.id} cannot be resumed: {why}"
    assert service.get(job.id).state == JobState.FAILED
    assert service.get(job.id).reason.endswith(f"not resumed: {why}")


def test_a_resumed_job_started_between_two_ticks_is_followed_to_its_new_generation(
    setup, tmp_path
):
    """The scheduler started the resumed job's next generation before the service's next
    tick: no answer in between had it queued, and the service still looks that generation
    up (its calls went to the dead one, found gone again: a second resume, unasked)."""
    _, cluster, sched = setup
    service = JobService(
        JobStore(":memory:"), cluster,
        Settings(sync_interval_s=0, checkpoint_root=str(tmp_path)), scheduling=sched,
    )
    job = service.submit(JobSpec(name="a", epochs=5, workers=1,
                                 checkpoint={"dir": str(tmp_path)}))
    sched.tick()
    service.reconciler.sync_once()
    service.reconciler.sync_once()  # an epoch trained and checkpointed
    cluster.kill(job.id)
    service.reconciler.sync_once()  # found gone: resumed as generation 1, queued
    assert service.get(job.id).resumes == 1
    sched.tick()  # generation 1 starts before the next tick
    for _ in range(4):
        service.reconciler.sync_once()
    rec = service.get(job.id)
    assert rec.resumes == 1 and rec.state == JobState.SUCCEEDED
    assert cluster.followed[job.id] == cluster.generations[job.id] == 1


def test_an_embedded_apis_restart_resumes_a_started_job_as_a_recorded_resume(tmp_path):
    """``dynabatch serve`` (embedded Ray, the scheduler on) killed and started again: the
    job that trained is resumed from its checkpoint as the store's next generation (one
    resume counted and logged, its log's lines kept after the stored ones, its history
    re-read), not started again by the new scheduler as the same generation, unrecorded,
    whose first lines the service then took for ones it had."""
    cluster = FakeCluster(embedded=True, steps_per_epoch=1)
    cluster.connect()
    store = JobStore(str(tmp_path / "jobs.db"))
    settings = Settings(sync_interval_s=0, checkpoint_root=str(tmp_path))
    service = JobService(store, cluster, settings, scheduling=RoundsScheduling(cluster))
    job = service.submit(JobSpec(name="a", epochs=4, workers=1,
                                 checkpoint={"dir": str(tmp_path / "ckpt")})).id
    queued = service.submit(_gang("q"))  # one node short: it waits in the queue
    service.scheduling.tick()
    for _ in range(2):  # epochs 0 and 1 trained and checkpointed
        service.reconciler.sync_once()
    stored = [x.message for x in service.logs(job)]
    # Killed: the embedded Ray's coordinators go with the process; a new process, Ray and
    # scheduler over the same store.
    cluster = FakeCluster(embedded=True, steps_per_epoch=1)
    cluster.connect()
    fresh = RoundsScheduling(cluster, slots=1)
    again = JobService(store, cluster, settings, scheduling=fresh)
    again.reconciler.start()
    try:
        rec = again.get(job)
        assert rec.resumes == 1 and fresh.specs[job][1] == 1
        assert again.get(queued.id).state == JobState.PENDING and queued.id not in cluster.launches
        for _ in range(8):
            fresh.tick()
            again.reconciler.sync_once()
        rec = again.get(job)
        assert rec.state == JobState.SUCCEEDED and rec.resumes == 1
        lines = [x.message for x in again.logs(job)]
        assert lines[:len(stored)] == stored
        assert any("resuming from its checkpoint (automatic resume 1 of" in m for m in lines)
        assert any(m.startswith("resuming from checkpoint at epoch") for m in lines)
        assert [r.epoch for r in again.history(job)] == [0, 1, 2, 3]
    finally:
        again.reconciler.stop()
        store.close()

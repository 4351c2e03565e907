"""The service's history is the job's, after a roll-back too.

When every worker holding a job's state is lost, its coordinator goes back to the last
checkpoint, and its history with it; the epochs after the checkpoint are trained again.
The service's store kept the records it had synced of the lost epochs, and never synced
the ones trained again (it read on from the epoch after its last), so the REST history,
the job's page and the CLI showed epochs the job no longer had.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.api.metrics import JobCollector
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sim.cluster_spec import Fault
from dynabatch.service.job_service import JobService
from dynabatch.service.settings import Settings
from dynabatch.service.store import JobStore

from tests.fakes import FakeCluster
from tests.unit.test_cluster_service import RoundsScheduling


def _service(tmp_path: Path, scheduler: bool
             ) -> tuple[JobService, FakeCluster, RoundsScheduling | None, str]:
    """A 6-epoch job of 16 steps an epoch (two segments) on two nodes, checkpointed every
    2 epochs, that steps only when told (``FakeCluster.advance``); with ``scheduler``, the
    cluster scheduler's rounds start it and the service syncs it through them, as under
    ``dynabatch serve``'s defaults. Both workers die at step 8 of epoch 3 (their nodes
    stay)."""
    cluster = FakeCluster(steps_per_epoch=16, auto_advance=False)
    cluster.connect()
    sched = RoundsScheduling(cluster) if scheduler else None
    service = JobService(JobStore(":memory:"), cluster,
                         Settings(sync_interval_s=0, checkpoint_root=str(tmp_path)),
                         scheduling=sched)
    job = service.submit(JobSpec(name="rb", epochs=6, workers=2, worker_cpus=2,
                                 checkpoint={"dir": str(tmp_path), "every_epochs": 2}))
    if sched is not None:
        sched.tick()  # the round that starts it
    service.reconciler.sync_once()
    for ordinal in (0, 1):
        cluster.coordinators[job.id].runtime.inject(
            Fault(kind="die", worker=ordinal, epoch=3, step=8))
    return service, cluster, sched, job.id


@pytest.mark.parametrize("scheduler", [True, False],
                         ids=["cluster scheduler on", "cluster scheduler off"])
@pytest.mark.parametrize("sync_each_step", [True, False],
                         ids=["synced every step", "rolled back and retrained between syncs"])
def test_the_stored_history_follows_a_roll_back(tmp_path: Path, scheduler: bool,
                                                 sync_each_step: bool) -> None:
    service, cluster, sched, job_id = _service(tmp_path, scheduler)
    coord = cluster.coordinators[job_id]
    for _ in range(200):  # synced until epoch 3 (the store has epochs 0-2)
        if coord.epoch >= 3:
            break
        cluster.advance(job_id)
        service.reconciler.sync_once()
    assert [r.epoch for r in service.history(job_id)] == [0, 1, 2]
    for _ in range(200):
        if coord.state.is_terminal:
            break
        cluster.advance(job_id)
        if sync_each_step:
            service.reconciler.sync_once()
            assert service.history(job_id) == coord.history()
    assert any("rolling back from checkpoint at epoch 2" in x.message for x in coord.logs())
    service.reconciler.sync_once()
    snap = service.get(job_id).current_snapshot()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    assert snap.rollbacks_total == 1
    if sched is not None:  # it ran as the scheduler's job, which the service told it ended
        assert sched.syncs > 0 and sched.ended == [job_id]
    fams = {f.name: f for f in JobCollector._job_families([snap])}
    assert fams["dynabatch_job_rollbacks"].samples[0].value == 1
    # Epoch 2 was trained twice: the store has the second time (the job's new group), as
    # the job does, not the record of the group that was lost.
    stored = service.history(job_id)
    assert stored == coord.history()
    assert [r.epoch for r in stored] == list(range(6))
    assert stored[2].generation == 2
    service.store.close()

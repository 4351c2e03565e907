"""A parameter-server job end to end on a real multi-node Ray cluster: a learner's node is
lost mid-run, its in-flight samples are re-queued, nobody regroups, and every epoch is still
applied exactly once."""

from __future__ import annotations

import threading

import pytest

from actors.spec import JobSpec
from scheduler.ps_driver import PSCoordinator
from scheduler.state import JobState

from .conftest import wait_for

pytestmark = pytest.mark.integration


def test_ps_job_survives_a_lost_learner_exactly_once(cluster):
    tag = "ps_loss"
    nodes = [cluster.add_node(num_cpus=1, resources={tag: 1}, object_store_memory=80 * 2**20)
             for _ in range(3)]
    cluster.wait_for_nodes()
    spec = JobSpec.model_validate(dict(
        name=tag, dataset={"name": "digits"}, model={"name": "mlp", "hidden": 64},
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.5}, workers=3, global_batch=48,
        epochs=4, seed=3, node_resource=tag, worker_wait_timeout_s=20,
        protocol={"name": "ps", "mode": "async", "lr_staleness": "per_gradient",
                  "max_staleness": 8},
    ))
    coord = PSCoordinator("ps-loss", spec)
    thread = threading.Thread(target=coord.run, daemon=True)
    thread.start()
    # Some pushes in, then the node of one learner goes away mid-epoch.
    wait_for(lambda: (s := coord.snapshot().ps) is not None and s.applied >= 10, timeout=60)
    victim = next(w for w, (_, _, node) in coord._learners.items())
    node_id = coord._learners[victim][2]
    cluster.remove_node(next(n for n in nodes if n.node_id == node_id), allow_graceful=False)
    thread.join(timeout=90)
    snap = coord.snapshot()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    hist = coord.history()
    assert [r.epoch for r in hist] == [0, 1, 2, 3]
    assert all(r.verified and r.samples_trained == r.dataset_size for r in hist)
    assert any(e.kind == "failure" and e.worker == victim for e in coord.events)
    lost = {w.worker: w for w in snap.ps.workers}[victim]
    assert not lost.member
    assert snap.ps.applied == sum(w.applied for w in snap.ps.workers)
    assert snap.ps.version > 0 and hist[-1].test_accuracy > 0.5

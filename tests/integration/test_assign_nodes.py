"""Issue 31 item 4 (its seam) on a real Ray cluster: a running job told to train on two
other nodes moves there at step boundaries (new workers pinned to the named nodes, the state
handed over before the old ones leave) and ends SUCCEEDED with every epoch verified.

Four nodes: the session's three (``dynabatch_worker``) and one more that carries the same
resource, added here and removed at the end; nodes already up start workers sooner than
fresh ones.
"""

from __future__ import annotations

import pytest
import ray
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sync.coordinator import Coordinator

from .conftest import wait_for

pytestmark = pytest.mark.integration


def test_a_running_job_moves_to_two_other_nodes(cluster):
    tag = "dynabatch_worker"  # the session's nodes' resource
    added = cluster.add_node(num_cpus=1, resources={tag: 1}, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(tag)]
    assert len(nodes) == 4, nodes
    spec = JobSpec.model_validate(
        dict(
            name="assign_nodes",
            dataset={"name": "digits"},
            model={"name": "mlp", "hidden": 64},
            optimizer={"name": "sgd", "lr": 0.1},
            workers=2,
            min_workers=2,
            max_workers=2,
            global_batch=64,
            epochs=3,
            seed=5,
            node_resource=tag,
            spares=0,
            collective_timeout_s=5,
            worker_wait_timeout_s=30,
        )
    )
    coord = Coordinator("assign", spec, resume=False)
    try:
        # The test drives the loop itself, so the job cannot finish while the new workers
        # start (a thread running it would race them).
        while coord.epoch < 1:
            assert coord.step(), coord.snapshot().reason
        old = {m.node for m in coord.membership.members}
        new = sorted(n for n in nodes if n not in old)
        assert len(old) == 2 and len(new) == 2
        coord.assign({new[0]: 1, new[1]: 1})
        pending = coord.membership.pending
        while not pending:  # up to the next boundary, which starts its workers
            assert coord.step(), coord.snapshot().reason
        assert {m.node for m in pending.values()} == set(new)

        def joined() -> bool:
            coord.roster.adopt_started(1.0)
            return not pending

        wait_for(joined, timeout=120, interval=0.0)
        while coord.step():
            pass
    finally:
        if not coord.state.is_terminal:
            coord.shutdown()
        cluster.remove_node(added)
    snap = coord.snapshot()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    hist = coord.history()
    assert [r.epoch for r in hist] == [0, 1, 2]
    assert all(r.verified for r in hist)
    assert {w.node for w in snap.workers} == set(new)
    events = coord.membership_events()
    assert {e.node for e in events if e.kind == "leave"} == old
    assert {e.node for e in events if e.kind == "join"} >= set(new)
    assert not [e for e in events if e.kind in ("failure", "evict")]

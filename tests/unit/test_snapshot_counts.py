"""Issue 24 item 3: a job's snapshot (status, REST, the page, /metrics and `run`'s final
table all read it) counts each worker's partition once: between epochs and after the job
ends it used to add the ended epoch's trained samples to the next epoch's whole plan."""

from __future__ import annotations

import pytest
from dynabatch.scheduler.core.lifecycle import JobState

from tests.unit.test_engine_faults import N, _job, _spec


@pytest.mark.parametrize("mode", ["epoch", "adaptive"])
def test_partitions_sum_to_the_dataset_at_every_step_and_at_the_end(mode):
    coord, _, _ = _job(_spec(rebalance={"mode": mode}))
    sums = []
    while coord.step():
        snap = coord.snapshot()
        if snap.workers and any(w.partition for w in snap.workers):
            sums.append(sum(w.partition for w in snap.workers))
    snap = coord.snapshot()
    assert snap.state == JobState.SUCCEEDED
    assert sums and max(sums) == N, sorted(set(sums))
    last = coord.history()[-1]
    assert {w.worker: w.partition for w in snap.workers} == {
        w.worker: w.partition for w in last.workers}
    assert sum(w.partition for w in snap.workers) == N

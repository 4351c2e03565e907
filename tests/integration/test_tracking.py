"""Experiment tracking on real Ray workers: a job with ``tracking.tensorboard`` leaves
TensorBoard event files that TensorBoard's own reader reads back, with each epoch's loss and
each worker's share of the epoch's samples."""

from __future__ import annotations

import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sync.coordinator import Coordinator
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.integration


def test_a_ray_job_writes_tensorboard_scalars_per_epoch_and_per_worker(cluster, tmp_path):
    spec = JobSpec.model_validate(
        {
            "name": "tracked",
            "dataset": {
                "name": "synthetic",
                "options": {"n_samples": 256, "n_features": 8, "n_classes": 2},
            },
            "model": {"name": "mlp", "hidden": 8},
            "workers": 2,
            "global_batch": 32,
            "epochs": 2,
            "seed": 3,
            "node_resource": "dynabatch_worker",
            "collective_timeout_s": 10,
            "tracking": {"tensorboard": str(tmp_path / "tb")},
        }
    )
    coord = Coordinator("tracked1", spec, resume=False)
    try:
        snap = coord.run()
    finally:
        coord.shutdown()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    history = coord.history()
    acc = EventAccumulator(str(tmp_path / "tb" / "tracked1"), size_guidance={"scalars": 0})
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("epoch/train_loss")]
    assert loss == [(r.epoch, pytest.approx(r.train_loss)) for r in history]
    assert len(loss) == 2
    workers = sorted(w.worker for w in history[-1].workers)
    assert len(workers) == 2
    shares = {w: [e.value for e in acc.Scalars(f"worker_share/{w}")] for w in workers}
    assert all(len(v) == 2 and all(0 < x < 1 for x in v) for v in shares.values()), shares
    assert sum(v[-1] for v in shares.values()) == pytest.approx(1.0)
    steps = acc.Scalars("step/loss")
    assert len(steps) == sum(r.steps for r in history)
    assert [e.step for e in steps] == sorted(e.step for e in steps)

"""``dynabatch.run(spec)`` on real Ray workers: the embedded run a notebook makes, its
progress on stdout, the result it returns (state, history, the exported model), and the
experiment tracking it writes: TensorBoard event files that TensorBoard's own reader reads
back, with each epoch's loss and each worker's share of the epoch's samples. One job checks
both, since each job costs its workers' start."""

from __future__ import annotations

import pytest
import torch
from dynabatch import JobSpec, load_model, run
from dynabatch.scheduler.core.lifecycle import JobState
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.integration


def test_run_returns_history_and_model_and_writes_tensorboard_scalars_per_epoch_and_worker(
    cluster, tmp_path, capsys
):
    spec = JobSpec.model_validate(
        {
            "name": "pyrun",
            "dataset": {
                "name": "synthetic",
                "options": {"n_samples": 256, "n_features": 8, "n_classes": 2},
            },
            "model": {"name": "mlp", "hidden": 8},
            "workers": 2,
            "global_batch": 64,
            "epochs": 2,
            "seed": 3,
            "node_resource": "dynabatch_worker",
            "collective_timeout_s": 10,
            "spares": 0,  # no spare process on the idle third node
            "artifacts": {"dir": str(tmp_path / "models")},
            "tracking": {"tensorboard": str(tmp_path / "tb")},
        }
    )
    # The session's cluster, without its cluster scheduler (another test may leave one).
    result = run(spec, address=cluster.address, scheduler=False)
    assert result.state == JobState.SUCCEEDED and result.succeeded, result.reason
    history = result.history
    assert [r.epoch for r in history] == [0, 1]
    assert all(r.verified for r in history)  # every sample trained exactly once
    assert result.model_dir == str(tmp_path / "models" / result.job_id)
    model = load_model(result.model_dir)
    assert model(torch.randn(3, 8)).shape[0] == 3
    out = capsys.readouterr().out
    losses = [f"{r.train_loss:.4f}" for r in history]
    assert all(loss in out for loss in losses)  # a line per epoch
    assert "SUCCEEDED" in out  # the bar's last state

    # TensorBoard's reader: a loss per epoch, each worker's share per epoch, a loss per step.
    acc = EventAccumulator(str(tmp_path / "tb" / result.job_id), size_guidance={"scalars": 0})
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

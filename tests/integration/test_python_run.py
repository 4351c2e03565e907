"""``dynabatch.run(spec)`` on real Ray workers: the embedded run a notebook makes, its
progress on stdout, and the result it returns (state, history, the exported model)."""

from __future__ import annotations

import pytest
import torch
from dynabatch import JobSpec, load_model, run
from dynabatch.scheduler.core.lifecycle import JobState

pytestmark = pytest.mark.integration


def test_run_trains_a_small_job_and_returns_its_history_and_model(cluster, tmp_path, capsys):
    spec = JobSpec.model_validate(
        {
            "name": "pyrun",
            "dataset": {"name": "synthetic", "options": {"n_samples": 256, "n_features": 8}},
            "model": {"name": "mlp", "hidden": 8},
            "workers": 2,
            "global_batch": 64,
            "epochs": 2,
            "seed": 3,
            "node_resource": "dynabatch_worker",
            "collective_timeout_s": 10,
            "artifacts": {"dir": str(tmp_path / "models")},
        }
    )
    # The session's cluster, without its cluster scheduler (another test may leave one).
    result = run(spec, address=cluster.address, scheduler=False)
    assert result.state == JobState.SUCCEEDED and result.succeeded, result.reason
    assert [r.epoch for r in result.history] == [0, 1]
    assert all(r.verified for r in result.history)  # every sample trained exactly once
    assert result.model_dir == str(tmp_path / "models" / result.job_id)
    model = load_model(result.model_dir)
    assert model(torch.randn(3, 8)).shape[0] == 3
    out = capsys.readouterr().out
    losses = [f"{r.train_loss:.4f}" for r in result.history]
    assert all(loss in out for loss in losses)  # a line per epoch
    assert "SUCCEEDED" in out  # the bar's last state

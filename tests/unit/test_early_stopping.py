"""early_stopping and checkpoint.keep_best (issue 33, item 3), on the real coordinator over
the simulator's runtime with the test's model replicas (``tests.fakes.Lineages``): its
held-out loss is 1.0 every epoch (it never improves) and its accuracy is the share of 100
steps the weights trained (it improves every epoch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dynabatch.actors.spec import SpecError, parse_spec
from dynabatch.scheduler.checkpoint import checkpoint_path
from dynabatch.scheduler.core.regime.stopping import judge, should_stop

STEPS = 4  # steps per epoch: 256 samples at a global batch of 64


def _job(job_id: str, **kw: Any) -> tuple[Any, Any]:
    """test_checkpoint's job of 2 workers on 256 samples, for 6 epochs unless told."""
    from tests.unit.test_checkpoint import _fake_job

    return _fake_job(job_id, **{"epochs": 6, **kw})


def test_a_metric_that_stops_improving_ends_the_job_succeeded_early():
    job, _ = _job("es-a", early_stopping={"metric": "loss", "mode": "min", "patience": 2})
    job.run()
    snap = job.snapshot()
    assert snap.state.value == "SUCCEEDED", snap.reason
    # Epoch 0 is the best; epochs 1 and 2 do not improve on it: the job ends after epoch 2.
    assert [r.epoch for r in job.history()] == [0, 1, 2]
    assert snap.reason == (
        "early stopping: loss has not improved on epoch 0's 1 for 2 epochs (patience 2)"
    )
    assert any(x.message.startswith("early stopping: loss") for x in job.logs())


def test_an_improving_metric_trains_every_epoch():
    job, _ = _job(
        "es-b", epochs=3, early_stopping={"metric": "accuracy", "mode": "max", "patience": 1}
    )
    job.run()
    snap = job.snapshot()
    assert snap.state.value == "SUCCEEDED" and snap.reason is None
    assert [r.epoch for r in job.history()] == [0, 1, 2]


@pytest.mark.parametrize(("mode", "best_epoch"), [("min", 0), ("max", 2)])
def test_the_best_checkpoint_is_kept_beside_the_latest(tmp_path: Path, mode: str, best_epoch: int):
    job, _ = _job(
        "kb",
        epochs=3,
        checkpoint={"dir": str(tmp_path), "keep_best": {"metric": "accuracy", "mode": mode}},
    )
    job.run()
    assert job.snapshot().state.value == "SUCCEEDED", job.snapshot().reason
    latest = torch.load(checkpoint_path(tmp_path, "kb"), weights_only=True)
    best = torch.load(tmp_path / "kb" / "best.pt", weights_only=True)
    assert latest["epoch"] == 3 and len(latest["weights"]["lineage"]) == 3 * STEPS
    # The best epoch's weights and position, whatever was written after it.
    assert best["epoch"] == best_epoch + 1
    assert len(best["weights"]["lineage"]) == (best_epoch + 1) * STEPS
    acc = job.history()[best_epoch].scores["accuracy"]
    assert best["best"] == {"metric": "accuracy", "mode": mode, "value": acc, "epoch": best_epoch}


def test_judged_metrics_must_be_computed_by_the_job():
    with pytest.raises(SpecError) as err:
        parse_spec({"loss": "mse", "early_stopping": {"metric": "accuracy", "mode": "max"}})
    assert str(err.value) == (
        "early_stopping.metric: 'accuracy' is not a metric this job computes: use one of loss, mse"
    )
    with pytest.raises(SpecError) as err:
        parse_spec({"checkpoint": {"keep_best": {"metric": "loss", "mode": "min"}}})
    assert str(err.value).startswith("checkpoint.keep_best: needs checkpoint.dir")
    spec = parse_spec(
        {
            "metrics": [{"name": "f1", "fn": "m.x:f1"}],
            "early_stopping": {"metric": "f1", "mode": "max"},
        }
    )
    assert spec.early_stopping.patience == 3


@pytest.mark.parametrize(
    ("values", "mode", "delta", "best", "stale"),
    [
        ([], "min", 0.0, None, 0),
        ([3.0, 2.0, 2.5, None, 2.0], "min", 0.0, 1, 2),  # a tie is no improvement
        ([0.5, 0.6, 0.605, 0.61], "max", 0.02, 1, 2),  # within min_delta: not better
        ([float("nan"), 1.0], "max", 0.0, 1, 0),
    ],
)
def test_judge(values, mode, delta, best, stale):
    j = judge(values, mode, delta)
    assert (j.best, j.stale) == (best, stale)
    assert should_stop(j, 2) is (best is not None and stale >= 2)

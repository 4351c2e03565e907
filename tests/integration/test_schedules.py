"""Schedules on real Ray workers: a stage change re-plans the new global batch over the
workers with its scaled learning rate, the larger stage's shares accumulate in micro-batches,
and ISGD's flagged batches are repeated by every worker, each keeping the chart through long
segments (one job, three nodes)."""

from __future__ import annotations

import math

import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sync.coordinator import Coordinator

pytestmark = pytest.mark.integration


def test_stage_change_and_isgd_on_ray(cluster):
    spec = JobSpec.model_validate(dict(
        name="stages", dataset={"name": "digits", "limit": 600},
        model={"name": "mlp", "hidden": 32},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}, workers=3, epochs=4,
        seed=3, node_resource="dynabatch_worker", collective_timeout_s=10, policy="dbs",
        schedule={"stages": [{"epochs": 1, "global_batch": 30},
                             {"epochs": 3, "global_batch": 60}], "lr_scaling": "sqrt"},
        isgd={"enabled": True, "window": 4, "sigma": 0.5, "max_extra": 2},
        # A memory cap below the second stage's shares (~20 of 60): they accumulate.
        micro_batch=12,
    ))
    coord = Coordinator("stages-isgd", spec, resume=False)
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    hist = coord.history()
    assert [r.global_batch for r in hist] == [30, 60, 60, 60]
    assert hist[-1].lr == pytest.approx(0.1 * 2 ** 0.5)  # sqrt(60/30)
    for r in hist:
        assert r.verified and r.samples_trained == r.dataset_size == 600
        assert sum(w.batch for w in r.workers) == r.global_batch
        # Every flagged batch kept training, at most max_extra; the coordinator replayed
        # the workers' charts from their reports (a disagreement fails the job).
        assert r.isgd_flagged <= r.isgd_extra_iterations <= 2 * r.isgd_flagged
    assert hist[0].isgd_flagged == 0
    # Stage 1's shares (~10) fit in one micro-batch; stage 2's are accumulated.
    assert hist[0].breakdown.micro_batches == pytest.approx(1.0)
    assert all(r.breakdown.micro_batches > 1.0 for r in hist[1:])
    # σ = 0.5 flags batches once the loss levels off (the simulator flags 5 of this job's
    # batches); the workers agreed on every decision (a disagreement would have broken the
    # collective and failed the job).
    assert sum(r.isgd_flagged for r in hist) > 0
    assert hist[-1].test_accuracy > 0.6


def test_goodput_on_ray_reads_local_gradients_before_the_all_reduce(cluster):
    """Goodput mode on real workers: each holds its gradient buckets back until it has read
    |g_i|² of its own share, so the noise estimate has unequal-batch points every step."""
    spec = JobSpec.model_validate(dict(
        name="goodput", dataset={"name": "digits", "limit": 600},
        model={"name": "mlp", "hidden": 32},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        workers=3, epochs=3, global_batch=48, seed=5, node_resource="dynabatch_worker",
        collective_timeout_s=10, policy="dbs",
        schedule={"mode": "goodput", "max_global_batch": 192},
    ))
    coord = Coordinator("goodput", spec, resume=False)
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    hist = coord.history()
    for r in hist:
        assert r.verified and r.samples_trained == r.dataset_size == 600
        assert sum(w.batch for w in r.workers) == r.global_batch
    # Local and global norms reached the estimator: it produced a finite, positive noise
    # scale and chose a batch from it. Not in every epoch: each epoch's estimate is a
    # regression over its steps' points, and with the shares DBS picks from measured speed
    # (so from the machine's load) one epoch's fit can come out unusable (no estimate before
    # the first usable one) or with a negative slope (tr(Σ) clipped to 0). Every epoch of
    # the earlier fresh-clone runs had a positive one; in one run of issue 32's suite work an
    # epoch did not (2 cores, the unit tier beside it).
    scales = [r.noise_scale for r in hist]
    assert any(s is not None and s > 0 for s in scales), scales
    assert all(s is None or (math.isfinite(s) and s >= 0) for s in scales), scales
    assert all(r.goodput_batch is not None for r in hist)
    # It trained (the simulator's real-gradient run of this job: 2.28 -> 1.63).
    assert hist[-1].train_loss < hist[0].train_loss - 0.2

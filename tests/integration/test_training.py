"""Core training on a real multi-node Ray cluster (cluster_utils)."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.worker import Worker
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sync.coordinator import Coordinator

from tests.unit.test_weighted_update import (
    CUTS,
    SHARES,
    STEP,
    one_process_weights,
    segment,
    spec_of,
    step_data,
)

pytestmark = pytest.mark.integration


def _spec(**kw) -> JobSpec:
    base = dict(name="t", dataset={"name": "digits"}, model={"name": "mlp", "hidden": 32},
                optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}, workers=3,
                global_batch=64, epochs=2, seed=3, node_resource="dynabatch_worker",
                collective_timeout_s=10)
    base.update(kw)
    return JobSpec.model_validate(base)


def test_a_users_loss_on_ray_workers_makes_one_process_update_and_its_prints_are_logged(cluster):
    """3 Ray workers with batches 5, 11 and 48, under a user's loss named by import path
    that prints, make the update of one process on the 64 samples (the bucketed
    all-reduce, two steps); each worker's prints come back through Ray's log API. The
    other losses and all-reduce plans are checked on a gloo group of processes
    (``tests/unit/test_weighted_update.py``)."""
    from dynabatch.actors.output import ActorOutput

    spec = spec_of(loss="tests.unit.workload_plugins:chatty_ce", allreduce="bucketed",
                   node_resource="dynabatch_worker")
    x, y, shape, classes = step_data(spec)
    cls = ray.remote(Worker)
    workers = [cls.options(num_cpus=1).remote(f"w{i}", i, spec, x, y, shape, classes)
               for i in range(len(SHARES))]
    rv = ray.get(workers[0].open_store.remote(1, len(SHARES)))
    ray.get([w.join.remote(rv, r, 0) for r, w in enumerate(workers)])
    for epoch in range(2):  # two steps, so momentum is exercised too
        results = ray.get([w.run_segment.remote(segment(epoch, r, spec.seed))
                           for r, w in enumerate(workers)], timeout=120)
        for rank, r in enumerate(results):
            assert r.error is None, r.error
            (st,) = r.steps
            # The all-reduce itself saw each of the 64 positions exactly once.
            assert st.coverage == ((1, STEP),) and st.start == CUTS[rank]
    states = ray.get([w.state.remote() for w in workers], timeout=60)
    ref = one_process_weights(spec)
    for st in states:
        for k, v in ref.items():
            assert torch.allclose(st["model"][k], v, atol=1e-5, rtol=0), k
    got: list[tuple[str, str, str]] = []
    out = ActorOutput.for_ray(lambda *line: got.append(line))
    for i, w in enumerate(workers):
        out.watch(f"w{i}", ray.get(w.actor_id.remote(), timeout=60))
        out.unwatch(f"w{i}")  # read once, to the end
    out.poll()
    for i, b in enumerate(SHARES):
        assert (f"w{i}", "stdout", f"chatty batch of {b}") in got, got
    for w in workers:
        ray.kill(w)


def test_every_sample_trained_once_per_epoch(cluster):
    """Recorded indices: each epoch trains every training sample exactly once, with a
    dataset size that is not a multiple of the global batch and mid-epoch rebalances."""
    spec = _spec(epochs=2, global_batch=50,
                 rebalance={"mode": "steps", "every_steps": 3},
                 emulation={"slowdowns": [1, 2, 4]})
    coord = Coordinator("exactly-once", spec, resume=False)
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    n = coord.epochs.data.n_train
    assert n % 50 != 0
    for rec in coord.history():
        # From the workers' reports: the all-reduced coverage of every committed step.
        assert rec.verified
        assert rec.samples_trained == rec.dataset_size == n
        assert sum(w.partition for w in rec.workers) == n


def _compute_spread(rec) -> float:
    times = [w.compute_s for w in rec.workers]
    return max(times) / min(times)


def test_dbs_balances_unequal_nodes_where_static_cannot(cluster):
    """3 nodes at slowdowns 1, 2 and 4. Static batches leave per-worker compute ~4x apart;
    by epoch 3 the affine policy has about halved the slowest worker's compute per step,
    and digits trains to >= 0.9."""
    # Hidden 1024 keeps steps compute-dominated: a narrower MLP on digits is mostly fixed
    # per-step overhead, which the 4x node pays four times over whatever its batch.
    common = dict(model={"name": "mlp", "hidden": 1024}, global_batch=256, epochs=8,
                  optimizer={"name": "sgd", "lr": 0.2, "momentum": 0.9},
                  emulation={"slowdowns": [1, 2, 4]})
    static = Coordinator("balance-static", _spec(policy="static", **common), resume=False)
    assert static.run().state == JobState.SUCCEEDED
    spreads = [_compute_spread(r) for r in static.history()]
    assert 3.0 <= float(np.median(spreads)) <= 5.5, spreads  # about 4x apart

    coord = Coordinator("balance-affine", _spec(policy="affine", **common), resume=False)
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    hist = coord.history()
    # Shares follow speed: the 1x node gets the most, the 4x node the least.
    last = {w.slowdown: w.batch for w in hist[-1].workers}
    assert last[1.0] > last[2.0] > last[4.0] >= 1, last
    # Every step waits for its slowest worker, so what balancing buys is a shorter critical
    # path: the largest per-step compute among the workers (their reports' thread CPU time,
    # which load from other processes does not stretch). From epoch 3 (numbered from 0, as
    # the CLI and REST show them) it is about half of static's: 23 vs 45-47 ms, also with
    # two CPU-bound processes beside the cluster. The workers' compute does not meet: at
    # ~9 samples the 4x node's step is mostly per-step overhead paid four times, and the
    # share floor (min_share) keeps it there, so (slowest - fastest) / slowest stays
    # 0.22-0.35 here and was 0.44 in one CI run (plan 226/19/11), against static's ~0.76.
    # Timing targets are measured by bench/; this asserts the margins every run kept.
    def critical(rec) -> float:
        return max(w.compute_s / w.steps for w in rec.workers)

    gaps = [(max(w.compute_s for w in r.workers) - min(w.compute_s for w in r.workers))
            / max(w.compute_s for w in r.workers) for r in hist[3:]]
    static_gaps = [1 - 1 / sp for sp in spreads[3:]]
    plans = [line.message for line in coord.logs() if "rebalance" in line.message]
    ratio = (float(np.median([critical(r) for r in hist[3:]]))
             / float(np.median([critical(r) for r in static.history()[3:]])))
    assert ratio <= 0.75, (ratio, gaps, static_gaps, plans)
    assert float(np.median(gaps)) < float(np.median(static_gaps)), (gaps, static_gaps, plans)
    # Epoch wall times are not compared here: under load from other processes they swap
    # (affine 0.35 s vs static 0.30 s was seen with three other jobs on the 2 cores). The
    # speedup is measured side by side by bench/hetero.py.
    assert hist[-1].test_accuracy >= 0.9
    assert hist[-1].emulated
    # Same seed and order: the allocation never changes the math, so static and affine
    # reach the same accuracy.
    assert abs(hist[-1].test_accuracy - static.history()[-1].test_accuracy) <= 0.01


def test_a_loss_of_the_wrong_shape_fails_the_job_naming_the_field(cluster):
    spec = _spec(loss="tests.unit.workload_plugins:mean_loss", epochs=1)
    coord = Coordinator("badloss", spec, resume=False)
    snap = coord.run()
    assert snap.state == JobState.FAILED
    assert snap.reason.startswith("loss: 'tests.unit.workload_plugins:mean_loss' returned shape")

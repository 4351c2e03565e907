"""Parameter-server training on the simulator's virtual clock, with real gradients."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from actors.contracts import epoch_order
from actors.ps import ParamStore
from actors.spec import JobSpec
from actors.workloads.datasets import load_dataset
from scheduler.policy_ji import JiConfig, PerfAwareBatches
from scheduler.protocols.ps import PSConfig
from scheduler.ps_core import PSCore
from scheduler.ps_sim import PSSimConfig, SimLearner, simulate_ps

SPEC = JobSpec(dataset={"name": "digits", "limit": 96}, model={"name": "mlp", "hidden": 16},
               optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.5}, workers=3,
               global_batch=24, epochs=2)


def _learners(speeds):
    return tuple(SimLearner(f"w{i}", 0.001 / s) for i, s in enumerate(speeds))


def test_hardsync_equals_sgd_on_the_summed_batch():
    core = PSCore(PSConfig("hardsync"), dataset_size=96, epochs=2, seed=0,
                  batches=PerfAwareBatches(8))
    res = simulate_ps(SPEC, core, PSSimConfig(_learners([1, 1, 1]), noise=0.0))
    assert all(e["verified"] for e in res.epochs) and len(res.epochs) == 2
    assert set(t for v in res.staleness.values() for t in v) == {0}

    ds = load_dataset(SPEC.dataset, seed=0)
    ref = ParamStore(SPEC, tuple(ds.input_shape), ds.num_classes)
    params = [p for p in ref.model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.5)
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    for epoch in range(2):
        order = epoch_order(0, epoch, 96)
        for s in range(4):
            ids = torch.from_numpy(order[s * 24:(s + 1) * 24].astype(np.int64))
            opt.zero_grad()
            F.cross_entropy(ref.model(x[ids]), y[ids]).backward()
            opt.step()
    want = torch.nn.utils.parameters_to_vector(params).detach().numpy()
    assert np.abs(res.weights - want).max() < 1e-5


def test_async_with_a_lost_and_a_joining_learner_is_exactly_once():
    core = PSCore(PSConfig("async", lr_staleness="per_gradient", max_staleness=4),
                  dataset_size=96, epochs=2, seed=0, batches=PerfAwareBatches(8))
    cfg = PSSimConfig(_learners([1, 1, 2, 4]), lose=((0.01, "w3"),),
                      join=((0.02, SimLearner("w9", 0.0005)),))
    res = simulate_ps(SPEC, core, cfg)
    assert [e["verified"] for e in res.epochs] == [True, True]
    assert core.counters.lost_inflight_samples > 0
    assert res.snapshot["workers"]["w9"]["applied"] > 0
    assert max(t for v in res.staleness.values() for t in v) <= 4


def test_perf_aware_batches_follow_speeds_in_the_simulator():
    core = PSCore(PSConfig("async"), dataset_size=96, epochs=3, seed=0,
                  batches=PerfAwareBatches(8, JiConfig(b0=8, every_pushes=4)))
    simulate_ps(SPEC, core, PSSimConfig(_learners([1, 1, 2, 4]), noise=0.0))
    b = {w: core.batches.batch(w) for w in ("w0", "w1", "w2", "w3")}
    assert b["w0"] < b["w2"] < b["w3"] and abs(sum(b.values()) - 32) <= 2

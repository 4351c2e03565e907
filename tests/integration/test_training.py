"""Core training on a real multi-node Ray cluster (cluster_utils)."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.worker import Worker
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.actors.workloads.models import build_model
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sync.coordinator import Coordinator

pytestmark = pytest.mark.integration


def _spec(**kw) -> JobSpec:
    base = dict(name="t", dataset={"name": "digits"}, model={"name": "mlp", "hidden": 32},
                optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}, workers=3,
                global_batch=64, epochs=2, seed=3, node_resource="dynabatch_worker",
                collective_timeout_s=10)
    base.update(kw)
    return JobSpec.model_validate(base)


LM = dict(dataset={"name": "pysource", "options": {"chars": 20000, "seq_len": 16}},
          model={"name": "charlm", "hidden": 16, "options": {"heads": 2, "layers": 1}},
          loss="next_token")
REGRESSION = dict(dataset={"name": "tests.unit.workload_plugins:regression_loader",
                           "options": {"n": 96, "train": 64}}, loss="mse")
# A user loss by import path, which prints: Ray's log API must show each worker's lines.
USER_LOSS = dict(loss="tests.unit.workload_plugins:chatty_ce")
# Small buckets launched from backward's hooks, and memory caps that make the workers
# accumulate 2, 3 and 3 micro-batches.
ACCUMULATED = {"allreduce": "bucketed", "bucket_kb": 1, "micro_batch": [3, 4, 16]}


@pytest.mark.parametrize(("workload", "comm"), [
    ({}, {"allreduce": "flat"}), ({}, ACCUMULATED), (LM, {"allreduce": "bucketed"}),
    (REGRESSION, {"allreduce": "flat"}), (USER_LOSS, {"allreduce": "bucketed"}),
], ids=["cross_entropy-flat", "cross_entropy-bucketed-accumulated", "next_token-bucketed",
        "mse-flat", "user_loss-bucketed"])
def test_weighted_allreduce_equals_one_process_update(cluster, workload, comm):
    """3 workers with batches 5, 11 and 48 make the update of one process on 64 samples,
    for classification, a regression's mse, a language model's per-sample loss and a
    user's loss named by import path, with the flat and the bucketed all-reduce, and with
    micro-batch accumulation."""
    from dynabatch.actors.output import ActorOutput
    from dynabatch.actors.workloads.losses import resolve_loss

    spec = _spec(optimizer={"name": "sgd", "lr": 0.5, "momentum": 0.9}, **workload, **comm)
    ds = load_dataset(spec.dataset, seed=spec.seed)
    x, y = ds.x_train[:64], ds.y_train[:64]
    cls = ray.remote(Worker)
    workers = [cls.options(num_cpus=1).remote(f"w{i}", i, spec, x, y, ds.input_shape,
                                              ds.num_classes) for i in range(3)]
    rv = ray.get(workers[0].open_store.remote(1, 3))
    ray.get([w.join.remote(rv, r, 0) for r, w in enumerate(workers)])
    cuts = np.cumsum([0, 5, 11, 48])
    for epoch in range(2):  # two steps, so momentum is exercised too
        plans = [SegmentPlan(epoch, spec.seed, 64, (StepPlan(0, 0, 64, int(cuts[i]),
                                                              int(cuts[i + 1] - cuts[i])),))
                 for i in range(3)]
        results = ray.get([w.run_segment.remote(p) for w, p in zip(workers, plans, strict=True)],
                          timeout=120)
        for r, lo in zip(results, cuts, strict=False):
            assert r.error is None, r.error
            (st,) = r.steps
            # The all-reduce itself saw each of the 64 positions exactly once.
            assert st.coverage == ((1, 64),) and st.start == lo
            cap = (comm.get("micro_batch") or [None] * 3)[results.index(r)]
            assert st.micro_batches == (-(-st.samples // cap) if cap else 1)
    states = ray.get([w.state.remote() for w in workers], timeout=60)

    torch.manual_seed(spec.seed)
    model = build_model(spec.model, ds.input_shape, ds.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        xb = torch.from_numpy(x)
        yb = torch.from_numpy(y)
        resolve_loss(spec.loss or "cross_entropy")(model(xb), yb).mean().backward()
        opt.step()
    ref = model.state_dict()
    for st in states:
        for k, v in ref.items():
            assert torch.allclose(st["model"][k], v, atol=1e-5, rtol=0), k
    if workload is USER_LOSS:  # the user's prints, read back through Ray's log API
        got: list[tuple[str, str, str]] = []
        out = ActorOutput.for_ray(lambda *line: got.append(line))
        for i, w in enumerate(workers):
            out.watch(f"w{i}", ray.get(w.actor_id.remote(), timeout=60))
            out.unwatch(f"w{i}")  # read once, to the end
        out.poll()
        for i, b in enumerate((5, 11, 48)):
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
    n = coord.job.data.n_train
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

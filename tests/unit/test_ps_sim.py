"""Parameter-server training on the simulator's virtual clock, with real gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dynabatch.actors.contracts import epoch_order
from dynabatch.actors.ps import ParamStore
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.scheduler.core.ps.batch_policy import JiConfig, PerfAwareBatches
from dynabatch.scheduler.core.ps.machine import PSCore
from dynabatch.scheduler.core.ps.rudra import PSConfig
from dynabatch.scheduler.sim.cluster_spec import parse_cluster
from dynabatch.scheduler.sim.ps_job import simulate_ps

SPEC = JobSpec(dataset={"name": "digits", "limit": 96}, model={"name": "mlp", "hidden": 16},
               optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.5}, workers=3,
               global_batch=24, epochs=2)


def _run(core, speeds, noise=0.05, events=(), extra=(), ps=None, shards=1,
         final_train_loss=True):
    """``SPEC`` with one learner per speed, each on its own node (1 ms per sample at speed
    1); ``extra``: (class, ms per sample) of nodes that only join; ``ps``: push/pull costs
    (none: free) over ``shards`` servers."""
    classes = [{"name": f"n{i}", "count": 1, "a_ms": 0.0, "c_ms_per_sample": 1.0 / s}
               for i, s in enumerate(speeds)]
    classes += [{"name": n, "count": 0, "a_ms": 0.0, "c_ms_per_sample": c} for n, c in extra]
    cluster = parse_cluster({"classes": classes, "noise_sigma": noise, "events": list(events),
                             "parameter_server": ps or {"beta_ms_per_mb": 0.0}})
    protocol = SPEC.protocol.model_copy(update={"shards": shards})
    spec = SPEC.model_copy(update={"workers": len(speeds), "protocol": protocol})
    return simulate_ps(spec, core, cluster, final_train_loss=final_train_loss)


def test_hardsync_equals_sgd_on_the_summed_batch():
    core = PSCore(PSConfig("hardsync"), dataset_size=96, epochs=2, seed=0,
                  batches=PerfAwareBatches(8))
    res = _run(core, [1, 1, 1], noise=0.0)
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
    res = _run(core, [1, 1, 2, 4], events=[{"at_s": 0.01, "fail": {"class": "n3", "index": 0}},
                                           {"at_s": 0.02, "join": {"class": "n9"}}],
               extra=[("n9", 0.5)])
    assert [e["verified"] for e in res.epochs] == [True, True]
    assert core.lost_inflight_samples > 0
    # The driver names learners: the one started on the joining node is the fifth, w4.
    assert res.snapshot["workers"]["w4"]["applied"] > 0
    assert not res.snapshot["workers"]["w3"]["member"] and res.state == "SUCCEEDED"
    assert [r.epoch for r in res.history] == [0, 1]
    assert max(t for v in res.staleness.values() for t in v) <= 4


def test_perf_aware_batches_follow_speeds_in_the_simulator():
    core = PSCore(PSConfig("async"), dataset_size=96, epochs=3, seed=0,
                  batches=PerfAwareBatches(8, JiConfig(b0=8, every_pushes=4)))
    _run(core, [1, 1, 2, 4], noise=0.0)
    b = {w: core.batches.batch(w) for w in ("w0", "w1", "w2", "w3")}
    assert b["w0"] < b["w2"] < b["w3"] and abs(sum(b.values()) - 32) <= 2


def _grads(size: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) for _ in range(n)]


def test_k_shards_step_exactly_as_one_server():
    """Each slice with its own optimizer (SGD momentum, Adam) = one optimizer on the whole
    vector: both are elementwise, so sharding changes nothing but where the work runs."""
    from dynabatch.actors.ps import shard_bounds

    ds = load_dataset(SPEC.dataset, seed=0)
    shape = tuple(ds.input_shape)
    for opt in ({"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
                {"name": "adam", "lr": 0.01}):
        spec = SPEC.model_copy(update={"optimizer": SPEC.optimizer.model_validate(opt)})
        whole = ParamStore(spec, shape, ds.num_classes)
        bounds = shard_bounds(whole.size, 3)
        parts = [ParamStore(spec, shape, ds.num_classes, b) for b in bounds]
        grads = _grads(whole.size, 6)
        for i in range(0, 6, 2):
            pairs = [(grads[i], 0.5), (grads[i + 1], 0.125)]  # staleness-weighted mix
            whole.apply(pairs)
            for p, (lo, hi) in zip(parts, bounds, strict=True):
                p.apply([(g[lo:hi], w) for g, w in pairs])
        joined = np.concatenate([p.weights() for p in parts])
        assert np.abs(joined - whole.weights()).max() < 1e-6, opt["name"]
        assert [p.size for p in parts] == [hi - lo for lo, hi in bounds]


def test_adam_state_lives_on_the_server_and_staleness_scales_its_learning_rate():
    """With Adam a staleness factor on the gradient would be normalised away; the server
    applies the weights' sum as a learning-rate scale instead."""
    ds = load_dataset(SPEC.dataset, seed=0)
    spec = SPEC.model_copy(update={"optimizer": SPEC.optimizer.model_validate(
        {"name": "adam", "lr": 0.01})})
    (g,) = _grads(ParamStore(spec, tuple(ds.input_shape), ds.num_classes).size, 1)
    moved = {}
    for factor in (1.0, 0.25):
        store = ParamStore(spec, tuple(ds.input_shape), ds.num_classes)
        before = store.weights()
        store.apply([(g, factor)])
        moved[factor] = np.abs(store.weights() - before).mean()
        state = store.optimizer.state[store.flat]
        assert state["exp_avg"].shape == store.flat.shape and int(state["step"]) == 1
        assert store.optimizer.param_groups[0]["lr"] == 0.01  # the scale was for one step
    # Adam's first step moves each weight by about lr; a factor of 1/4 moves it 1/4 as far
    # (a factor on the gradient alone would move it just as far: 1.0).
    assert abs(moved[0.25] / moved[1.0] - 0.25) < 0.01


def test_parameter_server_costs_and_shards_in_the_simulator():
    from dynabatch.scheduler.sim.cluster_spec import ParameterServerModel

    ps = ParameterServerModel(push_ms=2.0, pull_ms=1.0, beta_ms_per_mb=50.0)
    assert ps.push_s(2 * 2**20, 1) == pytest.approx(0.002 + 0.1)
    assert ps.pull_s(2 * 2**20, 4) == pytest.approx(0.001 + 0.025)
    assert ps.push_s(2 * 2**20, 4) == pytest.approx(2 * 0.002 + 0.025)  # two phases

    def run(cost, shards=1):
        core = PSCore(PSConfig("async"), dataset_size=96, epochs=1, seed=0,
                      batches=PerfAwareBatches(8))
        return _run(core, [1], noise=0.0, ps=cost and cost.model_dump(), shards=shards,
                    final_train_loss=False)
    free, paid = run(None), run(ps)
    size = ParamStore(SPEC, (64,), 10).size
    per_push = ps.push_s(4 * size) + ps.pull_s(4 * size)
    assert paid.virtual_s - free.virtual_s == pytest.approx(12 * per_push)  # 96/8 pushes
    # A small model (6 KB): the commit's extra hop costs more than the slices save ...
    assert run(ps, shards=4).virtual_s > paid.virtual_s
    # ... where bytes dominate, k slices in parallel pay.
    slow = ParameterServerModel(push_ms=2.0, pull_ms=1.0, beta_ms_per_mb=5000.0)
    assert run(slow, shards=4).virtual_s < run(slow).virtual_s


def test_server_one_put_per_version_the_issue_interface_and_a_rolling_rate(monkeypatch):
    """The server actor's coroutines without Ray: learners pulling one version share one
    ``ray.put``; ``push(worker, grad, version_pulled, samples, compute_s)`` and ``pull()``;
    pushes per second forget what is older than the window."""
    import asyncio

    import ray
    from dynabatch.actors.ps import RATE_WINDOW_S, ParameterServer

    puts = []
    monkeypatch.setattr(ray, "put", lambda value: puts.append(value) or f"ref{len(puts)}")
    ds = load_dataset(SPEC.dataset, seed=0)
    core = PSCore(PSConfig("async"), dataset_size=96, epochs=1, seed=0,
                  batches=PerfAwareBatches(8))
    for w in ("w0", "w1", "w2"):
        core.join(w)
    server = ParameterServer(SPEC, core, tuple(ds.input_shape), ds.num_classes, ds.x_test,
                             ds.y_test)
    size = server.store.size

    async def scenario():
        replies = await asyncio.gather(*(server.request(w) for w in ("w0", "w1", "w2")))
        assert {r["work"].version for r in replies} == {0}
        assert [r["weights"] for r in replies] == [["ref1"]] * 3 and len(puts) == 1
        work = replies[0]["work"]
        with pytest.raises(ValueError, match="no open work"):
            await server.push("w0", np.zeros(size, np.float32), 0, work.chunk.samples + 1, 0.1)
        out = await server.push("w0", np.ones(size, np.float32), 0, work.chunk.samples, 0.1)
        assert out == {"version": 1}
        await server.push("w1", np.ones(size, np.float32), 0, 8, 0.1)  # version 2
        r = await server.request("w0")
        assert r["weights"] == ["ref2"] and len(puts) == 2  # the new version's one put
        version, weights = await server.pull()
        assert version == 2 and weights.shape == (size,)
        return server.started

    started = asyncio.run(scenario())
    assert asyncio.run(server.snapshot())["pushes_per_s"] > 0
    assert server.pushes_per_s(now=started + 100 * RATE_WINDOW_S) == 0.0  # not 2 / lifetime


def test_dynabatch_simulate_routes_a_ps_spec_to_the_ps_simulator(tmp_path):
    """``dynabatch simulate`` of a ``protocol: ps`` spec trains it through the parameter
    server on the cluster's nodes (with its push/pull costs), a node failure losing its
    learner; what the ps simulator cannot take is one line, exit 2."""
    import json

    import typer
    from dynabatch.api.cli import run as run_cli
    from dynabatch.api.cli import simulate as sim_cli
    from typer.testing import CliRunner

    (tmp_path / "job.yaml").write_text(
        "dataset: {name: digits, limit: 200}\nmodel: {name: mlp, hidden: 16}\nworkers: 3\n"
        "global_batch: 24\nepochs: 2\nprotocol: {name: ps, mode: async, shards: 2}\n")
    cluster = ("classes: [{name: fast, count: 2, a_ms: 1, c_ms_per_sample: 0.1},\n"
               "          {name: slow, count: 1, a_ms: 4, c_ms_per_sample: 0.4}]\n"
               "parameter_server: {push_ms: 1, pull_ms: 1}\n")
    app = typer.Typer()
    run_cli.register(app)
    sim_cli.register(app)

    def cli(cluster_text: str, *extra: str):
        (tmp_path / "cluster.yaml").write_text(cluster_text)
        return CliRunner().invoke(app, ["simulate", str(tmp_path / "job.yaml"), "--cluster",
                                        str(tmp_path / "cluster.yaml"), "--quiet", *extra],
                                  env={"COLUMNS": "200"})

    res = cli(cluster + "events: [{at_s: 0.01, fail: {class: slow}}]\n", "--report",
              str(tmp_path / "r.json"))
    assert res.exit_code == 0, res.output
    assert "protocol ps (async)" in res.output and "staleness mean" in res.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["simulation"]["protocol"] == "ps"
    assert [e["verified"] for e in report["epochs"]] == [True, True]
    workers = {w["worker"]: w for w in report["ps"]["workers"]}
    assert not workers["w2"]["member"]  # the slow node failed: its learner is gone
    res = cli(cluster + "events: [{epoch: 1, slowdown: {class: fast, factor: 2}}]\n")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "events.0" in res.output
    res = cli(cluster, "--dataset-size", "100")
    assert res.exit_code == 2 and "--dataset-size" in res.output


def test_one_failure_victim_rule_for_both_protocols():
    """One cluster file fails the same nodes whether a synchronous or a parameter-server job
    runs on it (one rule: the selected node, else the latest alive nodes hosting a worker,
    then idle ones)."""
    from dynabatch.scheduler.ps.driver import build_core
    from dynabatch.scheduler.sim.cluster_spec import Event, parse_cluster
    from dynabatch.scheduler.sim.cost_model import SimulatedCluster
    from dynabatch.scheduler.sim.simulator import simulate

    five = SimulatedCluster(parse_cluster({"classes": [
        {"name": "a", "count": 3, "a_ms": 4, "c_ms_per_sample": 1.0},
        {"name": "b", "count": 2, "a_ms": 4, "c_ms_per_sample": 1.0}]}))

    def fails(fail: object, busy: set[str] = frozenset()) -> list[str]:
        return [n.node_id for n in five.apply(Event(at_s=0.0, fail=fail), busy)]

    # Hosting a worker first, the latest first: b-00000 and a-00001 host workers.
    assert fails(2, busy={"a-00001", "b-00000"}) == ["b-00000", "a-00001"]
    assert fails({"class": "a", "count": 3}, busy={"a-00000"}) == ["a-00000", "a-00002"]
    assert fails({"class": "b", "index": 1}) == ["b-00001"]
    assert fails({"class": "b", "index": 1}) == []  # the selected node is dead already

    cluster = parse_cluster({
        "classes": [{"name": "a", "count": 3, "a_ms": 4, "c_ms_per_sample": 1.0},
                    {"name": "b", "count": 2, "a_ms": 4, "c_ms_per_sample": 1.0}],
        "recovery": {"start_s": 0.0, "detect_s": 0.01, "regroup_s": 0.01},
        "events": [{"at_s": 0.05, "fail": 1}, {"at_s": 0.1, "fail": {"class": "a"}},
                   {"at_s": 0.15, "fail": {"class": "b", "index": 0}}]})
    sync = simulate(JobSpec.model_validate(dict(workers="auto", global_batch=20, epochs=3)),
                    cluster, dataset_size=2000)
    ps_spec = JobSpec.model_validate(dict(
        dataset={"name": "digits", "limit": 400}, model={"name": "mlp", "hidden": 16},
        workers=5, global_batch=20, epochs=3, protocol={"name": "ps", "mode": "async"}))
    ds = load_dataset(ps_spec.dataset, seed=0)
    ps = simulate_ps(ps_spec, build_core(ps_spec, len(ds.y_train)), cluster, data=ds)
    want = [("fail", ("b-00001",)), ("fail", ("a-00002",)), ("fail", ("b-00000",))]
    assert [(h.kind, h.nodes) for h in sync.happened] == want
    assert [(h.kind, h.nodes) for h in ps.happened] == want
    assert ps.state == "SUCCEEDED" and all(e["verified"] for e in ps.epochs)


def test_server_snapshot_never_shows_finished_before_the_last_epoch_is_recorded(monkeypatch):
    """With shards, the last epoch's update awaits the shards' slices before it is evaluated
    and recorded; a snapshot taken meanwhile waits for that (the driver ends the job on the
    first snapshot that says ``finished``, and a missing last epoch failed its check)."""
    import asyncio

    import ray
    from dynabatch.actors.ps import ParameterServer, shard_bounds

    monkeypatch.setattr(ray, "put", lambda value: "ref")
    ds = load_dataset(SPEC.dataset, seed=0)
    total = ParamStore(SPEC, tuple(ds.input_shape), ds.num_classes).total
    bounds = shard_bounds(total, 2)
    shard_size = bounds[1][1] - bounds[1][0]

    class _Remote:  # ``actor.method.remote(...)``, answered by a coroutine
        def __init__(self, fn):
            self.remote = fn

    async def scenario():
        gate = asyncio.Event()

        def _done(value):
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(value)
            return fut

        async def apply(version, weighted):
            await gate.wait()  # the shard is slow to step its slice
            return _done(np.zeros(shard_size, np.float32))

        shard = type("Shard", (), {"apply": _Remote(apply),
                                   "weights_ref": _Remote(lambda: _done(
                                       _done(np.zeros(shard_size, np.float32))))})()
        core = PSCore(PSConfig("async"), dataset_size=96, epochs=1, seed=0,
                      batches=PerfAwareBatches(96))
        core.join("w0")
        server = ParameterServer(SPEC, core, tuple(ds.input_shape), ds.num_classes,
                                 ds.x_test, ds.y_test, shards=[shard], bounds=bounds)
        work = (await server.request("w0"))["work"]
        push = asyncio.create_task(server.push(
            "w0", np.ones(bounds[0][1], np.float32), 0, work.chunk.samples, 0.1))
        await asyncio.sleep(0.05)  # the push is inside the shards' apply now
        assert core.finished and not push.done()
        snap = asyncio.create_task(server.snapshot())
        await asyncio.sleep(0.05)
        assert not snap.done()  # it waits for the update in hand
        gate.set()
        await push
        return await snap

    snap = asyncio.run(scenario())
    assert snap["finished"] and [e["epoch"] for e in snap["epochs"]] == [0]

"""The simulator: the production coordinator and machines on a virtual clock.

* a simulated run and a run driven by a plain replay of the same telemetry make the same
  allocation decisions (the simulator adds no decision logic of its own);
* the cluster model's formulas, end to end through a simulated epoch;
* bad cluster descriptions fail with one line naming the field (library and CLI);
* failures and joins at given times become membership events, and every epoch still
  verifies exactly once from the workers' reports;
* real-gradient mode trains what one process trains on the same global batches;
* the cluster model and the simulator's driver import neither ray nor torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import typer
from dynabatch.actors.contracts import SegmentResult, StepTelemetry, encode_counts
from dynabatch.actors.spec import JobSpec
from dynabatch.api.cli import run as run_cli
from dynabatch.api.cli import simulate as sim_cli
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.membership import NodeInfo
from dynabatch.scheduler.runtime.seam import DataInfo, RegroupResult, ShardResult, Started
from dynabatch.scheduler.sim.cluster_spec import MB, ClusterError, parse_cluster
from dynabatch.scheduler.sim.cost_model import (
    SimulatedCluster,
    compute_time,
    jitter,
    ring_allreduce_s,
)
from dynabatch.scheduler.sim.profiles import profiles_from_report
from dynabatch.scheduler.sim.simulator import simulate
from typer.testing import CliRunner

from bench.runtime_watch import watch_steps

ROOT = Path(__file__).resolve().parents[2]


def _spec(**kw) -> JobSpec:
    base = dict(workers="auto", global_batch=64, epochs=3, policy="affine",
                collective_timeout_s=5, worker_wait_timeout_s=30)
    base.update(kw)
    return JobSpec.model_validate(base)


def _cluster(**kw):
    base = {"classes": [{"name": "fast", "count": 2, "a_ms": 2, "c_ms_per_sample": 0.1,
                         "cpus": 4},
                        {"name": "slow", "count": 2, "a_ms": 6, "c_ms_per_sample": 0.4}],
            "recovery": {"start_s": 0.5}}
    base.update(kw)
    return parse_cluster(base)


# ------------------------------------------------------------------ (a) same decisions
class _RecordingPolicy:
    """Wraps the coordinator's policy; records every decision it returns."""

    def __init__(self, inner, log: list):
        self.inner, self.log, self.name = inner, log, inner.name

    def decide(self, telemetry, global_batch, dataset_size, current=None):
        d = self.inner.decide(telemetry, global_batch, dataset_size, current)
        a = d.allocation
        self.log.append((a.workers, a.batches, a.partitions, d.rebalanced))
        return d


class _ReplayRuntime:
    """Workers that report a fixed sequence of telemetry: each (epoch, step, worker)'s
    compute time comes from a recording; positions, coverage and waits are derived from the
    plans the way a worker derives them. No cluster model, no simulator code."""

    def __init__(self, nodes: list[NodeInfo], n_train: int, computes: dict):
        self._nodes, self.n_train, self.computes = nodes, n_train, computes
        self._starting: list[str] = []

    def load_data(self):
        return DataInfo("replay", self.n_train, 0)

    def nodes(self):
        return list(self._nodes)

    def spawn(self, spawn):
        self._starting.append(spawn.worker_id)

    def poll_started(self, timeout_s):
        out, self._starting = [Started(w) for w in self._starting], []
        return out

    def kill(self, worker):
        pass

    def start_spare(self, node_id):
        pass

    def stop_spare(self, node_id):
        pass

    def lost_spares(self):
        return []

    def submit_segment(self, plans):
        self._queued = dict(plans)
        return self._queued

    def update_segment(self, update, timeout_s):
        """As workers do: the segment sent ahead started its first step when the one
        before it ended; a later step of it takes the update."""
        from dynabatch.scheduler.core.sync.update import updated_plans

        seg = next(iter(self._queued.values()))
        if not seg.updates or update.at_step == seg.steps[0].step:
            return False
        self._queued.update(updated_plans(self._queued, update))
        return True

    def collect_segment(self, plans, grace_s):
        names = list(plans)
        steps = {w: [] for w in names}
        for j in range(len(plans[names[0]].steps)):
            sps = {w: plans[w].steps[j] for w in names}
            size = sps[names[0]].size
            counts = np.zeros(size, dtype=np.int64)
            for sp in sps.values():
                counts[sp.own_start - sp.start:sp.own_start - sp.start + sp.own_size] += 1
            epoch = plans[names[0]].epoch
            comp = {w: self.computes[(epoch, sps[w].step, w)] for w in names}
            slowest = max(comp.values())
            for w, sp in sps.items():
                steps[w].append(StepTelemetry(
                    worker=w, epoch=epoch, step=sp.step, batch=sp.own_size,
                    samples=sp.own_size, compute_s=comp[w], wait_s=slowest - comp[w],
                    loss_sum=0.0, start=sp.own_start, step_start=sp.start, step_size=size,
                    coverage=encode_counts(counts)))
        return [WorkerOutcome(w, result=SegmentResult(worker=w, steps=steps[w]))
                for w in names]

    def regroup(self, generation, members, state, timeout_s):
        return RegroupResult({})

    def submit_evaluation(self, shards):
        return [ShardResult(w, {"n": float(hi - lo)}) for w, (lo, hi) in shards.items()]

    def poll_evaluation(self, ticket, timeout_s):
        out = list(ticket)
        ticket.clear()
        return out

    def finish_evaluation(self, sums):
        return {}

    def fetch_state(self, worker, timeout_s):
        return {}


@pytest.mark.parametrize("policy", ["dbs", "affine"])
def test_simulated_and_replayed_runs_make_the_same_allocation_decisions(policy):
    from dynabatch.scheduler.sync.coordinator import Coordinator

    spec = _spec(policy=policy, epochs=4, rebalance={"mode": "adaptive", "check_steps": 2})
    cluster = _cluster(noise_sigma=0.1, events=[
        {"epoch": 1, "step": 3, "slowdown": {"class": "fast", "index": 0, "factor": 3}}])
    n_train = 64 * 12 + 20  # a partial last step too
    sim_log: list = []
    sim_steps: list = []

    def hook(c) -> None:
        c.epochs.policy = _RecordingPolicy(c.epochs.policy, sim_log)
        watch_steps(c.runtime, sim_steps.append)

    sim = simulate(spec, cluster, dataset_size=n_train, coordinator_hook=hook)
    assert sim.snapshot.state == JobState.SUCCEEDED, sim.snapshot.reason
    # What the simulated workers reported, step by step: the telemetry to replay.
    reports = [rep for step in sim_steps for rep in step]
    computes = {(r.epoch, r.step, r.worker): r.compute_s for r in reports}
    nodes = [NodeInfo(n.node_id, cpus=n.cpus) for n in SimulatedCluster(cluster).nodes]
    replay_log: list = []
    coord = Coordinator("replay", spec, resume=False,
                        runtime=_ReplayRuntime(nodes, n_train, computes))
    coord.epochs.policy = _RecordingPolicy(coord.epochs.policy, replay_log)
    assert coord.run().state == JobState.SUCCEEDED
    assert sum(d[3] for d in sim_log) >= 3  # the plan did change, several times
    assert sim_log == replay_log
    assert [[w.batch for w in r.workers] for r in sim.history] == [
        [w.batch for w in r.workers] for r in coord.history()]


@pytest.mark.parametrize("rebalance", [{"mode": "epoch"},
                                       {"mode": "adaptive", "check_steps": 2}])
def test_equal_workers_stay_equal_under_step_time_noise(rebalance):
    """Two equal nodes whose 1-3 ms steps are mostly a fixed cost, each step 0.5-2x its
    time (lognormal σ 0.4): the default policy (dbs) keeps every plan within ±10% of equal
    shares. It had moved the split on that noise, to 51/13 of 64 on Ray."""
    spec = _spec(policy="dbs", epochs=8, rebalance=rebalance)
    for seed in range(3):
        cluster = parse_cluster({"classes": [{"name": "n", "count": 2, "a_ms": 1.0,
                                              "c_ms_per_sample": 0.03}],
                                 "noise_sigma": 0.4, "seed": seed})
        log: list = []

        def hook(c, log=log) -> None:
            c.epochs.policy = _RecordingPolicy(c.epochs.policy, log)

        sim = simulate(spec, cluster, dataset_size=64 * 30, coordinator_hook=hook)
        assert sim.snapshot.state == JobState.SUCCEEDED, sim.snapshot.reason
        assert len(log) >= 8
        assert all(abs(b - 32) <= 3.2 for d in log for b in d[1]), [d[1] for d in log]


# ------------------------------------------------------------------ (b) formulas
def test_formulas():
    a, c = np.array([0.002, 0.008]), np.array([0.0001, 0.0004])
    assert compute_time(a, c, np.array([100, 0])).tolist() == pytest.approx([0.012, 0.0])
    assert compute_time(a, c, np.array([10, 10]), 2.0, np.array([1.0, 0.5])).tolist() == (
        pytest.approx([0.003 * 2 * 1.0, 0.012 * 2 * 0.5]))
    alpha, beta, m = 1e-5, 1e-9, 4e6
    assert ring_allreduce_s(1, m, alpha, beta) == 0.0
    assert ring_allreduce_s(2, m, alpha, beta) == pytest.approx(2 * alpha + m * beta)
    assert ring_allreduce_s(4, m, alpha, beta) == pytest.approx(6 * alpha + 1.5 * m * beta)
    eps = jitter(np.random.default_rng(0), 0.05, 200_000)
    assert np.median(eps) == pytest.approx(1.0, abs=2e-3)
    assert np.log(eps).std() == pytest.approx(0.05, rel=0.02)
    assert (jitter(np.random.default_rng(0), 0.0, 5) == 1.0).all()
    model = SimulatedCluster(_cluster(parameter_server={"push_ms": 1, "pull_ms": 2,
                                                    "beta_ms_per_mb": 0.5}))
    ps = model.spec.parameter_server  # what the PS simulator asks
    assert ps.push_s(2 * MB) == pytest.approx(0.001 + 0.001)
    assert ps.pull_s(2 * MB) == pytest.approx(0.002 + 0.001)
    ideal = model.ideal(a, c, 1000, 2000)
    t = a + c * ideal.batches
    assert t == pytest.approx(np.full(2, float(ideal.times.max())))  # equal finish
    assert ideal.batches.sum() == pytest.approx(1000)
    assert ideal.sum_v == pytest.approx(1000 / t[0])  # Σ v_i = B / T*
    assert ideal.epoch_s == pytest.approx(2 * (t[0] + model.allreduce_s(2, 1000)))
    # A worker whose single sample outlasts T* stays at 1 and sets the step.
    slow = model.ideal(np.array([0.001, 0.05]), np.array([0.0001, 0.0001]), 100, 100)
    assert slow.batches == pytest.approx([99, 1])
    assert float(slow.times.max()) == pytest.approx(0.0501)
    assert slow.sum_v == pytest.approx(99 / (0.001 + 0.0099) + 1 / 0.0501)


def test_a_simulated_epoch_takes_what_the_formulas_say():
    """σ = 0, static split: each of 4 steps takes max_i(a_i + c_i·b_i) + t_ar(n, m)."""
    cluster = _cluster(allreduce={"alpha_ms": 0.01, "beta_ms_per_mb": 0.2, "model_mb": 2})
    r = simulate(_spec(policy="static", epochs=1), cluster, dataset_size=4 * 64)
    rec = r.history[0]
    assert rec.verified and [w.batch for w in rec.workers] == [16] * 4
    a = np.array([0.002, 0.002, 0.006, 0.006])
    c = np.array([0.0001, 0.0001, 0.0004, 0.0004])
    t = a + c * 16
    t_ar = 2 * 3 * 1e-5 + 2 * 3 / 4 * (2 * MB + 4 * 64) * (0.2e-3 / MB)
    assert rec.wall_s == pytest.approx(4 * (t.max() + t_ar))
    assert [w.compute_s for w in rec.workers] == pytest.approx((4 * t).tolist())
    assert [w.wait_s for w in rec.workers] == pytest.approx((4 * (t.max() + t_ar - t)).tolist())
    assert rec.utilization == pytest.approx(t.sum() / (4 * (t.max() + t_ar)))


def test_profiles_fitted_from_a_report_recover_the_step_time_model():
    a, c = {"w0": 0.002, "w1": 0.010}, {"w0": 0.0001, "w1": 0.0003}
    history = []
    for batches in [(32, 32), (48, 16), (50, 14)]:
        workers = []
        for (w, b) in zip(("w0", "w1"), batches, strict=True):
            slow = 2.0 if w == "w1" else 1.0  # emulated: divided out by the fit
            t = (a[w] + c[w] * b) * slow
            workers.append({"worker": w, "node": f"n-{w}", "batch": b, "partition": 10 * b,
                            "steps": 10, "compute_s": 10 * t, "wait_s": 10 * 0.001,
                            "slowdown": slow})
        history.append({"workers": workers})
    profiles, allreduce = profiles_from_report({"history": history})
    assert [p.worker for p in profiles] == ["w0", "w1"]
    for p in profiles:
        assert (p.a_s, p.c_s) == pytest.approx((a[p.worker], c[p.worker]))
    assert allreduce == pytest.approx(0.001)


def test_profiles_from_a_report_charge_the_step_time_beyond_compute_from_the_epochs_wall():
    # What a step costs beyond its slowest compute (the all-reduce, the optimizer, the
    # coordinator's and the evaluation's share, a compute's wait for a shared core) is in
    # the epoch's wall time, not in any worker's all-reduce wait; the first epoch pays the
    # workers' start-up and is left out.
    history = []
    for e, rest in enumerate([0.5, 0.012, 0.010, 0.011]):
        workers = [{"worker": w, "node": f"n-{w}", "partition": 10 * b, "steps": 10,
                    "compute_s": 10 * (0.001 + 0.0001 * b), "wait_s": 10 * 0.001}
                   for w, b in (("w0", 40 + e), ("w1", 24 - e))]
        slowest = max(w["compute_s"] for w in workers) / 10
        history.append({"epoch": e, "steps": 10, "wall_s": 10 * (slowest + rest),
                        "workers": workers})
    _, allreduce = profiles_from_report({"history": history})
    assert allreduce == pytest.approx(0.011)


def test_profiles_from_a_report_leave_out_an_epoch_whose_slowdown_changed_mid_way():
    # w1 runs 4x slower from epoch 1, step 5: its epoch-1 record (one slowdown, 4) mixes
    # steps at 1x and 4x and would put the node's own speed too low.
    a, c = 0.002, 0.0001
    history = []
    for e, b in enumerate([32, 24, 16]):
        slow = [1.0, 0.5 * 1 + 0.5 * 4, 4.0][e]  # epoch 1: half its steps at each
        workers = [{"worker": "w0", "node": "n0", "partition": 10 * (64 - b), "steps": 10,
                    "compute_s": 10 * (a + c * (64 - b)), "wait_s": 0.01},
                   {"worker": "w1", "node": "n1", "partition": 10 * b, "steps": 10,
                    "compute_s": 10 * (a + c * b) * slow, "wait_s": 0.01,
                    "slowdown": 1.0 if e == 0 else 4.0}]
        history.append({"epoch": e, "workers": workers})
    spec = {"emulation": {"disturbances": [{"worker": 1, "factor": 4.0, "epoch": 1,
                                            "step": 5}]}}
    profiles, _ = profiles_from_report({"spec": spec, "history": history})
    assert [(p.worker, p.points) for p in profiles] == [("w0", 3), ("w1", 2)]
    assert (profiles[1].a_s, profiles[1].c_s) == pytest.approx((a, c))


def test_a_cluster_fitted_from_a_report_hosts_the_jobs_workers(tmp_path):
    # Each fitted node hosted one of the run's workers: it offers what they ask for, so a
    # job of 2-CPU workers (or GPU workers) trains on it as it did on Ray.
    from dynabatch.api.cli.simulate import cluster_for

    history = [{"epoch": e, "steps": 10, "wall_s": 0.1, "workers": [
        {"worker": w, "node": f"n-{w}", "partition": 10 * b, "steps": 10,
         "compute_s": 10 * (0.001 + 0.0001 * b), "wait_s": 0.01}
        for w, b in (("w0", 40 + e), ("w1", 24 - e))]} for e in range(3)]
    report = tmp_path / "run.json"
    report.write_text(json.dumps({"history": history}))
    for extra in ({"worker_cpus": 2}, {"device": "cuda", "worker_gpus": 1}):
        spec = JobSpec.model_validate({"workers": 2, "global_batch": 64, "epochs": 2, **extra})
        cluster = cluster_for(None, report, spec)
        r = simulate(spec, cluster, dataset_size=64 * 4)
        assert r.snapshot.state == JobState.SUCCEEDED, (extra, r.snapshot.reason)
        assert len(r.history) == 2


# ------------------------------------------------------------------ (c) bad input
@pytest.mark.parametrize(("data", "field"), [
    ({"events": [{"at_s": 1, "join": {"class": "gpu"}}]}, "events.0.join.class: unknown node"),
    ({"events": [{"at_s": -1, "fail": 1}]}, "events.0.at_s: Input should be greater"),
    ({"events": [{"at_s": 1, "slowdown": {"class": "slow", "index": 7, "factor": 2}}]},
     "events.0.slowdown.index: class 'slow' has 2 nodes"),
    ({"events": [{"at_s": 1}]}, "events.0: give exactly one of fail, join, slowdown"),
    ({"noise_sigma": -0.1}, "noise_sigma: Input should be greater"),
    ({"classes": [{"name": "x", "count": 1, "a_ms": 1, "c_ms_per_sample": 0.1, "gpu": 1}]},
     "classes.0.gpu: unknown field"),
])
def test_bad_cluster_names_the_field(data, field):
    with pytest.raises(ClusterError) as err:
        _cluster(**data)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_more_workers_than_the_global_batch_names_the_field():
    cluster = parse_cluster({"classes": [{"name": "x", "count": 100, "a_ms": 1,
                                          "c_ms_per_sample": 0.1}]})
    with pytest.raises(ClusterError, match=r"^classes: 100 nodes \(workers: auto\) is more "
                                           r"than global_batch \(64\)"):
        simulate(_spec(), cluster, dataset_size=640)


def _cli(tmp_path: Path, cluster: str, *extra: str, env: dict[str, str] | None = None):
    (tmp_path / "job.yaml").write_text("workers: auto\nglobal_batch: 64\nepochs: 3\n")
    (tmp_path / "cluster.yaml").write_text(cluster)
    app = typer.Typer()
    run_cli.register(app)
    sim_cli.register(app)
    return CliRunner().invoke(app, ["simulate", str(tmp_path / "job.yaml"), "--cluster",
                                    str(tmp_path / "cluster.yaml"), "--quiet", *extra],
                            env={"COLUMNS": "200"} if env is None else env)


def test_cli_tables_redirected_to_a_file_are_not_cut_to_80_columns(tmp_path):
    """Output that is not a terminal (a file, a pipe) is as wide as ``run``'s and ``status``'s
    (``out_console``): before, ``simulate``'s tables were cut to 80 columns (``utili…``)."""
    res = _cli(tmp_path, "classes: [{name: a, count: 2, a_ms: 1, c_ms_per_sample: 0.1}]\n",
               "--dataset-size", "640", env={"COLUMNS": ""})
    assert res.exit_code == 0, res.output
    assert "…" not in res.output, res.output
    assert "utilization" in res.output and "compute/step" in res.output, res.output


def test_cli_bad_cluster_is_one_line_naming_the_field_exit_2(tmp_path):
    res = _cli(tmp_path, "classes: [{name: a, count: 2, a_ms: 1, c_ms_per_sample: 0.1}]\n"
                         "events: [{at_s: 5, join: {class: b}}]\n")
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "events.0.join.class: unknown node class 'b'" in lines[0]
    res = _cli(tmp_path, "classes: [{name: a, count: 2, a_ms: 1, c_ms_per_sample: 0.1}]\n",
               "--compare", "static,fifo")
    assert res.exit_code == 2 and "--compare: unknown policy 'fifo'" in res.output


def test_cli_compare_prints_one_table_and_writes_reports(tmp_path):
    res = _cli(tmp_path, "classes: [{name: a, count: 2, a_ms: 1, c_ms_per_sample: 0.1},"
                         " {name: b, count: 2, a_ms: 4, c_ms_per_sample: 0.4}]\n",
               "--compare", "static,affine", "--dataset-size", "640", "--report",
               str(tmp_path / "r.json"))
    assert res.exit_code == 0, res.output
    assert "static" in res.output and "affine" in res.output and "fraction" in res.output
    report = json.loads((tmp_path / "r-affine.json").read_text())
    assert {"job_id", "spec", "final", "history", "simulation"} <= set(report)
    assert all(r["verified"] for r in report["history"]) and len(report["history"]) == 3


# ------------------------------------------------------------------ (d) failures and joins
def test_failures_and_joins_at_given_times_are_membership_events_and_epochs_verify():
    # Steps of ~20 ms: training starts at 0.6 s (start 0.5 s, regroup 0.1 s), an epoch of
    # 20 steps takes ~0.4 s.
    cluster = parse_cluster({
        "classes": [{"name": "a", "count": 5, "a_ms": 4, "c_ms_per_sample": 1.0}],
        "recovery": {"start_s": 0.5, "detect_s": 0.3, "regroup_s": 0.1},
        "events": [{"at_s": 1.0, "fail": 2}, {"at_s": 1.2, "join": {"class": "a"}},
                   {"epoch": 4, "step": 5, "fail": {"class": "a", "index": 0}}],
    })
    spec = _spec(epochs=6, rebalance={"mode": "adaptive"})
    r = simulate(spec, cluster, dataset_size=64 * 20)
    assert r.snapshot.state == JobState.SUCCEEDED, r.snapshot.reason
    assert all(h.verified and h.samples_trained == 64 * 20 for h in r.history)
    assert sum(h.retried_samples for h in r.history) > 0
    failures = [e for e in r.events if e.kind == "failure"]
    joins = [e for e in r.events if e.kind == "join"]
    assert len(failures) == 3 and len(joins) == 5 + 1
    assert joins[-1].node == "a-00005" and failures[-1].node == "a-00000"
    t0 = r.runtime.clock.start_time
    assert 1.0 <= failures[0].time - t0 < 1.5
    assert [(h.kind, len(h.nodes)) for h in r.happened] == [("fail", 2), ("join", 1),
                                                             ("fail", 1)]
    assert r.recoveries[0].failed_at == 1.0
    assert 0.3 <= r.recoveries[0].seconds < 1.0  # detection, regroup, the retried step
    assert [len(h.workers) for h in r.history][-1] == 3


# ------------------------------------------------------------------ (e) real gradients
@pytest.mark.parametrize(("learners", "batch"), [(8, 64), (64, 256)])
def test_real_gradients_equal_one_process_on_the_same_global_batches(learners, batch):
    import torch
    import torch.nn.functional as F
    from dynabatch.actors.contracts import epoch_order
    from dynabatch.actors.worker import build_optimizer
    from dynabatch.actors.workloads.datasets import load_dataset
    from dynabatch.actors.workloads.models import build_model

    spec = _spec(dataset={"name": "digits", "limit": 2 * batch}, model={"name": "mlp"},
                 optimizer={"name": "sgd", "lr": 0.2, "momentum": 0.9}, global_batch=batch,
                 epochs=1)
    cluster = parse_cluster({"classes": [
        {"name": "f", "count": learners // 2, "a_ms": 1, "c_ms_per_sample": 0.1, "cpus": 3},
        {"name": "s", "count": learners // 2, "a_ms": 1, "c_ms_per_sample": 0.3}]})
    r = simulate(spec, cluster, real_gradients=True)
    assert r.snapshot.state == JobState.SUCCEEDED, r.snapshot.reason
    rec = r.history[0]
    assert rec.steps == 2 and rec.verified and len(rec.workers) == learners
    assert len({w.batch for w in rec.workers}) > 1  # uneven shares (capacity hints)
    assert rec.train_loss > 0 and rec.test_accuracy is not None

    ds = load_dataset(spec.dataset, seed=spec.seed)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, tuple(ds.input_shape), ds.num_classes)
    init = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(spec, list(model.parameters()))
    order = epoch_order(spec.seed, 0, len(ds.y_train))
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    for s in range(2):
        ids = torch.from_numpy(order[s * batch:(s + 1) * batch].astype(np.int64))
        opt.zero_grad()
        F.cross_entropy(model(x[ids]), y[ids]).backward()
        opt.step()
    sim_params = list(r.runtime.gradients.model.parameters())
    for p, q, p0 in zip(model.parameters(), sim_params, init, strict=True):
        assert not torch.equal(p, p0)
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)


def test_real_gradients_use_each_ordinals_micro_batch_cap(monkeypatch):
    # As the Ray worker (actors.accumulate.micro_cap): one cap per ordinal, past the list's
    # end uncapped. Accumulating micro-batches trains the same SGD as one batch per share.
    import torch
    from dynabatch.scheduler.sim.gradients import GradientEngine

    seen: list[list[int | None]] = []
    step = GradientEngine.step

    def spy(self, *args, caps=None, **kw):
        seen.append(list(caps))
        return step(self, *args, caps=caps, **kw)

    base = dict(dataset={"name": "digits", "limit": 128}, model={"name": "mlp"}, workers=4,
                global_batch=64, epochs=1)
    plain = simulate(_spec(**base), _cluster(), real_gradients=True)
    monkeypatch.setattr(GradientEngine, "step", spy)
    capped = simulate(_spec(**base, micro_batch=[3, 5]), _cluster(), real_gradients=True)
    assert capped.snapshot.state == JobState.SUCCEEDED, capped.snapshot.reason
    assert seen and all(c == [3, 5, None, None] for c in seen)
    for p, q in zip(plain.runtime.gradients.model.parameters(),
                    capped.runtime.gradients.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ (f) purity
def test_cluster_model_and_simulator_import_neither_ray_nor_torch():
    mods = ", ".join(f"dynabatch.scheduler.sim.{m}" for m in (
        "cluster_spec", "cost_model", "profiles", "timeline", "world", "runtime", "simulator"))
    code = (f"import {mods}, sys; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch')); "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr

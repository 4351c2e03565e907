"""The simulator's fault script, through the real coordinator on the simulator's runtime.

Each fault kind of :class:`~dynabatch.scheduler.sim.cluster_spec.Fault` is played on a
small simulated cluster (``tests.fakes.sim_job``), one test per kind: here, or where its
subject is tested (``straggle``, ``error``, ``eval_error`` and the last holder lost in
``test_engine_faults.py``, ``oom`` in ``test_oom.py``, spare faults in
``test_spares.py``). The model replicas are the
test's :class:`~tests.fakes.Lineages`: each worker's "weights" are the (epoch, step) updates
it applied. After a run the job succeeded, every epoch's record is ``verified`` by the
ledger, and the surviving model holds every step of every epoch exactly once; or the job
failed with the reason the fault gives. The fault script also comes from a cluster file's
``faults:``, checked like the rest of the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from dynabatch.api.cli import run as run_cli
from dynabatch.api.cli import simulate as sim_cli
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.membership import Spawn
from dynabatch.scheduler.sim.cluster_spec import ClusterError, Fault, parse_cluster
from dynabatch.scheduler.sim.simulator import simulate
from dynabatch.scheduler.sync.coordinator import Coordinator
from typer.testing import CliRunner

from tests.fakes import sim_runtime
from tests.unit.test_engine_faults import (
    SPE,
    B,
    N,
    _assert_exactly_once,
    _full_lineage,
    _job,
    _run_to,
    _spec,
)


def _removed(coord: Coordinator) -> list[tuple[str, str]]:
    return [(e.worker, e.kind) for e in coord.membership_events() if e.kind in ("failure", "evict")]


def _logged(coord: Coordinator, text: str) -> bool:
    return any(text in x.message for x in coord.logs())


# --- at a step --------------------------------------------------------------------------
@pytest.mark.parametrize("step", [0, SPE // 2, SPE - 1], ids=["first", "middle", "last"])
@pytest.mark.parametrize("ordinal", [0, 2])
def test_a_worker_process_dies_at_any_step_and_its_node_hosts_the_replacement(step, ordinal):
    coord, rt, lineages = _job(_spec(), Fault(kind="die", worker=ordinal, epoch=1, step=step))
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert _removed(coord) == [(f"w{ordinal}", "failure")]
    assert coord.snapshot().retried_samples_total > 0
    # The process died, not its node: the replacement started there.
    assert coord.membership.get("w3").node == f"node{ordinal:02d}"
    assert rt.record.fresh == ["w0", "w1", "w2", "w3"] and rt.record.killed[0] == f"w{ordinal}"
    # The dead worker's model stopped where it died.
    assert lineages.lineage(f"w{ordinal}") == _full_lineage(1) + [(1, s) for s in range(step)]


def test_a_fault_injected_during_the_run_fires_at_its_step():
    coord, rt, lineages = _job(_spec())
    _run_to(coord, 1, 4)
    assert rt.record.killed == []
    rt.inject(Fault(kind="die", worker=1, epoch=1, step=6))
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert _removed(coord) == [("w1", "failure")]
    assert lineages.lineage("w1") == _full_lineage(1) + [(1, s) for s in range(6)]


def test_a_hung_worker_is_lost_as_hung_once_its_peers_failed():
    coord, _, lineages = _job(_spec(), Fault(kind="hang", worker=1, epoch=0, step=4))
    coord.run()
    _assert_exactly_once(coord, lineages)
    (ev,) = [e for e in coord.membership_events() if e.kind == "failure"]
    assert ev.worker == "w1" and ev.reason.startswith("hung:")


def test_a_short_straggle_only_takes_its_seconds():
    # w2 is the slowest: its step, and so the job, takes 0.5 s more; nobody times out.
    plain, rt0, _ = _job(_spec(policy="static"))
    plain.run()
    coord, rt, lineages = _job(
        _spec(policy="static"), Fault(kind="straggle", worker=2, epoch=1, step=5, seconds=0.5)
    )
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert _removed(coord) == []
    assert rt.clock.now() - rt0.clock.now() == pytest.approx(0.5, abs=1e-9)
    assert rt.record.plans == rt0.record.plans


def test_a_result_lost_after_its_segment_keeps_what_the_segment_ahead_trained():
    """Every collective of the segment completed, but w1's result was lost with its
    process, which died one step into the segment sent ahead: its peers trained that step
    with it, and it is committed."""
    spec = _spec(rebalance={"mode": "epoch"})
    coord, rt, lineages = _job(spec, Fault(kind="lose_result", worker=1, epoch=1, step=0))
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert _removed(coord) == [("w1", "failure")]
    assert _logged(coord, "committing what the segment ahead trained")
    assert coord.history()[1].retried_samples == B  # only the step the death took down
    # w1 trained one step of the segment ahead before it died.
    first_ahead = next(
        p
        for p in rt.record.plans
        if next(iter(p.values())).epoch == 1 and next(iter(p.values())).steps[0].step > 0
    )
    step = next(iter(first_ahead.values())).steps[0].step
    assert lineages.lineage("w1")[-1] == (1, step)


# --- in a call --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "ordinal", "nth"),
    [
        ("die_in_regroup", 1, 1),  # a newcomer of the first generation
        ("die_in_regroup", 0, 1),  # rank 0, the source of the state
        ("die_in_checkpoint", 0, 2),  # the holder asked for the state, at epoch 2's end
        ("die_in_evaluation", 0, 2),
    ],
)
def test_a_worker_dies_in_a_regroup_a_checkpoint_or_an_evaluation(kind, ordinal, nth, tmp_path):
    coord, rt, lineages = _job(
        _spec(checkpoint={"dir": str(tmp_path)}), Fault(kind=kind, worker=ordinal, nth=nth)
    )
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert _removed(coord) == [(f"w{ordinal}", "failure")]
    assert [f.kind for f in rt.faults.fired] == [kind]
    assert rt.record.regroups >= 2 and rt.record.fetches >= 3 and rt.record.evaluations >= 3
    if kind == "die_in_checkpoint":  # another holder gave the state: the checkpoint exists
        assert _logged(coord, "checkpoint (epoch) at epoch 2")


# --- uneven failures --------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["die", "hang"])
def test_an_uneven_failure_regroups_from_the_survivor_that_got_furthest(kind):
    coord, rt, lineages = _job(_spec(), Fault(kind=kind, worker=0, epoch=0, step=5, uneven=True))
    _run_to_failure(coord)
    # w1's all-reduce of step 5 completed before w0 broke off; w2's did not.
    assert lineages.lineage("w1") == [(0, s) for s in range(6)]
    assert lineages.lineage("w2") == [(0, s) for s in range(5)]
    coord.run()
    _assert_exactly_once(coord, lineages)
    # Training went on from step 6, with w1's weights: step 5 is not trained again.
    firsts = [
        (seg.epoch, seg.steps[0].step)
        for seg in (next(iter(plans.values())) for plans in rt.record.plans)
    ]
    assert firsts[firsts.index((0, 5)) + 1] == (0, 6), firsts


def _run_to_failure(coord: Coordinator) -> None:
    while not coord.membership_events() or all(e.kind == "join" for e in coord.membership_events()):
        assert coord.step(), coord.snapshot().reason


# --- the cluster file -------------------------------------------------------------------
CLASSES = [
    {"name": "fast", "count": 2, "a_ms": 2, "c_ms_per_sample": 0.1},
    {"name": "slow", "count": 2, "a_ms": 6, "c_ms_per_sample": 0.4},
]


def test_a_cluster_files_faults_play_in_simulate():
    cluster = parse_cluster(
        {
            "classes": CLASSES,
            "recovery": {"start_s": 0.5},
            "faults": [{"kind": "die", "worker": 1, "epoch": 1, "step": 2}],
        }
    )
    spec = _spec(workers="auto", min_workers=None, collective_timeout_s=5, worker_wait_timeout_s=30)
    r = simulate(spec, cluster, dataset_size=640)
    assert r.snapshot.state == JobState.SUCCEEDED, r.snapshot.reason
    assert [(e.worker, e.kind) for e in r.events if e.kind == "failure"] == [("w1", "failure")]
    assert [x.lost for x in r.recoveries] == [("w1",)]
    assert all(x.verified for x in r.history)
    assert r.runtime.record.killed[0] == "w1"


def _cli(tmp_path: Path, cluster: str):
    (tmp_path / "job.yaml").write_text("workers: auto\nglobal_batch: 64\nepochs: 3\n")
    (tmp_path / "cluster.yaml").write_text(cluster)
    app = typer.Typer()
    run_cli.register(app)
    sim_cli.register(app)
    return CliRunner().invoke(
        app,
        [
            "simulate",
            str(tmp_path / "job.yaml"),
            "--cluster",
            str(tmp_path / "cluster.yaml"),
            "--quiet",
            "--dataset-size",
            "640",
            "--report",
            str(tmp_path / "report.json"),
        ],
        env={"COLUMNS": "200"},
    )


def test_cli_simulates_a_cluster_files_fault_script(tmp_path):
    res = _cli(
        tmp_path,
        "classes: [{name: a, count: 3, a_ms: 1, c_ms_per_sample: 0.1}]\n"
        "faults:\n  - {kind: hang, worker: 2, epoch: 1, step: 3}\n",
    )
    assert res.exit_code == 0, res.output
    assert "failure at t=" in res.output and "(w2)" in res.output
    sim = json.loads((tmp_path / "report.json").read_text())["simulation"]
    assert sim["faults_fired"] == [{"kind": "hang", "worker": 2, "epoch": 1, "step": 3}]
    assert [f["kind"] for f in sim["cluster"]["faults"]] == ["hang"]
    calls = sim["calls"]
    assert calls["regroups"] == 2 and calls["evaluations"] == 0, calls  # nothing held out
    assert calls["segments"] == calls["submitted"] > 0


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ({"kind": "die", "worker": 1}, "faults.0.epoch: required for kind die"),
        ({"kind": "explode", "worker": 1}, "faults.0.kind: Input should be"),
        (
            {"kind": "die", "worker": 1, "epoch": 0, "seconds": 3},
            "faults.0.seconds: does not apply to kind die",
        ),
        (
            {"kind": "straggle", "worker": 1, "epoch": 0},
            "faults.0.seconds: required for kind straggle",
        ),
        (
            {"kind": "oom", "worker": 1, "epoch": 0, "batch": -1},
            "faults.0.batch: Input should be greater than or equal to 0",
        ),
        (
            {"kind": "error", "worker": 1, "epoch": 0, "uneven": True},
            "faults.0.uneven: does not apply to kind error",
        ),
        ({"kind": "spare_dies", "worker": 1}, "faults.0.node: required for kind spare_dies"),
        ({"kind": "spare_dies", "node": {"class": "fast"}}, "faults.0.node: give {class, index}"),
        (
            {"kind": "spare_dies", "node": {"class": "big", "index": 0}},
            "faults.0.node.class: unknown node class 'big' (classes: fast, slow)",
        ),
        (
            {"kind": "spare_dies_silently", "node": {"class": "slow", "index": 2}},
            "faults.0.node.index: class 'slow' has 2 nodes (indices 0..1)",
        ),
    ],
)
def test_a_bad_fault_is_one_line_naming_its_field(fault, message):
    with pytest.raises(ClusterError) as err:
        parse_cluster({"classes": CLASSES, "faults": [fault]})
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_cli_bad_fault_is_one_line_naming_the_field_exit_2(tmp_path):
    res = _cli(
        tmp_path,
        "classes: [{name: a, count: 2, a_ms: 1, c_ms_per_sample: 0.1}]\n"
        "faults: [{kind: die, worker: 0, epoch: 0, nth: 2}]\n",
    )
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "faults.0.nth: does not apply to kind die" in lines[0]


def test_inject_checks_the_node_it_names():
    _, rt, _ = _job(_spec())
    with pytest.raises(ValueError, match=r"^node.index: class 'node02' has 1 nodes"):
        rt.inject(Fault(kind="spare_dies", node={"class": "node02", "index": 1}))


# --- micro-batches --------------------------------------------------------------------------
def test_a_share_cut_into_micro_batches_pays_the_per_step_cost_for_each():
    """Under a micro-batch cap (the plan's, after an out-of-memory error) a share of b
    samples is computed in k micro-batches: k·a + c·b, reported as on Ray."""
    from dataclasses import replace

    from dynabatch.actors.contracts import SegmentPlan, StepPlan

    spec = _spec(workers=2)
    rt = sim_runtime(spec, n_train=N, nodes=2, overhead_s=0.01, speeds={0: 100, 1: 100})
    for i in range(2):
        rt.spawn(Spawn(f"w{i}", i, f"node0{i}", 1.0, 0.0))
    rt.poll_started(1.0)
    assert rt.regroup(1, ["w0", "w1"], None, 5.0).ok
    plans = {
        w: SegmentPlan(0, 0, N, (StepPlan(0, 0, 64, 32 * i, 32),))
        for i, w in enumerate(("w0", "w1"))
    }
    plans["w1"] = replace(plans["w1"], micro_cap=10)  # 32 samples in 4 micro-batches
    out = {o.worker: o.result.steps[0] for o in rt.collect_segment(rt.submit_segment(plans), 1)}
    assert out["w0"].compute_s == pytest.approx(0.01 + 0.32)
    assert out["w1"].compute_s == pytest.approx(4 * 0.01 + 0.32)
    assert (out["w0"].micro_batches, out["w0"].micro_cap) == (1, None)
    assert (out["w1"].micro_batches, out["w1"].micro_cap) == (4, 10)


def test_the_parameter_server_simulator_refuses_a_fault_script():
    from dynabatch.scheduler.sim.ps_job import check_cluster

    cluster = parse_cluster(
        {"classes": CLASSES, "faults": [{"kind": "die", "worker": 0, "epoch": 0}]}
    )
    with pytest.raises(ClusterError, match=r"^faults: the parameter-server simulator plays no"):
        check_cluster(cluster)

"""Issue 31: fractional GPUs shared in the cluster policy (scheduler/core/cluster/).

A worker of ``worker_gpus`` w below 1 takes 1/k of a GPU, k the workers of w Ray places on
one GPU (``nodes.gpu_units``), so jobs of fractional GPUs share a GPU node by the sum of
their shares; a whole-GPU worker, ``auto``, and a CPU-only worker there take a GPU each.
The hypothesis properties with fractional shares mixed in are in test_cluster_sizes.py and
test_cluster_rounds.py.
"""

from __future__ import annotations

import pytest
from dynabatch.actors.spec import parse_spec
from dynabatch.api.cli.cluster_commands import cluster_tables
from dynabatch.scheduler.core.cluster.decision import decide
from dynabatch.scheduler.core.cluster.ray_nodes import (
    RayNode,
    cluster_nodes,
    gpu_units,
    worker_slots,
)
from dynabatch.scheduler.core.cluster.rounds import (
    Entry,
    JobGone,
    NodesSeen,
    RoundState,
    Tick,
    step,
)
from dynabatch.scheduler.core.cluster.throughput import ThroughputModel
from dynabatch.scheduler.core.cluster.values import GPU_UNITS, POLICIES, ClusterJob, ClusterKnobs
from dynabatch.service.cluster_client import NodeStatus
from dynabatch.service.cluster_schemas import ClusterState
from dynabatch.service.job_service import min_workers_problem
from rich.console import Console

GPU1 = "gpu-gpux1"  # the type Ray nodes of one GPU get


def _gpu_nodes(count: int, gpus: float = 1.0):
    return cluster_nodes([RayNode(f"g{i}", {"CPU": 8.0, "GPU": gpus}) for i in range(count)])


def _model(rate: float = 1.0) -> ThroughputModel:
    return ThroughputModel.of({GPU1: rate}, {GPU1: rate}, 0.05, 64.0)


def _job(job_id: str, lo: int, hi: int, worker_gpus, submit_s: float = 0.0) -> ClusterJob:
    return ClusterJob(job_id, lo, hi, _model(), submit_s=submit_s, gpu_units=gpu_units(worker_gpus))


def test_a_share_is_one_kth_of_a_gpu_as_ray_packs_it():
    # Whole GPUs: 1, auto, and a CPU-only worker on a GPU node (the rule before sharing).
    assert gpu_units(1.0) == gpu_units("auto") == gpu_units(0.0) == GPU_UNITS
    assert GPU_UNITS // gpu_units(0.5) == 2 and GPU_UNITS // gpu_units(0.25) == 4
    # 1/3 (and Ray's 0.3333): three per GPU, not two as a share rounded up to 0.34 would.
    assert GPU_UNITS // gpu_units(1 / 3) == 3 and GPU_UNITS // gpu_units(0.3333) == 3
    # 0.4: Ray puts 2 on a GPU (none spans two), so it takes half of one.
    assert gpu_units(0.4) == gpu_units(0.5)
    assert GPU_UNITS // gpu_units(0.1) == 10


@pytest.mark.parametrize("policy", POLICIES)
def test_two_half_gpu_jobs_share_one_gpu_and_a_third_waits_whole(policy):
    nodes = _gpu_nodes(1)
    a, b = _job("a", 1, 1, 0.5), _job("b", 1, 1, 0.5, submit_s=1.0)
    d = decide(nodes, [a, b], 0.0, ClusterKnobs(policy=policy))
    assert d.plan("a").slots == d.plan("b").slots == (("g0", 1),)
    assert d.queue == ()
    c = _job("c", 1, 1, 0.5, submit_s=2.0)
    d = decide(nodes, [a, b, c], 0.0, ClusterKnobs(policy=policy))
    assert d.queue == ("c",) and d.plan("c").slots == ()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_quarter_gpu_job_gets_four_workers_on_each_gpu(policy):
    nodes = _gpu_nodes(2)
    d = decide(nodes, [_job("q", 1, 8, 0.25)], 0.0, ClusterKnobs(policy=policy))
    assert d.plan("q").slots == (("g0", 4), ("g1", 4))
    # A node of 2 GPUs holds 8 of them.
    two = cluster_nodes([RayNode("g", {"CPU": 8.0, "GPU": 2.0})])
    job = ClusterJob(
        "q", 8, 8, ThroughputModel.of({two[0].node_type: 1.0}), gpu_units=gpu_units(0.25)
    )
    assert decide(two, [job], 0.0, ClusterKnobs(policy=policy)).plan("q").workers == 8


@pytest.mark.parametrize("policy", ["fifo", "fair", "goodput"])
def test_shares_of_different_sizes_fill_a_gpu_by_their_sum(policy):
    """A half, then quarters: the GPU holds the half and two quarters; a whole-GPU job and
    a CPU-only one (a GPU each, as before sharing) wait for a free GPU."""
    nodes = _gpu_nodes(1)
    half, quarters = _job("a", 1, 1, 0.5), _job("b", 2, 4, 0.25, submit_s=1.0)
    d = decide(nodes, [half, quarters], 0.0, ClusterKnobs(policy=policy))
    assert d.plan("a").slots == (("g0", 1),) and d.plan("b").slots == (("g0", 2),)
    for w in (1.0, 0.0):
        d = decide(nodes, [half, _job("w", 1, 1, w, submit_s=1.0)], 0.0, ClusterKnobs(policy))
        assert d.queue == ("w",), d
    alone = decide(nodes, [_job("w", 1, 1, 0.0)], 0.0, ClusterKnobs(policy=policy))
    assert alone.plan("w").slots == (("g0", 1),)


def test_rounds_start_both_halves_and_the_view_shows_gpus():
    knobs = ClusterKnobs(policy="goodput", hold_s=0.0)
    s = RoundState()
    for e in (
        NodesSeen(_gpu_nodes(1)),
        Entry("a", 1, 1, 0, 0.0, gpu_units=gpu_units(0.5)),
        Entry("b", 1, 2, 0, 1.0, gpu_units=gpu_units(0.25)),
    ):
        s, _ = step(s, e, knobs)
    s, cmds = step(s, Tick(1.0), knobs)
    assert {c.job_id: c.slots for c in cmds} == {"a": (("g0", 1),), "b": (("g0", 2),)}
    (node,) = s.view.nodes
    assert (node.capacity, node.used) == (1.0, 1.0)  # GPUs, not slots of a share
    assert s.view.utilization == 1.0
    # REST and the CLI read GPUs too: half of the GPU held once "a" is gone.
    s, _ = step(s, JobGone("a"), knobs)
    s, _ = step(s, Tick(2.0), knobs)
    state = ClusterState.of(s.view)
    assert (state.nodes[0].capacity, state.nodes[0].used) == (1.0, 0.5)
    console = Console(width=120, record=True)
    console.print(cluster_tables(state))
    assert "0.5/1" in console.export_text()


def test_the_cli_names_a_ray_node_by_its_first_8_hex_digits_as_every_view_does():
    """``dynabatch cluster``'s nodes table showed a Ray node's whole 56-digit id, while its
    jobs table, ``status`` and the job page show the first 8 (``node_label``)."""
    ray_id = "f1144df1" + "ab" * 24
    knobs = ClusterKnobs(policy="goodput", hold_s=0.0)
    s = RoundState()
    nodes = cluster_nodes([RayNode(ray_id, {"CPU": 2.0})])
    for e in (NodesSeen(nodes), Entry("a", 1, 1, worker_slots=worker_slots(1.0))):
        s, _ = step(s, e, knobs)
    s, _ = step(s, Tick(1.0), knobs)
    console = Console(width=200, record=True)
    console.print(cluster_tables(ClusterState.of(s.view)))
    text = console.export_text()
    assert ray_id not in text, text
    assert "│ f1144df1 " in text and "1 (f1144df1: 1)" in text, text


def test_submit_admits_a_gang_that_fits_on_shared_gpus_and_names_the_field_otherwise():
    nodes = [NodeStatus(node_id="g0", address="10.0.0.1", resources={"CPU": 8.0, "GPU": 1.0})]

    def spec(lo: int):
        return parse_spec(
            {"workers": lo, "min_workers": lo, "global_batch": 64, "worker_gpus": 0.25}
        )

    assert min_workers_problem(spec(4), nodes) is None
    assert min_workers_problem(spec(5), nodes) == (
        "min_workers 5: the cluster's worker slots hold 4 workers of worker_gpus 0.25; "
        "the job could never start"
    )

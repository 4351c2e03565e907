"""A Ray node's type and worker slots for the cluster scheduler
(scheduler/core/cluster/ray_nodes.py), and the jobs it refuses with a reason."""

from __future__ import annotations

from dynabatch.scheduler.core.cluster.ray_nodes import (
    RayNode,
    cluster_nodes,
    eligible_types,
    gang_error,
    node_type,
    slot_error,
    slots,
    worker_slots,
)
from dynabatch.scheduler.core.cluster.values import GPU_UNITS


def test_type_from_label_then_resource_then_resources():
    assert (
        node_type(RayNode("a", {"CPU": 8, "node-type:fast": 1}, {"dynabatch.io/node-type": "h100"}))
        == "h100"
    )
    assert node_type(RayNode("a", {"CPU": 8, "node-type:fast": 1})) == "fast"
    assert node_type(RayNode("a", {"CPU": 8, "GPU": 2, "accelerator_type:A100": 1})) == "gpu-A100x2"
    assert node_type(RayNode("a", {"CPU": 8, "GPU": 1})) == "gpu-gpux1"
    assert node_type(RayNode("a", {"CPU": 4})) == "cpu4"
    assert node_type(RayNode("a", {"CPU": 4}, {"dynabatch.io/node-type": " "})) == "cpu4"


def test_slots_per_gpu_else_per_cpu_and_empty_nodes_left_out():
    assert slots(RayNode("a", {"CPU": 16, "GPU": 2})) == 2 * GPU_UNITS  # shares of a GPU
    # CPUs in Ray's fixed point (1/10000), fractions included.
    assert slots(RayNode("a", {"CPU": 3.5})) == 35000
    assert slots(RayNode("a", {"CPU": 16, "GPU": 0.5})) == 160000
    nodes = cluster_nodes(
        [
            RayNode("b", {"CPU": 2}),
            RayNode("head", {"CPU": 0}),
            RayNode("c", {"CPU": 2}, alive=False),
        ]
    )
    assert [(n.node_id, n.node_type, n.capacity) for n in nodes] == [("b", "cpu2", 20000)]
    assert nodes[0].shown(nodes[0].capacity) == 2.0  # people read CPUs


def test_workers_of_several_gpus_are_refused_with_the_field():
    assert slot_error(0.0) is None and slot_error("auto") is None and slot_error(0.5) is None
    assert slot_error(2.0).startswith("worker_gpus 2:")


def test_a_worker_takes_its_cpus_in_slots_on_cpu_nodes_and_one_on_gpu_nodes():
    assert [worker_slots(c) for c in (0.25, 1.0, 1.5, 2.0)] == [2500, 10000, 15000, 20000]
    nodes = [RayNode("c", {"CPU": 5}), RayNode("g", {"CPU": 8, "GPU": 2})]
    assert [(n.capacity, n.gpu) for n in cluster_nodes(nodes)] == [
        (50000, False),
        (2 * GPU_UNITS, True),
    ]
    # Workers of 2 CPUs: 2 whole on the 5-CPU node, one per GPU on the other.
    assert gang_error(nodes, 4, worker_cpus=2.0) is None
    assert gang_error(nodes, 5, worker_cpus=2.0) == (
        "min_workers 5: the cluster's worker slots hold 4 workers of 2 CPUs (worker_cpus 2); "
        "the job could never start"
    )


def test_node_resource_limits_to_types_wholly_carrying_it():
    nodes = [
        RayNode("a", {"CPU": 1, "node-type:x": 1, "tag": 1}),
        RayNode("b", {"CPU": 1, "node-type:x": 1, "tag": 1}),
        RayNode("c", {"CPU": 1, "node-type:y": 1, "tag": 1}),
        RayNode("d", {"CPU": 1, "node-type:y": 1}),
    ]
    assert eligible_types(nodes, "tag") == frozenset({"x"})
    assert eligible_types(nodes, None) is None


def test_a_gang_no_node_set_can_hold_is_refused():
    nodes = [RayNode("a", {"CPU": 1, "tag": 1}), RayNode("b", {"CPU": 2})]
    assert gang_error(nodes, 3) is None
    assert gang_error(nodes, 4).startswith("min_workers 4: the cluster has 3 worker slots")
    # "tag" is on one of the two cpu1/cpu2 types' nodes: a, type cpu1, all tagged.
    assert gang_error(nodes, 2, "tag") is not None
    assert gang_error(nodes, 1, "tag") is None


def test_nodes_with_a_custom_resource_are_a_type_of_their_own():
    """The head node has as many CPUs as the tagged nodes: a job limited to the tag may
    still use all three (their derived type is not the head's)."""
    nodes = [
        RayNode("head", {"CPU": 1, "node:__internal_head__": 1, "memory": 1e9}),
        *(RayNode(f"t{i}", {"CPU": 1, "tag": 1, "node:10.0.0.1": 1}) for i in range(3)),
    ]
    assert [node_type(n) for n in nodes] == ["cpu1", "cpu1+tag", "cpu1+tag", "cpu1+tag"]
    assert eligible_types(nodes, "tag") == frozenset({"cpu1+tag"})
    assert gang_error(nodes, 3, "tag") is None


def test_fractional_cpus_pack_as_ray_packs_them():
    """Issue 50 (6): the demo's 3 workers of 0.5 CPU fit a 2-CPU node, as Ray places them
    (once counted as a whole slot each: refused, "the cluster has 2 worker slots")."""
    two = [RayNode("n", {"CPU": 2.0})]
    assert gang_error(two, 3, worker_cpus=0.5) is None
    assert gang_error(two, 4, worker_cpus=0.5) is None
    assert gang_error(two, 5, worker_cpus=0.5) == (
        "min_workers 5: the cluster's worker slots hold 4 workers of 0.5 CPUs (worker_cpus "
        "0.5); the job could never start"
    )
    # 0.6 CPU: 3 on 2 CPUs (1.8), as Ray's sum per node allows.
    assert gang_error(two, 3, worker_cpus=0.6) is None
    assert gang_error(two, 4, worker_cpus=0.6) is not None
    # The rounds start the gang of 3 on the one node.
    from dynabatch.scheduler.core.cluster.rounds import (
        Entry,
        NodesSeen,
        RoundState,
        Start,
        Tick,
        step,
    )
    from dynabatch.scheduler.core.cluster.values import ClusterKnobs

    knobs = ClusterKnobs(policy="fifo", hold_s=0.0)
    s, _ = step(RoundState(), NodesSeen(cluster_nodes(two)), knobs)
    s, _ = step(s, Entry("demo", 3, 3, worker_slots=worker_slots(0.5)), knobs)
    s, cmds = step(s, Tick(1.0), knobs)
    assert cmds == (Start("demo", (("n", 3),)),)
    assert s.view.nodes[0].used == 1.5 and s.view.nodes[0].capacity == 2.0


def test_serve_admits_the_demos_spec_on_a_two_cpu_node():
    """Issue 50 (6): examples/digits-hetero.yaml (3 workers of 0.5 CPU) was answered 422,
    "the cluster has 2 worker slots", on the 2-CPU machine Ray trains it on."""
    from pathlib import Path

    import yaml
    from dynabatch.actors.spec import parse_spec
    from dynabatch.service.cluster_client import NodeStatus
    from dynabatch.service.job_service import min_workers_problem

    root = Path(__file__).resolve().parents[2]
    raw = yaml.safe_load((root / "examples" / "digits-hetero.yaml").read_text())
    spec = parse_spec({**raw, "min_workers": raw["workers"]})
    node = NodeStatus(node_id="n", address="10.0.0.1", resources={"CPU": 2.0})
    assert spec.worker_cpus == 0.5 and spec.min_workers == 3
    assert min_workers_problem(spec, [node]) is None

"""Devices from Ray (issue 30, item 2): which GPU a worker drives, which nodes can host a
worker, what ``worker_gpus`` may ask for, and which backend a group of GPU workers uses
when some share one GPU. Pure decisions: no Ray, no GPU."""

from __future__ import annotations

import pytest
import torch
from dynabatch.actors.group import choose_backend, gpu_key
from dynabatch.actors.spec import JobSpec, SpecError, parse_spec
from dynabatch.actors.worker import cuda_index, pick_device


def _spec(**kw) -> JobSpec:
    base = dict(
        dataset={"name": "synthetic"},
        model={"name": "mlp", "hidden": 8},
        workers=1,
        global_batch=16,
    )
    base.update(kw)
    return JobSpec.model_validate(base)


@pytest.mark.parametrize(
    ("gpu_ids", "visible", "index"),
    [
        (["3"], "3", 0),  # Ray's usual case: the actor sees only its GPU
        ([2], "0,2", 1),  # an id among several visible devices: its position
        (["1"], " 0, 1 ,2", 1),
        (["2"], None, 2),  # nothing hidden: the id is the index
        (["2"], "", 2),
        ([], "5", 0),  # outside Ray: the first visible GPU
        ([], None, 0),
    ],
)
def test_the_torch_index_is_the_ray_gpu_among_the_visible_devices(gpu_ids, visible, index):
    assert cuda_index(gpu_ids, visible) == index


def test_a_ray_gpu_that_is_not_visible_is_an_error():
    with pytest.raises(RuntimeError, match="GPU 4, which CUDA_VISIBLE_DEVICES"):
        cuda_index(["4"], "0,1")


def test_a_worker_drives_the_gpu_ray_gave_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    spec = _spec(device="cuda", worker_gpus=1)
    assert pick_device(spec, 1.0, ["2"]) == torch.device("cuda", 2)
    assert pick_device(_spec(worker_gpus=0.5), 0.5, [3]) == torch.device("cuda", 3)
    assert pick_device(_spec(worker_gpus="auto"), 0.0, ["2"]).type == "cpu"


@pytest.mark.parametrize("gpus", [2, 1.5])
def test_more_than_one_gpu_per_worker_is_refused_with_the_reason(gpus):
    with pytest.raises(
        SpecError,
        match=r"worker_gpus: .*a worker drives one device; for more "
        r"GPUs use more workers",
    ):
        parse_spec({"worker_gpus": gpus})


def test_one_gpu_or_a_fraction_per_worker_is_valid():
    assert parse_spec({"worker_gpus": 1}).worker_gpus == 1
    assert parse_spec({"worker_gpus": 0.5}).worker_gpus == 0.5


def test_workers_sharing_a_gpu_use_gloo_and_workers_with_their_own_use_nccl():
    cuda = ["cuda:0", "cuda:0"]
    # Two workers on one GPU of one node (worker_gpus: 0.5): NCCL refuses two ranks there.
    assert choose_backend(cuda, [gpu_key("n1", ["0"]), gpu_key("n1", ["0"])]) == "gloo"
    # The same index on two nodes, or two GPUs of one node: each its own device.
    assert choose_backend(cuda, [gpu_key("n1", ["0"]), gpu_key("n2", ["0"])]) == "nccl"
    assert choose_backend(cuda, [gpu_key("n1", ["0"]), gpu_key("n1", ["1"])]) == "nccl"
    assert choose_backend(["cuda:0", "cpu"], [gpu_key("n1", ["0"]), None]) == "gloo"
    assert gpu_key("n1", []) is None


# --- which nodes can host a worker -------------------------------------------------------

CPU_NODE = {"CPU": 4.0}
GPU_NODE = {"CPU": 4.0, "GPU": 1.0}


def _hosts(spec: JobSpec, res: dict[str, float]) -> bool:
    """Whether a node offering ``res`` is eligible for the job's workers (``eligible_nodes``'s
    rule)."""
    return spec.workers_on(res) > 0


def test_device_cuda_places_workers_only_on_gpu_nodes():
    spec = _spec(device="cuda", worker_gpus="auto")
    assert not _hosts(spec, CPU_NODE)  # its worker would find no GPU, and restart for ever
    assert _hosts(spec, GPU_NODE)
    assert spec.gpus_on(GPU_NODE["GPU"]) == 1.0


def test_eligibility_by_what_the_worker_asks_for():
    assert _hosts(_spec(worker_gpus="auto"), CPU_NODE)  # device auto: a CPU worker there
    assert _hosts(_spec(worker_gpus="auto"), GPU_NODE)
    assert not _hosts(_spec(worker_gpus=0.5), CPU_NODE)
    assert _hosts(_spec(worker_gpus=0.5), GPU_NODE)
    assert _hosts(_spec(), CPU_NODE) and _hosts(_spec(), GPU_NODE)
    assert not _hosts(_spec(worker_cpus=8), GPU_NODE)
    assert not _hosts(_spec(node_resource="big"), GPU_NODE)
    assert _hosts(_spec(node_resource="big"), {**GPU_NODE, "big": 1.0})


def test_eligible_nodes_leave_out_cpu_nodes_for_a_cuda_job(monkeypatch):
    from dynabatch.scheduler.runtime import pool

    nodes = [
        {"Alive": True, "NodeID": "gpu", "Resources": GPU_NODE},
        {"Alive": True, "NodeID": "cpu", "Resources": CPU_NODE},
    ]
    monkeypatch.setattr(pool.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(pool, "_available", lambda: None)
    spec = _spec(device="cuda", worker_gpus="auto")
    assert [n.node_id for n in pool.eligible_nodes(spec)] == ["gpu"]


def test_a_gpu_nodes_spare_holds_the_gpu_its_worker_will_drive(monkeypatch):
    """Issue 30 item 7: GPU nodes never got spares (a spare reserved no GPU, and a GPU is
    visible only to the process Ray reserved it for). A spare there holds the GPU, not the
    CPUs; a CPU job's spare holds neither."""
    from dynabatch.scheduler.runtime import pool

    launched = []
    monkeypatch.setattr(
        pool,
        "spawn_worker",
        lambda spec, wid, ordinal, node, gpus, data, cpus: launched.append((node, wid, cpus, gpus)),
    )
    pool.start_spare(_spec(worker_gpus="auto"), "gpu", {}, node_gpus=GPU_NODE["GPU"])
    pool.start_spare(_spec(worker_gpus="auto"), "cpu", {}, node_gpus=0.0)
    pool.start_spare(_spec(), "gpu", {}, node_gpus=GPU_NODE["GPU"])
    assert launched == [("gpu", None, 0, 1.0), ("cpu", None, 0, 0.0), ("gpu", None, 0, 0.0)]


def test_the_gpu_a_spare_holds_counts_as_free_for_the_job(monkeypatch):
    from dynabatch.scheduler.runtime import pool

    nodes = [{"Alive": True, "NodeID": "gpu", "Resources": GPU_NODE}]
    monkeypatch.setattr(pool.ray, "nodes", lambda: nodes)
    # The spare holds the node's only GPU: Ray lists none available.
    monkeypatch.setattr(pool, "_available", lambda: {"gpu": {"CPU": GPU_NODE["CPU"]}})
    spec = _spec(device="cuda", worker_gpus="auto")
    (taken,) = pool.eligible_nodes(spec)
    assert not taken.free  # another job's, or nobody's listing
    (own,) = pool.eligible_nodes(spec, spare_gpus={"gpu": 1.0})
    assert own.free and own.room == 1  # this job's worker adopts the spare there

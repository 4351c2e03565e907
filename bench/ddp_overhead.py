"""dynabatch against plain PyTorch DDP on equal nodes: the same model, data and global batch.

Side by side in one run, alternating (DDP, dynabatch, DDP, dynabatch, ...):

* **DDP**: ``torch.nn.parallel.DistributedDataParallel`` over gloo, 2 processes x 1 torch
  thread, each step's global batch split in halves, SGD with momentum, no evaluation.
* **dynabatch**: a ``Coordinator`` with ``policy: static`` over 2 Ray worker actors on a
  ``ray.cluster_utils`` cluster of 2 one-CPU nodes; everything a job does is timed (the
  coordinator's planning and ledger, the per-epoch evaluation).

Both train the same sample order (:func:`actors.contracts.epoch_order`) from the same
initial weights. An epoch's time is wall clock from one epoch's end to the next (the first
epoch, with start-up, is left out): for dynabatch that includes its evaluation and every
coordinator round trip. ``ratio = ddp_epoch_s / dynabatch_epoch_s`` (> 1: dynabatch is
faster); the target is kept in the output whatever was measured.

Prints one JSON object. Usage: python bench/ddp_overhead.py [--models lenet,resnet]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import itertools

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from actors.contracts import epoch_order
from actors.spec import JobSpec
from actors.workloads.datasets import load_dataset
from actors.workloads.models import build_model

TARGET_RATIO = 0.95
WORKLOADS = {
    # LeNet on 28x28 MNIST-format, B = 256 (the measurement).
    "lenet": {"model": {"name": "lenet"}, "n_train": 12000, "n_test": 2000, "batch": 256},
    # The small ResNet (16-32-64, one block per stage) on the same images, fewer samples.
    "resnet": {"model": {"name": "resnet"}, "n_train": 2048, "n_test": 512, "batch": 128},
}


def make_spec(name: str, args: argparse.Namespace, **extra: Any) -> JobSpec:
    w = WORKLOADS[name]
    body = {
        "name": f"ddp-{name}", "model": w["model"],
        "dataset": {"name": "mnist", "options": {"n_train": w["n_train"], "n_test": w["n_test"]}},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "workers": 2, "global_batch": w["batch"], "epochs": args.epochs, "policy": "static",
        "seed": args.seed, "node_resource": "bench_node", "collective_timeout_s": 120,
    }
    body.update(extra)
    return JobSpec.model_validate(body)


# --------------------------------------------------------------------------------------------
# Plain DDP


def _ddp_proc(rank: int, spec_json: str, port: int, out_q: Any) -> None:
    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(spec_json)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ds = load_dataset(spec.dataset, seed=spec.seed)
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, tuple(ds.input_shape), ds.num_classes)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    o = spec.optimizer
    opt = torch.optim.SGD(ddp.parameters(), lr=o.lr, momentum=o.momentum)
    B, n = spec.global_batch, len(y)
    ends = []
    dist.barrier()
    ends.append(time.perf_counter())
    for epoch in range(spec.epochs):
        order = epoch_order(spec.seed, epoch, n)
        for s in range(-(-n // B)):
            pos = order[s * B:min(n, s * B + B)]
            half = -(-len(pos) // 2)
            ids = torch.from_numpy(pos[:half] if rank == 0 else pos[half:])
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(ddp(x.index_select(0, ids)), y.index_select(0, ids)).backward()
            opt.step()
        ends.append(time.perf_counter())
    if rank == 0:
        out_q.put([b - a for a, b in itertools.pairwise(ends)])
    dist.destroy_process_group()


def run_ddp(spec: JobSpec, port: int) -> list[float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ddp_proc, args=(r, spec.model_dump_json(), port, q))
             for r in range(2)]
    for p in procs:
        p.start()
    epochs = q.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    return epochs


# --------------------------------------------------------------------------------------------
# dynabatch


def run_dynabatch(spec: JobSpec) -> dict[str, Any]:
    from scheduler.coordinator import Coordinator

    coord = Coordinator(f"ddp-{spec.name}", spec, resume=False)
    ends: list[float] = []
    seen = 0
    while coord.step():
        if len(coord.history()) > seen:
            seen = len(coord.history())
            ends.append(time.perf_counter())
    hist = coord.history()
    if coord.snapshot().state.value != "SUCCEEDED":
        raise RuntimeError(f"dynabatch: {coord.snapshot().reason}")
    breakdown = [r.breakdown.model_dump() for r in hist[1:] if r.breakdown is not None]
    return {
        "epochs": [b - a for a, b in itertools.pairwise(ends)],
        "train_wall_s": [r.wall_s for r in hist[1:]],
        "breakdown": breakdown,
    }


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ddp_runs, dyn_runs, dyn_train, breakdowns = [], [], [], []
    flat_runs: list[float] = []
    flat_breakdowns: list[dict[str, float]] = []
    for r in range(args.rounds):
        ddp_runs += run_ddp(make_spec(name, args), 29500 + r)[1:]
        d = run_dynabatch(make_spec(name, args, allreduce="bucketed"))
        dyn_runs += d["epochs"]
        dyn_train += d["train_wall_s"]
        breakdowns += d["breakdown"]
        if args.compare_flat and r == 0:  # one flat run per model keeps the bench short
            f = run_dynabatch(make_spec(name, args, allreduce="flat"))
            flat_runs += f["epochs"]
            flat_breakdowns += f["breakdown"]
        print(f"[{name}] round {r}: ddp {statistics.median(ddp_runs):.3f}s "
              f"dynabatch {statistics.median(dyn_runs):.3f}s", file=sys.stderr)
    ddp_s = statistics.median(ddp_runs)
    dyn_s = statistics.median(dyn_runs)
    out: dict[str, Any] = {
        "ddp_epoch_s": round(ddp_s, 4),
        "dynabatch_epoch_s": round(dyn_s, 4),
        "ratio": round(ddp_s / dyn_s, 4),
        "target_ratio": TARGET_RATIO,
        "meets_target": ddp_s / dyn_s >= TARGET_RATIO,
        "dynabatch_training_only_epoch_s": round(statistics.median(dyn_train), 4),
        "ddp_epochs_s": [round(t, 3) for t in ddp_runs],
        "dynabatch_epochs_s": [round(t, 3) for t in dyn_runs],
        "workload": {k: v for k, v in WORKLOADS[name].items()},
    }
    if breakdowns:
        out["dynabatch_step_breakdown_s"] = _median_breakdown(breakdowns)
    if flat_runs:
        flat_s = statistics.median(flat_runs)
        out["flat_allreduce"] = {
            "dynabatch_epoch_s": round(flat_s, 4), "ratio": round(ddp_s / flat_s, 4),
            "bucketed_speedup_over_flat": round(flat_s / dyn_s, 4),
            "epochs_s": [round(t, 3) for t in flat_runs],
            "step_breakdown_s": _median_breakdown(flat_breakdowns) if flat_breakdowns else None,
        }
    return out


def _median_breakdown(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(b[k] for b in rows), 6) for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lenet,resnet")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compare-flat", dest="compare_flat", action="store_false",
                    help="Skip the flat all-reduce runs (bucketed against flat).")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    from service.raycluster import fast_health_check

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 200 * 2**20, "_system_config": fast_health_check()})
    for i in range(2):
        cluster.add_node(num_cpus=1, resources={"bench_node": 1, f"n{i}": 1},
                         object_store_memory=150 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="dynabatch-bench", log_to_driver=False)
    try:
        result = {"setup": "2 equal workers x 1 CPU thread, gloo; DDP = torch DDP in 2 "
                           "processes; dynabatch = Coordinator, policy static, Ray actors",
                  "epochs_per_run": args.epochs, "rounds": args.rounds, "models": {}}
        for name in args.models.split(","):
            result["models"][name] = bench_model(name, args)
    finally:
        ray.shutdown()
        cluster.shutdown()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

"""dynabatch against plain PyTorch DDP on equal nodes: the same model, data and global batch.

Three arms, run side by side in every round, in an order that rotates from round to round
(round r starts with arm r mod 3), so drift on a shared machine hits each arm alike:

* **ddp**: ``torch.nn.parallel.DistributedDataParallel`` over gloo, 2 processes x 1 torch
  thread, each step's global batch split in halves, SGD with momentum, no evaluation.
  DDP's default buckets (25 MiB, first 1 MiB) hold either model whole: one all-reduce per
  step, launched when the last gradient is ready.
* **bucketed**: a ``Coordinator`` with ``policy: static`` over 2 Ray worker actors on a
  ``ray.cluster_utils`` cluster of 2 one-CPU nodes, ``allreduce: bucketed`` with the
  default bucket sizes: on the CPU, DDP's own (one bucket for these models, launched from
  backward's last hook); ``--quarter-buckets`` gives the GPU default instead (a quarter of
  the model: several buckets launched from the hooks as backward goes). Everything a job
  does is timed: the coordinator's planning and ledger, the exactly-once coverage, the
  per-step telemetry, the per-epoch evaluation.
* **flat**: the same job with ``allreduce: flat`` (one all-reduce after backward).

All arms train the same sample order (:func:`dynabatch.actors.contracts.epoch_order`) from the same
initial weights. An epoch's time is wall clock between the ends of consecutive epochs'
training, taken for epochs 1 .. E-2 of every run: epoch 0 carries start-up, and
dynabatch's last epoch also waits for the final evaluation. A dynabatch epoch so includes
the previous epoch's evaluation ("incl. eval"); "training only" subtracts what that
evaluation cost the critical path (its ``evaluation_s``). Figures are medians over all
those epochs of all rounds; ``paired_ratio_median`` is the median over rounds of each
round's own ratio, which cancels drift between rounds.

**The step path alone** (``step_path``): DDP, a bucketed and a flat
:class:`~dynabatch.actors.worker.Worker` in the same two processes and process group, without Ray or
a coordinator, one epoch of each per round in rotating order (round 0 left out). It tells
the worker's step (its bucketing, coverage slots, telemetry) from what the job around it
adds (evaluation, the epoch boundary, Ray).

``ratio = ddp_epoch_s / dynabatch_epoch_s`` (> 1: dynabatch is faster, evaluation
included); the target (>= 0.95) is kept in the output whatever was measured. The overlap
block reports the communication actually hidden behind compute (``overlap_s``: how long
some bucket's all-reduce was in flight while the worker still computed, from each
collective's completion callback) against what was left exposed (``allreduce_wait_s``).

Prints one JSON object; ``--out FILE`` writes it too. Usage:
python bench/ddp_overhead.py [--models lenet,resnet] [--rounds 5] [--epochs 5] [--out F]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from dynabatch.actors.contracts import epoch_order
from dynabatch.actors.reducer import auto_bucket_bytes, plan_buckets
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.actors.workloads.models import build_model

from bench.report import emit

TARGET_RATIO = 0.95
ARMS = ("ddp", "bucketed", "flat")
WORKLOADS = {
    # LeNet on 28x28 MNIST-format, B = 256 (the measurement).
    "lenet": {"model": {"name": "lenet"}, "n_train": 12000, "n_test": 2000, "batch": 256},
    # The small ResNet (16-32-64, one block per stage) on the same images, fewer samples.
    "resnet": {"model": {"name": "resnet"}, "n_train": 2048, "n_test": 512, "batch": 128},
}


def make_spec(name: str, args: argparse.Namespace, **extra: Any) -> JobSpec:
    w = WORKLOADS[name]
    n_train = max(w["batch"] * 4, int(w["n_train"] * args.scale))
    n_test = max(64, int(w["n_test"] * args.scale))
    body = {
        "name": f"ddp-{name}", "model": w["model"],
        "dataset": {"name": "mnist", "options": {"n_train": n_train, "n_test": n_test}},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "workers": 2, "global_batch": w["batch"], "epochs": args.epochs, "policy": "static",
        "seed": args.seed, "node_resource": "bench_node", "collective_timeout_s": 120,
    }
    if getattr(args, "quarter_buckets", False):
        # The GPU default on the CPU: a quarter of the model a bucket (see actors/reducer.py).
        _, rest = auto_bucket_bytes(4 * model_params(name), gpu=True)
        body["bucket_kb"] = max(1, rest // 1024)
    body.update(extra)
    return JobSpec.model_validate(body)


def steady(epochs: list[float]) -> list[float]:
    """Epochs 1 .. E-2 (see the module docstring)."""
    return epochs[1:-1] if len(epochs) >= 3 else epochs[1:]


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


def run_ddp(spec: JobSpec, port: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # Only the fields set: a spec round-trips through its JSON without its defaults.
    spec_json = spec.model_dump_json(exclude_unset=True)
    procs = [ctx.Process(target=_ddp_proc, args=(r, spec_json, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    epochs = q.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    return {"epochs": steady(epochs)}


# --------------------------------------------------------------------------------------------
# The step path alone: DDP and dynabatch's Worker in the same two processes, no Ray


def _step_path_proc(rank: int, spec_json: str, rounds: int, q_rv: Any, out_q: Any
                    ) -> None:
    """DDP, a bucketed and a flat :class:`dynabatch.actors.worker.Worker` in one process each rank,
    one epoch of each per round in rotating order; a barrier around each epoch."""
    from dynabatch.actors.contracts import SegmentPlan, StepPlan
    from dynabatch.actors.worker import Worker

    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(spec_json)
    ds = load_dataset(spec.dataset, seed=spec.seed)
    shape = tuple(ds.input_shape)
    workers = {a: Worker(f"{a}{rank}", rank, spec.model_copy(update={"allreduce": a}),
                         ds.x_train, ds.y_train, shape, ds.num_classes)
               for a in ("bucketed", "flat")}
    if rank == 0:
        rv = workers["bucketed"].group.open_store(1, 2, "gloo", host="127.0.0.1")
        q_rv.put(rv)
    else:
        rv = q_rv.get(timeout=120)
    workers["bucketed"].group.join(rv, rank)  # the default group, shared by all arms
    torch.manual_seed(spec.seed)
    ddp = torch.nn.parallel.DistributedDataParallel(
        build_model(spec.model, shape, ds.num_classes))
    o = spec.optimizer
    opt = torch.optim.SGD(ddp.parameters(), lr=o.lr, momentum=o.momentum)
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    B, n = spec.global_batch, len(y)
    steps = -(-n // B)

    def shares(s: int) -> tuple[int, int, int, int]:
        lo, size = s * B, min(B, n - s * B)
        half = -(-size // 2)
        return (lo, size, lo, half) if rank == 0 else (lo, size, lo + half, size - half)

    def ddp_epoch(e: int) -> list:
        order = epoch_order(spec.seed, e, n)
        for s in range(steps):
            _, _, own, size = shares(s)
            ids = torch.from_numpy(order[own:own + size])
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(ddp(x.index_select(0, ids)), y.index_select(0, ids)).backward()
            opt.step()
        return []

    def dyn_epoch(e: int, arm: str) -> list:
        plan = SegmentPlan(e, spec.seed, n, tuple(StepPlan(s, *shares(s)) for s in range(steps)))
        res = workers[arm].run_segment(plan)
        if res.error:
            raise RuntimeError(f"{arm}: {res.error}")
        return res.steps

    times: dict[str, list[float]] = {"ddp": [], "bucketed": [], "flat": []}
    tel: dict[str, list] = {"bucketed": [], "flat": []}
    arms = list(times)
    for r in range(rounds):
        for arm in arms[r % 3:] + arms[:r % 3]:
            dist.barrier()
            t0 = time.perf_counter()
            st = ddp_epoch(r) if arm == "ddp" else dyn_epoch(r, arm)
            dist.barrier()
            times[arm].append(time.perf_counter() - t0)
            if arm != "ddp":
                tel[arm] += st
    if rank == 0:
        keys = ("compute_s", "wait_s", "overlap_s", "forward_s", "backward_s", "optimizer_s",
                "step_s")
        out_q.put({"epochs": times, "telemetry": {
            a: {k: statistics.median(getattr(s, k) for s in tel[a]) for k in keys}
            for a in tel}})
    dist.barrier()
    workers["bucketed"].group.leave()


def run_step_path(spec: JobSpec, rounds: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q_rv, out_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_step_path_proc,
                         args=(r, spec.model_dump_json(exclude_unset=True), rounds, q_rv, out_q))
             for r in range(2)]
    for p in procs:
        p.start()
    res = out_q.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    ep = res["epochs"]
    med = {a: statistics.median(ts[1:] or ts) for a, ts in ep.items()}  # round 0 warms up
    return {
        "epoch_s": {a: round(v, 4) for a, v in med.items()},
        "ratio": round(med["ddp"] / med["bucketed"], 4),
        "bucketed_speedup_over_flat": round(med["flat"] / med["bucketed"], 4),
        "epochs_s": {a: [round(t, 3) for t in ts] for a, ts in ep.items()},
        "step_ms": {a: {k: round(1000 * v, 3) for k, v in t.items()}
                    for a, t in res["telemetry"].items()},
    }


# --------------------------------------------------------------------------------------------
# dynabatch


def run_dynabatch(spec: JobSpec) -> dict[str, Any]:
    from dynabatch.scheduler.sync.coordinator import Coordinator

    coord = Coordinator(f"ddp-{spec.name}-{spec.allreduce}", spec, resume=False)
    # The end of each epoch's training: when the coordinator moves to the next epoch. Read
    # after every control-loop step, including the one that ends the job.
    ends: list[float] = []
    more = True
    while more:
        more = coord.step()
        if coord.epoch > len(ends):
            ends.append(time.perf_counter())
    snap = coord.snapshot()
    if snap.state.value != "SUCCEEDED":
        raise RuntimeError(f"dynabatch ({spec.allreduce}): {snap.reason}")
    if len(ends) != spec.epochs:
        raise RuntimeError(f"dynabatch: saw {len(ends)} epoch ends of {spec.epochs}")
    hist = {r.epoch: r for r in coord.history()}
    windows = [b - a for a, b in itertools.pairwise(ends)]  # windows[k - 1]: epoch k
    keep = range(1, len(windows)) if len(windows) >= 2 else range(1, len(windows) + 1)
    epochs, training, evaluation = [], [], []
    for k in keep:
        # Epoch k's window holds epoch k-1's evaluation (the holders score their shards
        # before they train on).
        ev = hist[k - 1].evaluation_s if k - 1 in hist else 0.0
        epochs.append(windows[k - 1])
        training.append(windows[k - 1] - ev)
        evaluation.append(ev)
    breakdown = [hist[k].breakdown.model_dump() for k in keep
                 if k in hist and hist[k].breakdown is not None]
    return {"epochs": epochs, "training_only": training, "evaluation": evaluation,
            "breakdown": breakdown}


# --------------------------------------------------------------------------------------------


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _median_breakdown(rows: list[dict[str, float]]) -> dict[str, float]:
    """Median of each phase over the rows (a phase no row measured, None, is left out)."""
    out = {}
    for k in rows[0] if rows else ():
        vals = [b[k] for b in rows if b.get(k) is not None]
        if vals:
            out[k] = round(statistics.median(vals), 6)
    return out


def model_sizes(name: str) -> list[int]:
    spec = make_spec(name, argparse.Namespace(scale=0.05, epochs=1, seed=0))
    ds = load_dataset(spec.dataset)
    model = build_model(spec.model, tuple(ds.input_shape), ds.num_classes)
    return [p.numel() for p in model.parameters()]


def model_params(name: str) -> int:
    return sum(model_sizes(name))


def planned_buckets(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The bucket plan the bucketed arm's CPU workers use (the functions they call)."""
    sizes = model_sizes(name)
    spec = make_spec(name, args)
    if spec.bucket_kb is not None:
        first = rest = spec.bucket_kb * 1024
    else:
        first, rest = auto_bucket_bytes(4 * sum(sizes), gpu=False)
    buckets = plan_buckets(sizes, rest // 4, first // 4)
    return {"params": sum(sizes), "bucket_bytes": rest, "first_bucket_bytes": first,
            "buckets": len(buckets), "bucket_elems": [hi - lo for lo, hi, _ in buckets],
            "ddp_default_buckets": len(plan_buckets(sizes, (25 << 20) // 4, (1 << 20) // 4))}


def bench_model(name: str, args: argparse.Namespace, port: list[int]) -> dict[str, Any]:
    step_path = None
    if args.step_path:
        step_path = run_step_path(make_spec(name, args), max(3, args.rounds + 1))
        print(f"[{name}] step path: {step_path['epoch_s']}", file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    arms = [a for a in ARMS if a != "flat" or args.compare_flat]
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm in order:
            if arm == "ddp":
                port[0] += 1
                runs[arm].append(run_ddp(make_spec(name, args), port[0]))
            else:
                runs[arm].append(run_dynabatch(make_spec(name, args, allreduce=arm)))
        line = " ".join(f"{a} {_med(runs[a][-1]['epochs']):.3f}s" for a in arms)
        print(f"[{name}] round {r} ({','.join(order)}): {line}", file=sys.stderr)

    def pooled(arm: str, key: str = "epochs") -> list[float]:
        return [t for run in runs[arm] for t in run[key]]

    def paired(num: str, den: str, key_den: str = "epochs") -> float:
        return _med([_med(a["epochs"]) / _med(b[key_den])
                     for a, b in zip(runs[num], runs[den], strict=True)])

    ddp_s, dyn_s = _med(pooled("ddp")), _med(pooled("bucketed"))
    train_s = _med(pooled("bucketed", "training_only"))
    eval_s = _med(pooled("bucketed", "evaluation"))
    bd = _median_breakdown([b for run in runs["bucketed"] for b in run["breakdown"]])
    out: dict[str, Any] = {
        "ddp_epoch_s": round(ddp_s, 4),
        "dynabatch_epoch_s": round(dyn_s, 4),
        "ratio": round(ddp_s / dyn_s, 4),
        "target_ratio": TARGET_RATIO,
        "meets_target": ddp_s / dyn_s >= TARGET_RATIO,
        "paired_ratio_median": round(paired("ddp", "bucketed"), 4),
        "dynabatch_training_only_epoch_s": round(train_s, 4),
        "ratio_training_only": round(ddp_s / train_s, 4),
        "paired_ratio_training_only_median": round(paired("ddp", "bucketed", "training_only"),
                                                   4),
        "evaluation_s_per_epoch": round(eval_s, 4),
        "evaluation_share_of_epoch": round(eval_s / dyn_s, 4),
        "ddp_epochs_s": [round(t, 3) for t in pooled("ddp")],
        "dynabatch_epochs_s": [round(t, 3) for t in pooled("bucketed")],
        "dynabatch_training_only_epochs_s": [round(t, 3) for t in
                                             pooled("bucketed", "training_only")],
        "dynabatch_step_breakdown_s": bd,
        "bucket_plan": planned_buckets(name, args),
        "workload": dict(WORKLOADS[name], scale=args.scale),
    }
    if runs["flat"]:
        flat_s = _med(pooled("flat"))
        fb = _median_breakdown([b for run in runs["flat"] for b in run["breakdown"]])
        out["flat_allreduce"] = {
            "dynabatch_epoch_s": round(flat_s, 4), "ratio": round(ddp_s / flat_s, 4),
            "training_only_epoch_s": round(_med(pooled("flat", "training_only")), 4),
            "bucketed_speedup_over_flat": round(flat_s / dyn_s, 4),
            "paired_speedup_median": round(paired("flat", "bucketed"), 4),
            "epochs_s": [round(t, 3) for t in pooled("flat")],
            "step_breakdown_s": fb,
        }
    if step_path is not None:
        out["step_path"] = step_path
    if bd:
        hidden, exposed = bd.get("overlap_s", 0.0), bd.get("allreduce_wait_s", 0.0)
        out["overlap"] = {
            "hidden_s_per_step": hidden,
            "exposed_wait_s_per_step": exposed,
            "hidden_share": round(hidden / (hidden + exposed), 4) if hidden + exposed else 0.0,
            "flat_exposed_wait_s_per_step": (out.get("flat_allreduce", {})
                                             .get("step_breakdown_s", {})
                                             .get("allreduce_wait_s")),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lenet,resnet")
    ap.add_argument("--epochs", type=int, default=5,
                    help="Epochs per run (epochs 1 .. E-2 are timed; at least 3).")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0,
                    help="Fraction of each workload's samples (smoke runs: 0.25).")
    ap.add_argument("--quarter-buckets", action="store_true",
                    help="The bucketed arm uses the GPU default (a quarter of the model a "
                    "bucket) instead of the CPU default (DDP's sizes).")
    ap.add_argument("--no-compare-flat", dest="compare_flat", action="store_false",
                    help="Skip the flat all-reduce arm (bucketed against flat).")
    ap.add_argument("--no-step-path", dest="step_path", action="store_false",
                    help="Skip the step path alone (DDP against the Worker, no Ray).")
    ap.add_argument("--quiet-ray", action="store_true",
                    help="Run Ray as a bare cluster: no dashboard (so no log API: the job's "
                    "actors' output is not followed) and Ray's default health checks "
                    "instead of the service's 200 ms ones. Where the gap to DDP goes: the "
                    "services around the job cost CPU on the workers' cores.")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.epochs < 3:
        ap.error("--epochs: at least 3 (epochs 1 .. E-2 are timed)")

    import ray
    from dynabatch.service.raycluster import fast_health_check
    from ray.cluster_utils import Cluster

    head: dict[str, Any] = {"num_cpus": 0, "object_store_memory": 200 * 2**20}
    if args.quiet_ray:
        head["include_dashboard"] = False
    else:
        head["_system_config"] = fast_health_check()
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for i in range(2):
        cluster.add_node(num_cpus=1, resources={"bench_node": 1, f"n{i}": 1},
                         object_store_memory=150 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="dynabatch-bench", log_to_driver=False)
    port = [29500 + os.getpid() % 1000]
    try:
        result = {"setup": "2 equal workers x 1 CPU thread, gloo; DDP = torch DDP in 2 "
                           "processes; dynabatch = Coordinator, policy static, Ray actors; "
                           "arms rotate in every round",
                  "epochs_per_run": args.epochs, "rounds": args.rounds,
                  "timed_epochs": "1 .. E-2 of every run",
                  "ray": ("bare: no dashboard, default health checks" if args.quiet_ray else
                          "as the service runs it: dashboard (log API), health checks "
                          "every 200 ms"),
                  "command": " ".join(sys.argv), "models": {}}
        for name in args.models.split(","):
            result["models"][name] = bench_model(name, args, port)
    finally:
        ray.shutdown()
        cluster.shutdown()
    emit(result, args.out, indent=2)


if __name__ == "__main__":
    main()

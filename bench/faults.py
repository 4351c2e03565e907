"""Fault trials on a ``ray.cluster_utils`` cluster: does every job end as it should, without
hanging, with every epoch verified exactly once from the workers' reports?

Kinds (4 trials each by default, 32 in all):

* ``first_step``, ``mid_epoch``, ``last_step``: the node of one of 3 workers is removed
  while that step of epoch 1 runs. To land the removal inside the step, the victim is
  slowed (emulated, x1000: about a second) on exactly that step, and the node is removed once the
  coordinator has started it;
* ``two_nodes``: two of 4 workers' nodes are removed at once, mid-epoch;
* ``during_regroup``: one node is removed, and a second one as soon as the coordinator
  logs the failure, while it forms the new group;
* ``deterministic_error``: a worker raises on every step from epoch 1 step 3
  (``bench/worker_probes.py``'s ``fail_from``): the job must FAIL with that error, within
  a bound;
* ``hung_worker``: a worker stalls for 1000 s before its all-reduce;
* ``random``: one node removed at a uniformly random step of the job (epoch and step
  drawn uniformly; the removal follows the coordinator reaching it).

Every job has spare nodes, so a lost worker is replaced (the job keeps 3 or 4 workers).
A trial *passes* when the job ended as it should (SUCCEEDED, or FAILED naming the error
within ``3 x (collective_timeout_s + 5)`` s of its first failure for
``deterministic_error``), its thread finished within the time limit (nothing hung), and
every finished epoch's record is ``verified``: the ledger rebuilt it from the workers'
reports and found every sample trained exactly once. Prints one JSON object.

    .venv/bin/python bench/faults.py --out bench/results-faults.json
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sync.coordinator import Coordinator
from dynabatch.service.raycluster import fast_health_check
from ray.cluster_utils import Cluster

from bench.report import emit
from bench.worker_probes import fail_when_spawned, stall

KINDS = ("first_step", "mid_epoch", "last_step", "two_nodes", "during_regroup",
         "deterministic_error", "hung_worker", "random")
EPOCHS = 3
TIMEOUT_S = 3.0
JOB_LIMIT_S = 180.0
N_TRAIN, BATCH = 1437, 64  # digits' training split: 23 steps, the last one partial
SPE = -(-N_TRAIN // BATCH)
STEP_OF = {"first_step": 0, "mid_epoch": SPE // 2, "last_step": SPE - 1}


def make_spec(tag: str, workers: int, **kw: Any) -> JobSpec:
    base = dict(name=tag, dataset={"name": "digits"}, model={"name": "mlp", "hidden": 128},
                optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}, workers=workers,
                max_workers=workers, min_workers=1, global_batch=BATCH, epochs=EPOCHS, seed=7,
                node_resource=tag, collective_timeout_s=TIMEOUT_S, worker_wait_timeout_s=30,
                rebalance={"mode": "steps", "every_steps": 1})
    base.update(kw)
    return JobSpec.model_validate(base)


def wait_until(pred, limit: float, interval: float = 0.001) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


def trial(cluster: Cluster, kind: str, i: int, rng: random.Random) -> dict[str, Any]:
    tag = f"f_{kind}_{i}"
    workers = 4 if kind == "two_nodes" else 3
    nodes = [cluster.add_node(num_cpus=1, resources={tag: 1}, object_store_memory=80 * 2**20)
             for _ in range(workers + 2)]
    cluster.wait_for_nodes()
    by_id = {n.node_id: n for n in nodes}
    kw: dict[str, Any] = {}
    victim_ordinal = rng.randrange(workers)
    if kind in STEP_OF:
        # Slow the victim on exactly the target step, so the removal lands inside it.
        kw["emulation"] = {"slowdowns": [1.0] * workers, "disturbances": [
            {"worker": victim_ordinal, "factor": 1000, "epoch": 1, "step": STEP_OF[kind]},
            {"worker": victim_ordinal, "factor": 1, "epoch": 1, "step": STEP_OF[kind] + 1}]}
    coord = Coordinator(f"faults-{tag}", make_spec(tag, workers, **kw), resume=False)
    if kind == "deterministic_error":
        fail_when_spawned(coord.runtime, victim_ordinal, 1, 3)
    thread = threading.Thread(target=coord.run, daemon=True)
    t0 = time.monotonic()
    thread.start()
    fault_at: float | None = None
    note = ""

    def at(epoch: int, step: int) -> bool:
        return (coord.epoch, coord.step_in_epoch) >= (epoch, step) or coord.state.is_terminal

    def remove(worker_id: str) -> None:
        m = coord.membership.get(worker_id)
        if m is not None and m.node in by_id:
            cluster.remove_node(by_id.pop(m.node), allow_graceful=False)

    def victim() -> str:
        return f"w{victim_ordinal}"

    if kind in STEP_OF:
        wait_until(lambda: at(1, STEP_OF[kind]), 120)
        fault_at = time.monotonic()
        remove(victim())
    elif kind == "two_nodes":
        wait_until(lambda: at(1, SPE // 2), 120)
        fault_at = time.monotonic()
        ids = list(coord.membership.worker_ids)
        for w in rng.sample(ids, 2):
            remove(w)
    elif kind == "during_regroup":
        wait_until(lambda: at(1, 5), 120)
        fault_at = time.monotonic()
        ids = list(coord.membership.worker_ids)
        first, second = rng.sample(ids, 2)
        seen = len(coord.logs())
        remove(first)
        wait_until(lambda: any("failed" in x.message for x in coord.logs(seen)), 30)
        remove(second)
        note = "hit the regroup" if wait_until(
            lambda: any("regroup failed" in x.message for x in coord.logs(seen)), 10, 0.01
        ) else "second loss seen before the regroup"
    elif kind == "deterministic_error":
        wait_until(lambda: at(1, 3), 120)
        fault_at = time.monotonic()
    elif kind == "hung_worker":
        wait_until(lambda: at(1, 4), 120)
        fault_at = time.monotonic()
        ray.get(coord.runtime._handles[victim()].__ray_call__.remote(stall, 1000.0), timeout=30)
    elif kind == "random":
        epoch, step = rng.randrange(EPOCHS), rng.randrange(SPE)
        note = f"drawn: epoch {epoch} step {step}"
        wait_until(lambda: coord.state != JobState.PENDING and at(epoch, step), 120)
        fault_at = time.monotonic()
        ids = list(coord.membership.worker_ids)
        if ids and not coord.state.is_terminal:
            remove(rng.choice(ids))
    thread.join(timeout=JOB_LIMIT_S - (time.monotonic() - t0))
    hung = thread.is_alive()
    end = time.monotonic()
    snap = coord.snapshot()
    hist = coord.history()
    verified = bool(hist) and all(r.verified and r.samples_trained == r.dataset_size
                                  for r in hist)
    position = next((x.message for x in coord.logs() if "failed" in x.message), "")
    if kind == "deterministic_error":
        bound = 3 * (TIMEOUT_S + 5)
        ended_right = (snap.state == JobState.FAILED and "InjectedFault" in (snap.reason or "")
                       and fault_at is not None and end - fault_at <= bound)
        verified = verified and len(hist) == 1
    else:
        ended_right = snap.state == JobState.SUCCEEDED and len(hist) == EPOCHS
    if hung:
        coord.cancel("bench: hung")
    coord.shutdown()
    for n in by_id.values():
        cluster.remove_node(n, allow_graceful=False)
    return {
        "kind": kind, "state": snap.state.value, "reason": snap.reason, "hung": hung,
        "accounting_verified": verified, "passed": ended_right and not hung and verified,
        "seconds": round(end - t0, 2),
        "fault_to_end_s": None if fault_at is None else round(end - fault_at, 2),
        "first_failure": position, "note": note,
        "events": [f"{e.kind}:{e.worker}:{e.reason}" for e in coord.membership_events()
                   if e.kind != "join"],
        "log_tail": [] if ended_right else [x.message for x in coord.logs()][-25:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 200 * 2**20, "_system_config": fast_health_check()})
    ray.init(address=cluster.address, namespace="dynabatch-bench", log_to_driver=False)
    rows = []
    try:
        for i in range(args.per_kind):
            for kind in KINDS:
                rows.append(trial(cluster, kind, i, rng))
                r = rows[-1]
                print(f"{kind} #{i}: {'pass' if r['passed'] else 'FAIL'} {r['state']} "
                      f"{r['seconds']}s {r['first_failure'][:90]} {r['reason'] or ''}",
                      file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    kinds = {k: {"trials": sum(r["kind"] == k for r in rows),
                 "passed": sum(r["kind"] == k and r["passed"] for r in rows)} for k in KINDS}
    out = {
        "trials": len(rows), "passed": sum(r["passed"] for r in rows),
        "hung": sum(r["hung"] for r in rows),
        "accounting_verified": sum(r["accounting_verified"] for r in rows),
        "kinds": kinds,
        "setup": {"cluster": "ray.cluster_utils on one 2-core machine, 1 CPU per node",
                  "dataset": "digits", "model": "mlp hidden 128", "global_batch": BATCH,
                  "epochs": EPOCHS, "collective_timeout_s": TIMEOUT_S},
        "runs": rows,
    }
    emit(out, args.out, indent=2)


if __name__ == "__main__":
    main()

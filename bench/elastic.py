"""Recovery times of elastic membership, on a ``ray.cluster_utils`` cluster.

* Node loss: a node hosting one of 3 workers is removed mid-epoch. Reported: seconds from
  the removal to the failure being detected (the scheduler's failure event), and from
  detection until training runs again (the next completed step, over the survivors).
* Scale-up: a node joins a running 2-worker job (max_workers 3). Reported: seconds from the
  node being ready (``add_node`` returned) until its worker joins the group, and until the
  first step that the new worker trained.

The gloo timeout is ``collective_timeout_s`` (3 s here): a survivor blocked in an
all-reduce with the dead peer waits at most that long. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
from ray.cluster_utils import Cluster

from actors.spec import JobSpec
from scheduler.coordinator import Coordinator
from service.raycluster import fast_health_check


def spec(tag: str, **kw: Any) -> JobSpec:
    base = dict(name=tag, dataset={"name": "mnist", "options": {"n_train": 6000, "n_test": 500}},
                model={"name": "lenet"}, optimizer={"name": "sgd", "lr": 0.05},
                workers=3, min_workers=1, global_batch=128, epochs=6, node_resource=tag,
                collective_timeout_s=3)
    base.update(kw)
    return JobSpec.model_validate(base)


def watch(coord: Coordinator, stop: threading.Event, out: list[tuple[float, int, int, int]]):
    last = None
    while not stop.is_set():
        cur = (coord.epoch, coord.step_in_epoch, len(coord.members))
        if cur != last:
            out.append((time.time(), *cur))
            last = cur
        time.sleep(0.002)


def node_loss(cluster: Cluster, run: int) -> dict[str, float]:
    tag = f"bench_loss{run}"
    nodes = [cluster.add_node(num_cpus=1, resources={tag: 1}) for _ in range(3)]
    cluster.wait_for_nodes()
    coord = Coordinator("loss", spec(tag), resume=False)
    progress: list[tuple[float, int, int, int]] = []
    stop = threading.Event()
    threading.Thread(target=watch, args=(coord, stop, progress), daemon=True).start()
    runner = threading.Thread(target=coord.run, daemon=True)
    runner.start()
    while not (coord.epoch == 1 and coord.step_in_epoch >= 5):
        time.sleep(0.005)
    victim = coord.members[-1]
    t_remove = time.time()
    cluster.remove_node(next(n for n in nodes if n.node_id == victim.node),
                        allow_graceful=False)
    runner.join()
    stop.set()
    failure = next(e for e in coord.membership_events() if e.kind == "failure")
    # Training runs again when the survivors complete their first segment: the first
    # progress after the membership dropped to 2.
    i2 = next(i for i, p in enumerate(progress) if p[0] >= t_remove and p[3] == 2)
    resumed = next(p for p in progress[i2 + 1:] if p[1:3] != progress[i2][1:3])
    snap = coord.snapshot()
    return {"detect_s": failure.time - t_remove,
            "detection_to_training_s": resumed[0] - failure.time,
            "removal_to_training_s": resumed[0] - t_remove,
            "state": snap.state.value, "retried_samples": snap.retried_samples_total,
            "regroup_seconds_total": snap.regroup_seconds_total,
            "accounting_ok": all(r.samples_trained == r.dataset_size for r in coord.history())}


def scale_up(cluster: Cluster, run: int) -> dict[str, float]:
    tag = f"bench_join{run}"
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={tag: 1})
    cluster.wait_for_nodes()
    coord = Coordinator("join", spec(tag, workers=2, max_workers=3, epochs=12), resume=False)
    progress: list[tuple[float, int, int, int]] = []
    stop = threading.Event()
    threading.Thread(target=watch, args=(coord, stop, progress), daemon=True).start()
    runner = threading.Thread(target=coord.run, daemon=True)
    runner.start()
    while coord.epoch < 1:
        time.sleep(0.01)
    cluster.add_node(num_cpus=1, resources={tag: 1})
    cluster.wait_for_nodes()
    t_ready = time.time()
    runner.join()
    stop.set()
    join = next(e for e in coord.membership_events() if e.kind == "join" and e.worker == "w2")
    # The first segment the new worker trained in ends at the first progress after the
    # membership became 3.
    i3 = next(i for i, p in enumerate(progress) if p[0] >= t_ready and p[3] == 3)
    first = next(p for p in progress[i3 + 1:] if p[1:3] != progress[i3][1:3])
    return {"ready_to_join_s": join.time - t_ready, "ready_to_first_step_s": first[0] - t_ready,
            "join_to_first_step_s": first[0] - join.time, "state": coord.snapshot().state.value}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="Also write the JSON here (Ray prints to "
                    "stdout when a node it knew goes down).")
    args = ap.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 200 * 2**20, "_system_config": fast_health_check()})
    ray.init(address=cluster.address, namespace="dynabatch-bench", log_to_driver=False)
    try:
        repeats = args.repeats
        losses, ups = [], []
        for i in range(repeats):
            losses.append(node_loss(cluster, i))
            print("node loss", losses[-1], file=sys.stderr, flush=True)
        for i in range(repeats):
            ups.append(scale_up(cluster, i))
            print("scale up", ups[-1], file=sys.stderr, flush=True)

        def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
            keys = [k for k, v in rows[0].items() if isinstance(v, float)]
            return {"runs": rows, **{f"median_{k}": statistics.median(r[k] for r in rows)
                                     for k in keys}}

        text = json.dumps({"emulated_cluster": "ray.cluster_utils on one 2-core machine",
                           "collective_timeout_s": 3, "node_loss": summary(losses),
                           "scale_up": summary(ups)}, indent=2)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text + "\n")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()

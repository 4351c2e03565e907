"""Recovery times of elastic membership, on a ``ray.cluster_utils`` cluster.

* Node loss: a node hosting one of 3 workers is removed mid-epoch. Reported: seconds from
  the removal to the failure being detected (the coordinator's failure event), and from
  detection until training runs again (the next completed step, over the survivors).
* Scale-up (a node joins, cold): a node joins a running 2-worker job (max_workers 3).
  Reported: seconds from the node being ready (``add_node`` and ``wait_for_nodes``
  returned) until its worker joins the group, and until the first segment that the new
  worker trained is committed; and the newcomer's start-up timeline (below).
* Scale-up onto a spare: a 2-worker job (max_workers 2) on 3 nodes keeps a pre-warmed spare
  on the idle one; once it is up, the job is scaled to 3. Reported: seconds from the
  request until the spare's worker joins, and until its first segment is committed.

Timeline (seconds after the node was ready, or after the request), from Ray's task events
(``bench/runtime_watch.py``, ``actor_timeline``): ``spawn`` (the job asked for the worker's
actor), ``process`` (its process started: Ray may have started it earlier), ``running``
(Ray began its creation task: imports, torch's among them, then the constructor),
``built`` (data, model, optimizer and warm-up done; for a spare, long before the
request), ``adopt_asked`` and ``adopted`` (a spare took the worker's identity), ``join``
(it joined the group), ``first_step``.

The gloo timeout is ``collective_timeout_s`` (3 s here): a survivor blocked in an
all-reduce with the dead peer waits at most that long. Prints one JSON object.
"""

from __future__ import annotations

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
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.runtime import ray_runtime
from dynabatch.scheduler.sync.coordinator import Coordinator
from dynabatch.service.raycluster import fast_health_check
from ray.cluster_utils import Cluster

from bench.report import emit
from bench.runtime_watch import actor_timeline, record_spares, record_workers, spares_up


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
        cur = (coord.epoch, coord.step_in_epoch, len(coord.membership.members))
        if cur != last:
            out.append((time.time(), *cur))
            last = cur
        time.sleep(0.002)


def timeline(coord: Coordinator, worker: str, handle: Any, adopted: bool, t0: float,
             first: float) -> dict[str, float]:
    st = actor_timeline(handle, adopted)
    out = {k: round(v - t0, 3) for k, v in sorted(st.items(), key=lambda kv: kv[1])}
    join = next(e.time for e in coord.membership_events() if e.kind == "join"
                and e.worker == worker)
    return out | {"join": round(join - t0, 3), "first_step": round(first - t0, 3)}


def first_segment_with(progress: list[tuple[float, int, int, int]], t0: float, n: int
                       ) -> float:
    """When the first segment trained by ``n`` members after ``t0`` was committed: the first
    progress after the membership became ``n``."""
    i = next(i for i, p in enumerate(progress) if p[0] >= t0 and p[3] == n)
    return next(p for p in progress[i + 1:] if p[1:3] != progress[i][1:3])[0]


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
    victim = coord.membership.members[-1]
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
    workers: dict[str, Any] = {}  # worker id -> its actor
    ray_runtime.spawn_worker = record_workers(workers)
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
    first = first_segment_with(progress, t_ready, 3)
    return {"ready_to_join_s": join.time - t_ready, "ready_to_first_step_s": first - t_ready,
            "join_to_first_step_s": first - join.time, "state": coord.snapshot().state.value,
            "timeline": timeline(coord, "w2", workers["w2"], False, t_ready, first)}


def scale_up_spare(cluster: Cluster, run: int) -> dict[str, Any]:
    tag = f"bench_spare{run}"
    for _ in range(3):
        cluster.add_node(num_cpus=1, resources={tag: 1})
    cluster.wait_for_nodes()
    spares: dict[str, Any] = {}  # node id -> the spare started there
    ray_runtime.start_spare = record_spares(spares)
    coord = Coordinator("spare", spec(tag, workers=2, max_workers=2, epochs=12), resume=False)
    progress: list[tuple[float, int, int, int]] = []
    stop = threading.Event()
    threading.Thread(target=watch, args=(coord, stop, progress), daemon=True).start()
    runner = threading.Thread(target=coord.run, daemon=True)
    runner.start()
    deadline = time.monotonic() + 300
    while not (coord.epoch >= 1 and spares_up(spares)):
        if time.monotonic() > deadline or not runner.is_alive():
            raise RuntimeError(f"no spare came up: {coord.snapshot().reason}")
        time.sleep(0.01)
    t_request = time.time()
    coord.scale(3)
    runner.join()
    stop.set()
    join = next(e for e in coord.membership_events() if e.kind == "join" and e.worker == "w2")
    first = first_segment_with(progress, t_request, 3)
    # The spare on w2's node, if it took w2's identity (its adopt call ran), else a fresh
    # worker started there (the spare was lost meanwhile).
    spare = spares.get(join.node)
    shown = timeline(coord, "w2", spare.handle, True, t_request, first) if spare else {}
    return {"request_to_join_s": join.time - t_request,
            "request_to_first_step_s": first - t_request,
            "join_to_first_step_s": first - join.time,
            "adopted_spare": "adopted" in shown,
            "state": coord.snapshot().state.value,
            "timeline": shown}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenarios", default="node_loss,scale_up,scale_up_spare",
                    help="Comma-separated subset to run (all by default).")
    ap.add_argument("--out", default=None, help="Also write the JSON here (Ray prints to "
                    "stdout when a node it knew goes down).")
    args = ap.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 200 * 2**20, "_system_config": fast_health_check()})
    ray.init(address=cluster.address, namespace="dynabatch-bench", log_to_driver=False)
    try:
        chosen = args.scenarios.split(",")
        runs = {"node_loss": node_loss, "scale_up": scale_up, "scale_up_spare": scale_up_spare}
        unknown = sorted(set(chosen) - set(runs))
        if unknown:
            ap.error(f"--scenarios: unknown {unknown}; choose from {sorted(runs)}")
        rows: dict[str, list[dict[str, Any]]] = {}
        for name in chosen:
            for i in range(args.repeats):
                rows.setdefault(name, []).append(runs[name](cluster, i))
                print(name, rows[name][-1], file=sys.stderr, flush=True)

        def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
            keys = [k for k, v in rows[0].items() if isinstance(v, float)]
            return {"runs": rows, **{f"median_{k}": statistics.median(r[k] for r in rows)
                                     for k in keys}}

        out: dict[str, Any] = {"emulated_cluster": "ray.cluster_utils on one 2-core machine",
                               "collective_timeout_s": 3}
        out |= {name: summary(r) for name, r in rows.items()}
        if "scale_up" in rows or "scale_up_spare" in rows:
            # Target: a node that joins trains within 1 s. A cold node pays its process
            # start and the torch import after it is ready; a spare paid them ahead.
            out["scale_up_target_s"] = 1.0
        emit(out, args.out, indent=2)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()

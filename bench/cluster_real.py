"""The cluster scheduler for real on Ray: ``fifo`` against ``goodput`` on one small cluster of
unequal nodes, jobs submitted over REST to ``dynabatch serve``.

A ``ray.cluster_utils.Cluster`` on this machine: a head with no CPUs (the coordinators and
the scheduler actor live there) and 4 one-CPU worker nodes of two types, ``fast`` and
``slow`` (the custom resource ``node-type:<name>``, which the scheduler reads as the node's
type). Their speeds are emulated per node: each raylet's environment carries
``DYNABATCH_EMULATED_NODE_SLOWDOWN`` (``actors/emulation.py``), so any job's worker that
lands on a slow node is slow, whichever job it is. Every job has an ``emulation`` block, so
compute is timed as the thread's CPU time and the emulated part is a sleep: the nodes'
speeds hold on a loaded 2-core machine.

For each policy, back to back on the same Ray cluster: a fresh ``dynabatch serve``
(``DYNABATCH_CLUSTER_SCHEDULER=1``) and a fresh scheduler actor; 3 elastic jobs
(``min_workers`` 1, ``max_workers`` 4) submitted at once over REST, a 4th once the first
job has finished an epoch. Every figure comes from what happened, never from a plan:

* ``avg_jct_s``, ``makespan_s``: from the jobs' records (submitted ``created_at``, ended
  ``finished_at``);
* ``verified``: every epoch of the job's history verified;
* ``resizes``: the membership generations in which workers joined or left the job after
  its start, from its coordinator's membership events (failures and evictions left out);
  finished coordinators are kept (``DYNABATCH_RELEASE_FINISHED=0``) until they are read;
* ``restarts``: the store's count of resumes.

    python bench/cluster_real.py --quick [--out results.json]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dynabatch.actors.emulation import NODE_SLOWDOWN_ENV
from dynabatch.scheduler.runtime.cluster_scheduler import NAMESPACE, SCHEDULER_NAME
from dynabatch.scheduler.runtime.launch import find_coordinator
from real_hetero import Api
from report import emit

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
POLICIES = ("fifo", "goodput")
TAG = "creal"  # the resource every worker node carries, which the jobs ask for
# (type, emulated slowdown) of the 4 worker nodes: two fast, two three times slower.
NODES = (("fast", 50.0), ("fast", 50.0), ("slow", 150.0), ("slow", 150.0))
# Kinds of membership event that are not a resize (a worker lost or evicted).
NOT_RESIZES = ("failure", "evict")


def job_spec(i: int, epochs: int) -> dict[str, Any]:
    """A small elastic job: 1 to 4 workers on the ``creal`` nodes, a seeded synthetic set
    (offline), an MLP whose step is a few ms of real compute, stretched by the nodes'
    emulated slowdowns (``slowdowns`` of 1.0 turn emulation on, so the node's factor
    applies)."""
    return {
        "name": f"creal-{i}",
        "dataset": {
            "name": "synthetic",
            "options": {"n_samples": 4096, "n_features": 128, "n_classes": 10},
        },
        "model": {"name": "mlp", "hidden": 256},
        "optimizer": {"name": "sgd", "lr": 0.05},
        "global_batch": 256,
        "epochs": epochs,
        "seed": i,
        "workers": 2,
        "min_workers": 1,
        "max_workers": 4,
        "node_resource": TAG,
        "spares": 0,
        "emulation": {"slowdowns": [1.0, 1.0]},  # one per starting worker
        "collective_timeout_s": 30,
        "worker_wait_timeout_s": 120,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log(msg: str) -> None:
    print(f"[cluster_real {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Service(Api):
    """``dynabatch serve`` against the cluster, with the cluster scheduler on; its REST
    calls are :class:`real_hetero.Api`'s."""

    def __init__(self, address: str, policy: str, workdir: Path, round_s: float, hold_s: float):
        port = free_port()
        env = os.environ | {
            "DYNABATCH_RAY_ADDRESS": address,
            "DYNABATCH_PORT": str(port),
            "DYNABATCH_DB_PATH": str(workdir / f"{policy}.db"),
            "DYNABATCH_CLUSTER_SCHEDULER": "1",
            "DYNABATCH_CLUSTER_POLICY": policy,
            "DYNABATCH_CLUSTER_ROUND_S": str(round_s),
            "DYNABATCH_CLUSTER_HOLD_S": str(hold_s),
            "DYNABATCH_SYNC_INTERVAL_S": "0.5",
            "DYNABATCH_RELEASE_FINISHED": "0",  # the bench reads their membership events
            "DYNABATCH_LOG_LEVEL": "warning",
        }
        env.pop("DYNABATCH_API_TOKEN", None)
        exe = Path(sys.executable).with_name("dynabatch")
        self.log = open(workdir / f"serve-{policy}.log", "w")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(
            [str(exe), "serve"], env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        super().__init__(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"dynabatch serve exited {self.proc.returncode}; see {self.log.name}"
                )
            try:
                if self.http.get("/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"dynabatch serve not ready in 120 s; see {self.log.name}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.http.close()
        self.log.close()


def resizes(job_id: str, generation: int) -> int | None:
    """The job's resizes, from its coordinator's membership events: the membership
    generations in which workers joined or left, less the first (its first workers joining).
    A lost or evicted worker is not a resize. None when the coordinator is gone."""
    handle = find_coordinator(job_id, generation)
    if handle is None:
        return None
    events = ray.get(handle.membership_events.remote(), timeout=30)
    changed = {e.generation for e in events if e.kind not in NOT_RESIZES}
    return max(0, len(changed) - 1)


def find_scheduler() -> Any | None:
    """The cluster's scheduler actor, None when none runs."""
    try:
        return ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def release(job_ids: list[str]) -> None:
    """Kill the scheduler actor and the jobs' coordinators (all detached), so that the next
    policy starts on an empty cluster with a scheduler of its own."""
    for job_id in job_ids:
        handle = find_coordinator(job_id)
        if handle is not None:
            ray.kill(handle, no_restart=True)
    sched = find_scheduler()
    if sched is not None:
        ray.kill(sched, no_restart=True)
    deadline = time.monotonic() + 30
    while find_scheduler() is not None and time.monotonic() < deadline:
        time.sleep(0.2)


def run_policy(
    address: str,
    policy: str,
    workdir: Path,
    *,
    epochs: int,
    round_s: float,
    hold_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    release([])
    svc = Service(address, policy, workdir, round_s, hold_s)
    ids: list[str] = []
    try:
        ids = [svc.submit(job_spec(i, epochs)) for i in range(3)]
        log(f"{policy}: submitted {ids}")
        deadline = time.monotonic() + timeout_s
        while True:
            jobs = [svc.job(j) for j in ids]
            if len(ids) == 3 and jobs[0].get("epochs_completed", 0) >= 1:
                ids.append(svc.submit(job_spec(3, epochs)))
                log(f"{policy}: first job finished an epoch; submitted {ids[-1]}")
            if len(ids) == 4 and all(j["state"] in TERMINAL for j in jobs):
                break
            if time.monotonic() > deadline:
                for j in ids:
                    svc.cancel(j, "bench timed out")
                raise TimeoutError(f"{policy}: jobs not done in {timeout_s:.0f}s")
            time.sleep(0.5)
        out_jobs, jct = [], []
        for j in jobs:
            hist = svc.history(j["job_id"])
            out_jobs.append(
                {
                    "job_id": j["job_id"],
                    "state": j["state"],
                    "reason": j.get("reason"),
                    "verified": bool(hist)
                    and len(hist) == epochs
                    and all(r["verified"] for r in hist),
                    "resizes": resizes(j["job_id"], int(j.get("resumes", 0))),
                    "restarts": int(j.get("resumes", 0)),
                    "jct_s": round(j["finished_at"] - j["created_at"], 2),
                    "worker_events": j.get("worker_events") or {},
                }
            )
            jct.append(j["finished_at"] - j["created_at"])
            log(f"{policy}: {out_jobs[-1]}")
        makespan = max(j["finished_at"] for j in jobs) - min(j["created_at"] for j in jobs)
        return {
            "avg_jct_s": round(sum(jct) / len(jct), 2),
            "makespan_s": round(makespan, 2),
            "jobs": out_jobs,
        }
    finally:
        svc.stop()
        release(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="Fewer epochs (both policies in ~5 min).")
    ap.add_argument("--epochs", type=int, help="Epochs per job (default 6, --quick 3).")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--round-s", type=float, default=3.0, help="DYNABATCH_CLUSTER_ROUND_S.")
    ap.add_argument("--hold-s", type=float, default=6.0, help="DYNABATCH_CLUSTER_HOLD_S.")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="Per policy.")
    ap.add_argument("--out", help="Also write the JSON here.")
    args = ap.parse_args()
    epochs = args.epochs or (3 if args.quick else 6)

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": 150 * 2**20,
            "include_dashboard": False,
        },
    )
    nodes = [
        cluster.add_node(
            num_cpus=1,
            resources={TAG: 1, f"node-type:{kind}": 1},
            object_store_memory=100 * 2**20,
            env_vars={NODE_SLOWDOWN_ENV: str(factor)},
        )
        for kind, factor in NODES
    ]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR")
    result: dict[str, Any] = {
        "nodes": [{"type": k, "emulated_slowdown": f} for k, f in NODES],
        "epochs": epochs,
        "round_s": args.round_s,
        "hold_s": args.hold_s,
        "policies": {},
    }
    try:
        with tempfile.TemporaryDirectory(prefix="cluster_real-") as tmp:
            for policy in args.policies.split(","):
                result["policies"][policy] = run_policy(
                    cluster.address,
                    policy,
                    Path(tmp),
                    epochs=epochs,
                    round_s=args.round_s,
                    hold_s=args.hold_s,
                    timeout_s=args.timeout_s,
                )
    finally:
        ray.shutdown()
        for n in nodes:
            cluster.remove_node(n)
        cluster.shutdown()
    emit(result, args.out, indent=2)


if __name__ == "__main__":
    main()

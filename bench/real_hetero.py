"""Static vs DBS vs affine on nodes made unequal for real: Docker CPU quotas, not emulation.

Runs against the docker-compose stack (``make images``, then ``make deploy-test`` runs this
too), whose worker containers differ only in their CFS CPU quota (``worker-fast``: 1.0 CPU,
``worker-slow``: 0.33 CPU). Every job is submitted over REST with ``workers: auto`` and
``node_resource: dynabatch_worker``, so it runs one worker on each worker node; no
``emulation`` block, so the jobs report ``emulated: false``.

Policies run side by side: each round runs every policy once, in turn, and the report gives
the median over ``--repeats`` rounds. Every figure comes from what the jobs reported: the
steady epoch time is the mean ``wall_s`` of the history's epochs after the first two (the
policies start from an equal split and learn the speeds in the first epoch), and the
workers' shares are their ``partition`` in those epochs. The CPU quotas are read from the
containers (``docker inspect``) when the Docker CLI is at hand.

    python bench/real_hetero.py --api http://127.0.0.1:8000 --repeats 3 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
POLICIES = ("static", "dbs", "affine")
KIND_RESOURCES = {"dynabatch_fast": "fast", "dynabatch_slow": "slow"}


# One worker per worker node: the nodes offer 2 Ray CPUs (two slots, so that two jobs can
# share a node) on their CFS quota; 1.5 takes a node's both slots in the cluster scheduler
# (ceil) and in Ray, and leaves the worker one torch thread (int), as many as a 1.0 quota runs.
WHOLE_NODE_CPUS = 1.5
# The bench's epochs (--samples, --batch, --test-fraction): 8 steps of a 2048-sample global
# batch, 1/9 of the set held out. A step costs the slowest worker about a second of compute at
# an equal split, so what a step costs whatever the split (Ray's dispatch and results, the
# all-reduce) and the epoch's evaluation are a small part of an epoch (the split in the JSON
# says how small). The other deploy tests' epochs, 4 steps of 512, spent about half of a
# balanced epoch there.
BENCH_SAMPLES = 18_432
BENCH_BATCH = 2048
BENCH_TEST_FRACTION = 1 / 9
BENCH_EPOCHS = 6


def job_spec(
    policy: str,
    epochs: int,
    seed: int = 0,
    *,
    samples: int = 2560,
    batch: int = 512,
    test_fraction: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A job on every worker node, one worker each: a seeded synthetic classification set
    (offline), a wide MLP so that a step is mostly per-sample compute, a fixed global batch.
    A step takes a few tenths of a second or more, several CFS periods (100 ms): shorter
    steps fit in one period's quota and hide part of it (on digits, ~30 ms steps, a 0.33
    quota looked only 1.6x slower than a 1.0 one). The defaults (4 steps of 512) are the
    short epochs the other deploy tests use; :func:`bench` trains ``BENCH_*`` epochs."""
    dataset: dict[str, Any] = {
        "name": "synthetic",
        "options": {"n_samples": samples, "n_features": 256, "n_classes": 10},
    }
    if test_fraction is not None:
        dataset["test_fraction"] = test_fraction
    spec: dict[str, Any] = {
        "name": f"real-{policy}",
        "dataset": dataset,
        "model": {"name": "mlp", "hidden": 2048},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "workers": "auto",
        "worker_cpus": WHOLE_NODE_CPUS,
        "node_resource": "dynabatch_worker",
        "global_batch": batch,
        "epochs": epochs,
        "policy": policy,
        "rebalance": {"mode": "epoch"},
        "seed": seed,
    }
    spec.update(extra)
    return spec


class Api:
    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def submit(self, spec: dict[str, Any]) -> str:
        r = self.http.post("/v1/jobs", json=spec)
        if r.status_code != 201:
            raise RuntimeError(f"submit {spec['name']}: {r.status_code} {r.text}")
        return str(r.json()["job_id"])

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.http.get(f"/v1/jobs/{job_id}")
        r.raise_for_status()
        return dict(r.json())

    def history(self, job_id: str) -> list[dict[str, Any]]:
        r = self.http.get(f"/v1/jobs/{job_id}/history")
        r.raise_for_status()
        return list(r.json()["records"])

    def nodes(self) -> list[dict[str, Any]]:
        r = self.http.get("/v1/nodes")
        r.raise_for_status()
        return list(r.json()["nodes"])

    def cancel(self, job_id: str, reason: str = "bench done") -> None:
        self.http.post(f"/v1/jobs/{job_id}/cancel", json={"reason": reason})

    def wait(self, job_id: str, timeout: float, poll: float = 0.5) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["state"] in TERMINAL:
                return job
            if time.monotonic() > deadline:
                self.cancel(job_id, "timed out")
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout:.0f}s")
            time.sleep(poll)


def node_kinds(api: Api) -> dict[str, str]:
    """Every identifier of each live worker node (id, address, hostname) -> its kind."""
    out = {}
    for n in api.nodes():
        if not n.get("alive", True):
            continue
        kind = next((k for r, k in KIND_RESOURCES.items() if n["resources"].get(r)), None)
        if kind is None:
            continue
        for key in (n["node_id"], n["address"], n.get("hostname", "")):
            if key:
                out[key] = kind
    return out


def container_quotas() -> dict[str, float]:
    """CPU quota of each running worker container, by hostname (Ray's node hostname)."""
    docker = os.environ.get("DOCKER") or (
        "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
    )
    try:
        ids = subprocess.run(
            [docker, "ps", "-q", "--filter", "label=com.docker.compose.project"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        if not ids:
            return {}
        raw = subprocess.run(
            [docker, "inspect", *ids], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out = {}
    for c in json.loads(raw):
        hc = c["HostConfig"]
        quota = hc.get("NanoCpus") or 0
        if not quota and hc.get("CpuQuota"):
            quota = hc["CpuQuota"] / (hc.get("CpuPeriod") or 100_000) * 1e9
        if quota:
            out[c["Config"]["Hostname"]] = round(quota / 1e9, 3)
    return out


def epoch_split(rec: dict[str, Any]) -> dict[str, float]:
    """Where one epoch's time went, from its record (seconds). ``wall_s`` (the training
    steps) is split exactly into:

    * ``compute_balanced_s``: the compute the epoch needed at a perfect split (its samples
      over the workers' summed throughputs), the floor no policy gets under;
    * ``imbalance_s``: the slowest worker's compute beyond that (the split's error, and at an
      equal split the whole cost of the unequal nodes);
    * ``allreduce_s``: the gradient all-reduce as the last worker to arrive saw it (the
      least wait of any worker: it waits for no peer, only for the transfer);
    * ``ray_s``: the rest: dispatching each step to the workers and collecting their
      results over Ray, the ledger and planning.

    ``evaluation_s`` (the held-out evaluation after the steps) comes on top of ``wall_s``.
    The per-epoch sums stand for the per-step critical path: the same worker is the slowest
    at each step of an epoch, as its split is fixed within it."""
    workers = rec["workers"]
    compute = [w["compute_s"] for w in workers]
    speed = sum(w["throughput"] for w in workers)
    samples = sum(w["partition"] for w in workers)
    balanced = samples / speed if speed > 0 else max(compute)
    allreduce = min(w["wait_s"] for w in workers)
    return {
        "wall_s": rec["wall_s"],
        "compute_balanced_s": balanced,
        "imbalance_s": max(compute) - balanced,
        "allreduce_s": allreduce,
        "ray_s": rec["wall_s"] - max(compute) - allreduce,
        "evaluation_s": rec.get("evaluation_s", 0.0),
    }


def median_split(records: list[dict[str, Any]]) -> dict[str, float]:
    """The median of each part of :func:`epoch_split` over ``records``, rounded."""
    splits = [epoch_split(r) for r in records]
    return {k: round(statistics.median(x[k] for x in splits), 3) for k in splits[0]}


def summarize(
    job: dict[str, Any], history: list[dict[str, Any]], kinds: dict[str, str]
) -> dict[str, Any]:
    """What one finished job reported: its steady epoch time, each kind's share, and where
    the steady epochs' time went (:func:`epoch_split`)."""
    steady = history[2:] or history
    share: dict[str, float] = {}
    tput: dict[str, list[float]] = {}
    for rec in steady:
        total = sum(w["partition"] for w in rec["workers"]) or 1
        for w in rec["workers"]:
            kind = kinds.get(w["node"], "unknown")
            share[kind] = share.get(kind, 0.0) + w["partition"] / total / len(steady)
            tput.setdefault(kind, []).append(w["throughput"])
    return {
        "job_id": job["job_id"],
        "state": job["state"],
        "emulated": bool(job.get("emulated")) or any(r.get("emulated") for r in history),
        "epochs": len(history),
        "verified": bool(history) and all(r["verified"] for r in history),
        "epoch_s": [round(r["wall_s"], 3) for r in history],
        "steady_epoch_s": round(statistics.mean(r["wall_s"] for r in steady), 3),
        "workers": len(steady[-1]["workers"]) if steady else 0,
        "share": {k: round(v, 3) for k, v in sorted(share.items())},
        "throughput": {k: round(statistics.median(v), 1) for k, v in sorted(tput.items())},
        "split": median_split(steady) if steady else {},
        "final_accuracy": history[-1].get("test_accuracy") if history else None,
        "rebalances": job.get("rebalances_total", 0),
    }


def run_job(api: Api, spec: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    kinds = node_kinds(api)
    job_id = api.submit(spec)
    job = api.wait(job_id, timeout)
    if job["state"] != "SUCCEEDED":
        raise RuntimeError(f"{spec['name']} ({job_id}): {job['state']}: {job.get('reason')}")
    return summarize(job, api.history(job_id), kinds | node_kinds(api))


def bench(
    api: Api,
    *,
    policies: tuple[str, ...] = POLICIES,
    repeats: int = 3,
    epochs: int = BENCH_EPOCHS,
    samples: int = BENCH_SAMPLES,
    batch: int = BENCH_BATCH,
    test_fraction: float = BENCH_TEST_FRACTION,
    label: str = "",
    log: Any = sys.stderr,
) -> dict[str, Any]:
    """Every policy once per round, ``repeats`` rounds; medians.

    ``split``: per policy, the median of each part of its steady epochs' time
    (:func:`epoch_split`). ``ceiling_vs_static``: what a perfect split would gain over
    static's at the speeds the static runs measured (their slowest worker's compute over
    the balanced compute): 2.0 at 1.0 : 0.33 quotas only when the fast container gets its
    whole CPU, less on a busy host (``host_load_1m``, before and after)."""
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for r in range(repeats):
        for p in policies:
            spec = job_spec(
                p, epochs, seed=r, samples=samples, batch=batch, test_fraction=test_fraction
            )
            res = run_job(api, spec)
            runs[p].append(res)
            print(
                f"[real_hetero{label} round {r}] {p}: {res['steady_epoch_s']:.2f}s/epoch "
                f"shares {res['share']} split {res['split']}",
                file=log,
                flush=True,
            )
    quotas = container_quotas()
    kinds = node_kinds(api)
    out: dict[str, Any] = {
        "emulated": any(x["emulated"] for rs in runs.values() for x in rs),
        "verified": all(x["verified"] for rs in runs.values() for x in rs),
        "repeats": repeats,
        "epochs": epochs,
        "steps_per_epoch": round(samples * (1 - test_fraction)) // batch,
        "global_batch": batch,
        "host_load_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "nodes": sorted(
            (
                {"hostname": h, "kind": kinds.get(h, "?"), "cpus": q}
                for h, q in quotas.items()
                if h in kinds
            ),
            key=lambda n: (n["kind"], n["hostname"]),
        ),
        "policies": {},
    }
    for p, rs in runs.items():
        out["policies"][p] = {
            "steady_epoch_s": round(statistics.median(x["steady_epoch_s"] for x in rs), 3),
            "share": {
                k: round(statistics.median(x["share"].get(k, 0.0) for x in rs), 3)
                for k in sorted({k for x in rs for k in x["share"]})
            },
            "throughput": {
                k: round(statistics.median(x["throughput"].get(k, 0.0) for x in rs), 1)
                for k in sorted({k for x in rs for k in x["throughput"]})
            },
            "split": {
                k: round(statistics.median(x["split"][k] for x in rs), 3) for k in rs[0]["split"]
            },
            "runs": rs,
        }
        out[f"{p}_epoch_s"] = out["policies"][p]["steady_epoch_s"]
    if "static" in runs:
        st = out["policies"]["static"]["split"]
        out["ceiling_vs_static"] = round(
            (st["compute_balanced_s"] + st["imbalance_s"]) / st["compute_balanced_s"], 3
        )
        for p in policies:
            if p != "static":
                out[f"{p}_speedup_vs_static"] = round(
                    out["static_epoch_s"] / out[f"{p}_epoch_s"], 3
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--api", default="http://127.0.0.1:8000", help="The stack's API.")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=BENCH_EPOCHS)
    ap.add_argument(
        "--samples",
        type=int,
        default=BENCH_SAMPLES,
        help="Samples in the synthetic set, the held-out part included.",
    )
    ap.add_argument("--batch", type=int, default=BENCH_BATCH, help="The global batch.")
    ap.add_argument("--test-fraction", type=float, default=BENCH_TEST_FRACTION)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", help="Also write the JSON here.")
    args = ap.parse_args()
    api = Api(args.api, os.environ.get("DYNABATCH_API_TOKEN"))
    result = bench(
        api,
        policies=tuple(args.policies.split(",")),
        repeats=args.repeats,
        epochs=args.epochs,
        samples=args.samples,
        batch=args.batch,
        test_fraction=args.test_fraction,
    )
    emit(result, args.out, indent=2)


if __name__ == "__main__":
    main()

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


def job_spec(policy: str, epochs: int, seed: int = 0, **extra: Any) -> dict[str, Any]:
    """A small job on every worker node: a seeded synthetic classification set (offline), a
    wide MLP so that a step is mostly per-sample compute, a fixed global batch. A step takes
    a few tenths of a second, several CFS periods (100 ms): shorter steps fit in one period's
    quota and hide part of it (on digits, ~30 ms steps, a 0.33 quota looked only 1.6x slower
    than a 1.0 one)."""
    spec: dict[str, Any] = {
        "name": f"real-{policy}",
        "dataset": {
            "name": "synthetic",
            "options": {"n_samples": 2560, "n_features": 256, "n_classes": 10},
        },
        "model": {"name": "mlp", "hidden": 2048},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "workers": "auto",
        "node_resource": "dynabatch_worker",
        "global_batch": 512,
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
    docker = os.environ.get("DOCKER") or ("/usr/bin/docker" if Path("/usr/bin/docker").exists()
                                          else "docker")
    try:
        ids = subprocess.run([docker, "ps", "-q", "--filter", "label=com.docker.compose.project"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
        if not ids:
            return {}
        raw = subprocess.run([docker, "inspect", *ids], capture_output=True, text=True,
                             timeout=30, check=True).stdout
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


def summarize(job: dict[str, Any], history: list[dict[str, Any]],
              kinds: dict[str, str]) -> dict[str, Any]:
    """What one finished job reported: its steady epoch time and each kind's share."""
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


def bench(api: Api, *, policies: tuple[str, ...] = POLICIES, repeats: int = 3,
          epochs: int = 4, label: str = "", log: Any = sys.stderr) -> dict[str, Any]:
    """Every policy once per round, ``repeats`` rounds; medians."""
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for r in range(repeats):
        for p in policies:
            res = run_job(api, job_spec(p, epochs, seed=r))
            runs[p].append(res)
            print(f"[real_hetero{label} round {r}] {p}: {res['steady_epoch_s']:.2f}s/epoch "
                  f"shares {res['share']}", file=log, flush=True)
    quotas = container_quotas()
    kinds = node_kinds(api)
    out: dict[str, Any] = {
        "emulated": any(x["emulated"] for rs in runs.values() for x in rs),
        "verified": all(x["verified"] for rs in runs.values() for x in rs),
        "repeats": repeats,
        "epochs": epochs,
        "nodes": sorted(
            ({"hostname": h, "kind": kinds.get(h, "?"), "cpus": q} for h, q in quotas.items()
             if h in kinds),
            key=lambda n: (n["kind"], n["hostname"]),
        ),
        "policies": {},
    }
    for p, rs in runs.items():
        out["policies"][p] = {
            "steady_epoch_s": round(statistics.median(x["steady_epoch_s"] for x in rs), 3),
            "share": {k: round(statistics.median(x["share"].get(k, 0.0) for x in rs), 3)
                      for k in sorted({k for x in rs for k in x["share"]})},
            "runs": rs,
        }
        out[f"{p}_epoch_s"] = out["policies"][p]["steady_epoch_s"]
    if "static" in runs:
        for p in policies:
            if p != "static":
                out[f"{p}_speedup_vs_static"] = round(
                    out["static_epoch_s"] / out[f"{p}_epoch_s"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--api", default="http://127.0.0.1:8000", help="The stack's API.")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", help="Also write the JSON here.")
    args = ap.parse_args()
    api = Api(args.api, os.environ.get("DYNABATCH_API_TOKEN"))
    result = bench(api, policies=tuple(args.policies.split(",")), repeats=args.repeats,
                   epochs=args.epochs)
    emit(result, args.out, indent=2)


if __name__ == "__main__":
    main()

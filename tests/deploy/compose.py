"""The docker-compose stack from the host (tests/deploy): compose and docker commands, the
stack's API, and reading what its jobs reported."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.procs import find_free_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import real_hetero  # noqa: E402

PROJECT = os.environ.get("DYNABATCH_DEPLOY_PROJECT", "dynabatch")
# The scheduler's hold between a job's resizes and its rounds (a node that joins is seen at
# the next one): short, so that a resize fits in a test's job.
HOLD_S = os.environ.get("DYNABATCH_CLUSTER_HOLD_S", "15")
ROUND_S = os.environ.get("DYNABATCH_CLUSTER_ROUND_S", "5")
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def docker_bin() -> str:
    return os.environ.get("DOCKER") or (
        "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
    )


def compose_argv() -> list[str]:
    if os.environ.get("COMPOSE"):
        argv = shlex.split(os.environ["COMPOSE"])
    elif subprocess.run([docker_bin(), "compose", "version"], capture_output=True).returncode == 0:
        argv = [docker_bin(), "compose"]
    else:
        argv = ["docker-compose"]
    argv += ["-p", PROJECT, "-f", str(ROOT / "docker-compose.yml")]
    if argv[0].endswith("docker-compose"):
        argv.append("--compatibility")  # v1: apply deploy.resources (the quotas) and replicas
    return argv


class Stack:
    def __init__(self) -> None:
        self.env = {
            **os.environ,
            "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(12),
            "DYNABATCH_API_PORT": str(find_free_port()),
            "DYNABATCH_PROMETHEUS_PORT": str(find_free_port()),
            "DYNABATCH_RAY_DASHBOARD_PORT": str(find_free_port()),
            "DYNABATCH_GRAFANA_PORT": str(find_free_port()),
            "DYNABATCH_BIND_ADDRESS": "127.0.0.1",
            "DYNABATCH_CLUSTER_HOLD_S": HOLD_S,
            "DYNABATCH_CLUSTER_ROUND_S": ROUND_S,
        }
        self.env.pop("DYNABATCH_API_TOKEN", None)
        self.api_url = f"http://127.0.0.1:{self.env['DYNABATCH_API_PORT']}"
        self.prom_url = f"http://127.0.0.1:{self.env['DYNABATCH_PROMETHEUS_PORT']}"
        self.api = real_hetero.Api(self.api_url)
        self.down_done = False

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        r = subprocess.run(
            [*compose_argv(), *args],
            cwd=ROOT,
            env=self.env,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
        if check and r.returncode:
            raise AssertionError(f"compose {' '.join(args)}: {r.returncode}\n{r.stdout}{r.stderr}")
        return r.stdout + r.stderr

    def docker(self, *args: str, timeout: float = 120) -> str:
        r = subprocess.run([docker_bin(), *args], text=True, capture_output=True, timeout=timeout)
        assert r.returncode == 0, f"docker {' '.join(args)}: {r.stderr}"
        return r.stdout

    def containers(self, service: str | None = None, all_: bool = False) -> list[str]:
        f = ["--filter", f"label=com.docker.compose.project={PROJECT}"]
        if service:
            f += ["--filter", f"label=com.docker.compose.service={service}"]
        return self.docker("ps", "-q", "--no-trunc", *(["-a"] if all_ else []), *f).split()

    def inspect(self, cid: str) -> dict[str, Any]:
        return dict(json.loads(self.docker("inspect", cid))[0])

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={PROJECT}"
        return {
            "containers": self.docker("ps", "-aq", "--filter", label).split(),
            "networks": self.docker("network", "ls", "-q", "--filter", label).split(),
            "volumes": self.docker("volume", "ls", "-q", "--filter", label).split(),
        }

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", check=False, timeout=120)

    def worker_nodes(self) -> list[dict[str, Any]]:
        return [
            n for n in self.api.nodes() if n.get("alive") and n["resources"].get("dynabatch_worker")
        ]


def started_at(info: dict[str, Any]) -> float:
    """Docker's RFC 3339 start time (nanoseconds) as a Unix time."""
    s = info["State"]["StartedAt"].rstrip("Z")
    head, _, frac = s.partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + float("0." + (frac or "0"))


def api_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def poll_job(api: real_hetero.Api, job_id: str) -> dict[str, Any]:
    """The job's status, failing the test if it ended (waits below are for mid-run events)."""
    job = api.job(job_id)
    if job["state"] in TERMINAL:
        pytest.fail(f"job {job_id} ended before the event: {job['state']}: {job.get('reason')}")
    return job


def finish(
    api: real_hetero.Api, job_id: str, timeout: float = 900
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    job = api.wait(job_id, timeout)
    history = api.history(job_id)
    assert job["state"] == "SUCCEEDED", f"{job_id}: {job['state']}: {job.get('reason')}"
    assert len(history) == job["epochs"], (len(history), job["epochs"])
    unverified = [r["epoch"] for r in history if not r["verified"]]
    assert not unverified, f"epochs not verified by the ledger: {unverified}"
    assert not any(r.get("emulated") for r in history) and not job.get("emulated")
    return job, history


def quotas_by_kind(stack: Stack) -> dict[str, list[float]]:
    kinds = real_hetero.node_kinds(stack.api)
    out: dict[str, list[float]] = {}
    for host, cpus in real_hetero.container_quotas().items():
        if host in kinds:
            out.setdefault(kinds[host], []).append(cpus)
    return out


def hetero_figures(out: dict[str, Any], quotas: str) -> dict[str, Any]:
    """The JSON's figures of a real_hetero.bench run: per policy the steady epoch, the
    shares, the speeds and where the epoch's time went (``split``), and each run's epoch."""
    keep = (
        "repeats",
        "epochs",
        "steps_per_epoch",
        "global_batch",
        "host_load_1m",
        "ceiling_vs_static",
        "nodes",
    )
    return {
        "quotas": quotas,
        **{k: out[k] for k in keep if k in out},
        **{k: v for k, v in out.items() if k.endswith("_epoch_s") or k.endswith("_vs_static")},
        **{
            part: {p: v[part] for p, v in out["policies"].items()}
            for part in ("share", "throughput", "split")
        },
        "runs": {p: [r["steady_epoch_s"] for r in v["runs"]] for p, v in out["policies"].items()},
    }


def per_worker_ratios(
    history: list[dict[str, Any]], kinds: dict[str, str]
) -> list[tuple[float, float]]:
    """(share ratio, speed ratio) of a fast worker to a slow one, per epoch of the history
    that trained on both kinds: each kind's mean per-worker partition and throughput."""
    out = []
    for rec in history:
        by: dict[str, list[dict[str, Any]]] = {}
        for w in rec["workers"]:
            if w["steps"] > 0:
                by.setdefault(kinds.get(w["node"], "?"), []).append(w)
        if not {"fast", "slow"} <= set(by):
            continue

        def mean(kind: str, key: str, by: dict[str, list[dict[str, Any]]] = by) -> float:
            return statistics.mean(w[key] for w in by[kind])

        out.append(
            (
                mean("fast", "partition") / mean("slow", "partition"),
                mean("fast", "throughput") / mean("slow", "throughput"),
            )
        )
    return out

"""Load on the REST API while a job trains: ``--clients`` concurrent clients (50) for
``--duration`` seconds (60), each cycling through a job's status (``GET /v1/jobs/{id}``),
``GET /metrics``, the job list (``GET /v1/jobs``) and the job's history
(``GET /v1/jobs/{id}/history``), against ``dynabatch serve`` (embedded Ray, on 127.0.0.1
only) training the demo (``examples/digits-hetero.yaml``, its epochs raised so it trains
through the window).

Prints one JSON object (bench/report.py): ``p50_ms``, ``p99_ms``, ``requests``, ``errors``,
requests per second, the same per endpoint, and the job's state and epochs during the load.
Target: p99 < 100 ms at 50 clients. The load is bounded: at most 200 clients, 300 seconds,
loopback only.

    .venv/bin/python bench/api_load.py --out bench/results-api-load.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import emit  # noqa: E402

HOST = "127.0.0.1"  # loopback only
MAX_CLIENTS = 200
MAX_DURATION_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def start_service(workdir: Path, port: int, sync_interval_s: float) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "DYNABATCH_API_TOKEN", "DYNABATCH_RAY_ADDRESS"):
        env.pop(key, None)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["DYNABATCH_SYNC_INTERVAL_S"] = str(sync_interval_s)
    env["DYNABATCH_LOG_LEVEL"] = "warning"  # no access log: it would be the load's cost
    exe = Path(sys.executable).parent / "dynabatch"
    log = (workdir / "serve.log").open("wb")
    return subprocess.Popen(
        [str(exe), "serve", "--host", HOST, "--port", str(port), "--db",
         str(workdir / "jobs.db")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=workdir,
    )


def stop_service(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def wait_until(what: str, check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"error: timed out after {timeout_s:.0f} s waiting for {what}")


def endpoints(job_id: str) -> list[tuple[str, str]]:
    return [
        ("status", f"/v1/jobs/{job_id}"),
        ("metrics", "/metrics"),
        ("list", "/v1/jobs"),
        ("history", f"/v1/jobs/{job_id}/history"),
    ]


async def load(base: str, job_id: str, clients: int, duration_s: float
               ) -> dict[str, list[tuple[float, bool]]]:
    """Each client: one request at a time, cycling through the endpoints; (latency s, ok)
    per request by endpoint."""
    targets = endpoints(job_id)
    results: dict[str, list[tuple[float, bool]]] = {name: [] for name, _ in targets}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30.0) as http:
        stop_at = time.monotonic() + duration_s

        async def client(i: int) -> None:
            k = i
            while time.monotonic() < stop_at:
                name, path = targets[k % len(targets)]
                k += 1
                t0 = time.perf_counter()
                try:
                    r = await http.get(path)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                results[name].append((time.perf_counter() - t0, ok))

        await asyncio.gather(*(client(i) for i in range(clients)))
    return results


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(samples: list[tuple[float, bool]], duration_s: float) -> dict[str, Any]:
    ms = [s * 1e3 for s, _ in samples]
    return {
        "requests": len(samples),
        "errors": sum(1 for _, ok in samples if not ok),
        "p50_ms": round(percentile(ms, 0.50), 2),
        "p99_ms": round(percentile(ms, 0.99), 2),
        "mean_ms": round(statistics.fmean(ms), 2) if ms else None,
        "rps": round(len(samples) / duration_s, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--config", default=str(ROOT / "examples" / "digits-hetero.yaml"))
    ap.add_argument("--sync-interval", type=float, default=1.0,
                    help="the service's DYNABATCH_SYNC_INTERVAL_S")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS:
        raise SystemExit(f"error: --clients: 1 to {MAX_CLIENTS}")
    if not 1.0 <= args.duration <= MAX_DURATION_S:
        raise SystemExit(f"error: --duration: 1 to {MAX_DURATION_S:.0f} seconds")
    spec = yaml.safe_load(Path(args.config).read_text())
    spec["epochs"] = 10_000  # trains through the whole window; cancelled at the end

    with tempfile.TemporaryDirectory(prefix="dynabatch-api-load-") as tmp:
        port = free_port()
        base = f"http://{HOST}:{port}"
        proc = start_service(Path(tmp), port, args.sync_interval)
        try:
            wait_until("the API", lambda: httpx.get(f"{base}/readyz", timeout=2)
                       .status_code == 200, 180)
            r = httpx.post(f"{base}/v1/jobs", json=spec, timeout=60)
            if r.status_code != 201:
                raise SystemExit(f"error: submit: {r.status_code} {r.text}")
            job_id = r.json()["job_id"]
            # Loaded while it trains, with a history to read.
            wait_until("the job's first epoch", lambda: httpx.get(
                f"{base}/v1/jobs/{job_id}/history", timeout=5).json()["records"], 300)
            before = httpx.get(f"{base}/v1/jobs/{job_id}", timeout=5).json()
            load_before = os.getloadavg()[0]
            results = asyncio.run(load(base, job_id, args.clients, args.duration))
            after = httpx.get(f"{base}/v1/jobs/{job_id}", timeout=5).json()
            load_after = os.getloadavg()[0]
            httpx.post(f"{base}/v1/jobs/{job_id}/cancel", json={"reason": "benchmark done"},
                       timeout=30)
        finally:
            stop_service(proc)

    everything = [x for samples in results.values() for x in samples]
    total = summary(everything, args.duration)
    result = {
        "benchmark": "api_load",
        "clients": args.clients,
        "duration_s": args.duration,
        "sync_interval_s": args.sync_interval,
        **total,
        "target_p99_ms": 100.0,
        "met": total["p99_ms"] < 100.0 and total["errors"] == 0,
        "endpoints": {name: summary(s, args.duration) for name, s in results.items()},
        "job": {"state_during": [before["state"], after["state"]],
                "epoch_during": [before["epoch"], after["epoch"]],
                "name": spec.get("name")},
        "cpus": os.cpu_count(),
        # The machine's 1-minute load average around the window: on a shared machine, the
        # latencies measure its contention as much as the API.
        "load_average": [round(load_before, 1), round(load_after, 1)],
        "command": "python bench/api_load.py " + " ".join(sys.argv[1:]),
    }
    emit(result, args.out, indent=2)


if __name__ == "__main__":
    main()

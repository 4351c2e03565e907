"""Load on the REST API while a job trains: ``--clients`` concurrent clients (50) for
``--duration`` seconds (60), each cycling through a job's status (``GET /v1/jobs/{id}``),
``GET /metrics``, the job list (``GET /v1/jobs``) and the job's history
(``GET /v1/jobs/{id}/history``), against ``dynabatch serve`` (embedded Ray, on 127.0.0.1
only) training the demo (``examples/digits-hetero.yaml``, its epochs raised so it trains
through the window).

Each client has its own keep-alive connection and sends one request at a time (closed loop).
Two load generators send the same requests: ``raw`` (:class:`RawConnection`, a minimal
HTTP/1.1 client on asyncio streams: ~0.15 ms of CPU per request) and ``httpx``
(``httpx.AsyncClient``, the original generator: ~4-5 ms of CPU per request, measured with
bench/api_cpu.py). On a 2-core machine that runs the server and the training too, httpx's
own CPU caps the request rate, and so sets the latency of 50 closed-loop clients more than
the server does. The headline figures are ``--generator``'s (raw); ``--also`` (httpx) then
runs the same load, with the same service and job, reported under ``side_by_side``.

Prints one JSON object (bench/report.py): ``p50_ms``, ``p99_ms``, ``requests``, ``errors``,
requests per second, the same per endpoint, the cores each process group used during the
window (the API process, training workers, coordinator, Ray, load generator; see
bench/procs.py) and their niceness, and the job's state and epochs during the load.
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

from bench.procs import group_cpu, group_niceness  # noqa: E402
from bench.report import emit  # noqa: E402

HOST = "127.0.0.1"  # loopback only
MAX_CLIENTS = 200
MAX_DURATION_S = 300.0
TARGET_P99_MS = 100.0
GENERATORS = ("raw", "httpx")
PAUSE_S = 5.0  # between two windows


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


# The headers httpx sends by default, so that the server parses the same requests from
# either generator.
REQUEST_HEADERS = (
    "Accept: */*\r\nAccept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\n"
    f"User-Agent: python-httpx/{httpx.__version__}\r\n"
)


class RawConnection:
    """One keep-alive HTTP/1.1 connection that sends ``GET`` requests and reads whole
    responses (status line, headers, a ``Content-Length`` or chunked body): a real HTTP
    client at a fraction of httpx's CPU per request, so that on a small machine the load
    generator does not take the CPU the server under test needs. A connection that fails
    is closed and opened again for the next request."""

    def __init__(self, host: str, port: int, timeout_s: float = 30.0):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> tuple[int, bytes]:
        try:
            return await asyncio.wait_for(self._get(path), self.timeout_s)
        except BaseException:
            self.close()
            raise

    async def _get(self, path: str) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._reader, self._writer
        assert reader is not None
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                     f"{REQUEST_HEADERS}\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head[:-4].split(b"\r\n")
        version, status, _ = status_line.split(b" ", 2)
        if not version.startswith(b"HTTP/1."):
            raise ConnectionError(f"not an HTTP/1.x response: {status_line!r}")
        headers = {}
        for line in lines:
            key, _, value = line.partition(b":")
            headers[key.strip().lower()] = value.strip()
        if b"content-length" in headers:
            body = await reader.readexactly(int(headers[b"content-length"]))
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                parts.append(await reader.readexactly(size + 2))
                if size == 0:
                    break
            body = b"".join(p[:-2] for p in parts)
        else:
            raise ConnectionError("response without a length on a keep-alive connection")
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        return int(status), body

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


async def load(base: str, job_id: str, clients: int, duration_s: float,
               targets: list[tuple[str, str]] | None = None, generator: str = "httpx",
               ) -> dict[str, list[tuple[float, bool]]]:
    """Each client: one request at a time on its own connection, cycling through the
    endpoints; (latency s, ok) per request by endpoint. ``generator``: ``httpx`` (an
    ``httpx.AsyncClient`` with one pooled connection per client) or ``raw``
    (:class:`RawConnection`, one per client)."""
    targets = targets or endpoints(job_id)
    results: dict[str, list[tuple[float, bool]]] = {name: [] for name, _ in targets}
    stop_at = time.monotonic() + duration_s

    async def run(get: Any) -> None:
        async def client(i: int) -> None:
            k = i
            while time.monotonic() < stop_at:
                name, path = targets[k % len(targets)]
                k += 1
                t0 = time.perf_counter()
                try:
                    ok = await get(i, path) == 200
                except (httpx.HTTPError, OSError, TimeoutError, asyncio.IncompleteReadError,
                        asyncio.LimitOverrunError, ValueError):
                    ok = False
                results[name].append((time.perf_counter() - t0, ok))

        await asyncio.gather(*(client(i) for i in range(clients)))

    if generator == "raw":
        url = httpx.URL(base)
        conns = [RawConnection(url.host, url.port or 80) for _ in range(clients)]

        async def raw_get(i: int, path: str) -> int:
            return (await conns[i].get(path))[0]

        try:
            await run(raw_get)
        finally:
            for c in conns:
                c.close()
        return results
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30.0) as http:

        async def httpx_get(_: int, path: str) -> int:
            return (await http.get(path)).status_code

        await run(httpx_get)
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


def window(base: str, job_id: str, root: int, clients: int, duration_s: float,
           generator: str) -> dict[str, Any]:
    """One load window: latencies overall and per endpoint, the job's progress, and the
    cores each process group used meanwhile (bench/procs.py)."""
    before = httpx.get(f"{base}/v1/jobs/{job_id}", timeout=5).json()
    load_before = os.getloadavg()[0]
    cpu0, client0, t0 = group_cpu(root), time.process_time(), time.monotonic()
    results = asyncio.run(load(base, job_id, clients, duration_s, generator=generator))
    cpu1, client1, wall = group_cpu(root), time.process_time(), time.monotonic() - t0
    after = httpx.get(f"{base}/v1/jobs/{job_id}", timeout=5).json()
    load_after = os.getloadavg()[0]
    everything = [x for samples in results.values() for x in samples]
    total = summary(everything, duration_s)
    cores = {g: round((cpu1[g] - cpu0[g]) / wall, 2) for g in cpu0}
    cores["load_generator"] = round((client1 - client0) / wall, 2)
    n = max(1, total["requests"])
    return {
        "generator": generator,
        **total,
        "met": total["p99_ms"] < TARGET_P99_MS and total["errors"] == 0,
        "endpoints": {name: summary(s, duration_s) for name, s in results.items()},
        "cores": cores,
        "cpu_ms_per_request": {
            "api": round((cpu1["api"] - cpu0["api"]) / n * 1e3, 3),
            "load_generator": round((client1 - client0) / n * 1e3, 3),
        },
        "job": {"state_during": [before["state"], after["state"]],
                "epoch_during": [before["epoch"], after["epoch"]]},
        # The machine's 1-minute load average around the window: on a shared machine, the
        # latencies measure its contention as much as the API.
        "load_average": [round(load_before, 1), round(load_after, 1)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--config", default=str(ROOT / "examples" / "digits-hetero.yaml"))
    ap.add_argument("--sync-interval", type=float, default=1.0,
                    help="the service's DYNABATCH_SYNC_INTERVAL_S")
    ap.add_argument("--generator", choices=GENERATORS, default="raw",
                    help="the load generator of the headline figures")
    ap.add_argument("--also", choices=(*GENERATORS, "none"), default="httpx",
                    help="then run the same load with this generator too, side by side")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS:
        raise SystemExit(f"error: --clients: 1 to {MAX_CLIENTS}")
    if not 1.0 <= args.duration <= MAX_DURATION_S:
        raise SystemExit(f"error: --duration: 1 to {MAX_DURATION_S:.0f} seconds")
    spec = yaml.safe_load(Path(args.config).read_text())
    spec["epochs"] = 10_000  # trains through the whole window; cancelled at the end
    # The headline window first, on the machine as it was; then the other generator's.
    runs = list(dict.fromkeys(g for g in (args.generator, args.also) if g != "none"))

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
            niceness = group_niceness(proc.pid)
            windows = {}
            for i, generator in enumerate(runs):
                if i:
                    time.sleep(PAUSE_S)
                windows[generator] = window(base, job_id, proc.pid, args.clients,
                                            args.duration, generator)
            httpx.post(f"{base}/v1/jobs/{job_id}/cancel", json={"reason": "benchmark done"},
                       timeout=30)
        finally:
            stop_service(proc)

    headline = windows.pop(args.generator)
    result = {
        "benchmark": "api_load",
        "clients": args.clients,
        "duration_s": args.duration,
        "sync_interval_s": args.sync_interval,
        **{k: v for k, v in headline.items() if k not in ("job", "load_average")},
        "target_p99_ms": TARGET_P99_MS,
        "job": {**headline["job"], "name": spec.get("name")},
        "side_by_side": windows,  # the same load from the other generator, run next
        "niceness": niceness,
        "cpus": os.cpu_count(),
        "load_average": headline["load_average"],
        "command": "python bench/api_load.py " + " ".join(sys.argv[1:]),
    }
    emit(result, args.out, indent=2)


if __name__ == "__main__":
    main()

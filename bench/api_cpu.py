"""Where the REST API's time goes under load: CPU per request, by endpoint and by process.

Starts ``dynabatch serve`` with the demo training (as ``bench/api_load.py`` does), measures
each process group's idle CPU rate (the API process, the training workers, the
coordinator, Ray's own processes), then loads one endpoint at a time with ``--clients``
closed-loop clients for ``--seconds`` each and reports, per endpoint: requests per second,
the API process's CPU per request (its idle rate subtracted), the load generator's CPU per
request, and the cores each group used meanwhile. CPU is read from ``/proc`` (Linux), so the
figures are CPU time, not wall time: they hold on a busy machine too.

    .venv/bin/python bench/api_cpu.py --out bench/results-api-cpu.json

``--generator``: ``raw`` (the default) or ``httpx``, the two load generators of
``bench/api_load.py`` (see there).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.api_load import (  # noqa: E402
    HOST,
    endpoints,
    free_port,
    load,
    start_service,
    stop_service,
    wait_until,
)
from bench.procs import group_cpu, group_niceness  # noqa: E402
from bench.report import emit  # noqa: E402


def measure(root: int, work: Any) -> dict[str, Any]:
    """Run ``work()`` (returns a request count, or None for idle) and the CPU it cost."""
    g0, c0, t0 = group_cpu(root), time.process_time(), time.monotonic()
    n = work()
    g1, c1, wall = group_cpu(root), time.process_time(), time.monotonic() - t0
    return {"wall_s": wall, "requests": n, "client_cpu_s": c1 - c0,
            "groups": {k: g1[k] - g0[k] for k in g0}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=15.0, help="load per endpoint")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of idle baseline")
    ap.add_argument("--config", default=str(ROOT / "examples" / "digits-hetero.yaml"))
    ap.add_argument("--generator", choices=("raw", "httpx"), default="raw")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    spec = yaml.safe_load(Path(args.config).read_text())
    spec["epochs"] = 10_000

    with tempfile.TemporaryDirectory(prefix="dynabatch-api-cpu-") as tmp:
        port = free_port()
        base = f"http://{HOST}:{port}"
        proc = start_service(Path(tmp), port, 1.0)
        try:
            wait_until("the API", lambda: httpx.get(f"{base}/readyz", timeout=2)
                       .status_code == 200, 180)
            r = httpx.post(f"{base}/v1/jobs", json=spec, timeout=60)
            job_id = r.json()["job_id"]
            wait_until("the job's first epoch", lambda: httpx.get(
                f"{base}/v1/jobs/{job_id}/history", timeout=5).json()["records"], 300)
            niceness = group_niceness(proc.pid)
            idle = measure(proc.pid, lambda: time.sleep(args.idle))
            rates = {k: v / idle["wall_s"] for k, v in idle["groups"].items()}
            rows: dict[str, Any] = {}
            targets = endpoints(job_id)
            for name, path in [*targets, ("mixed", None)]:
                only = targets if path is None else [(name, path)]

                def work(only: list[tuple[str, str]] = only) -> int:
                    res = asyncio.run(load(base, job_id, args.clients, args.seconds,
                                           targets=only, generator=args.generator))
                    return sum(len(v) for v in res.values())

                m = measure(proc.pid, work)
                n = max(1, m["requests"])
                api_extra = m["groups"]["api"] - rates["api"] * m["wall_s"]
                rows[name] = {
                    "path": path or "all four, cycled",
                    "requests": m["requests"],
                    "rps": round(m["requests"] / m["wall_s"], 1),
                    "api_cpu_ms_per_request": round(api_extra / n * 1e3, 3),
                    "client_cpu_ms_per_request": round(m["client_cpu_s"] / n * 1e3, 3),
                    "cores": {k: round(v / m["wall_s"], 2) for k, v in m["groups"].items()}
                    | {"load_generator": round(m["client_cpu_s"] / m["wall_s"], 2)},
                }
            httpx.post(f"{base}/v1/jobs/{job_id}/cancel", json={"reason": "done"}, timeout=30)
        finally:
            stop_service(proc)
    emit({
        "benchmark": "api_cpu",
        "clients": args.clients,
        "seconds_per_endpoint": args.seconds,
        "generator": args.generator,
        "idle_cores": {k: round(v, 3) for k, v in rates.items()},
        "niceness": niceness,
        "endpoints": rows,
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 1),
        "command": "python bench/api_cpu.py " + " ".join(sys.argv[1:]),
    }, args.out, indent=2)


if __name__ == "__main__":
    main()

"""Process helpers for the end-to-end tier: free ports, polling, stopping what we started,
and the ``dynabatch serve`` subprocess."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")
BIN = Path(sys.executable).parent


def _ephemeral_start() -> int:
    """The lowest port the kernel hands out on its own (``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# A port a test hands to a server it starts comes from below the kernel's ephemeral range.
# One the kernel picks (a bind to port 0) is what every outgoing connection and every Ray
# process beside the test (the other pytest worker's cluster) may be given next, so it can
# be taken between the pick and the server's own bind: a Ray head's dashboard port was
# ("Failed to bind ... already occupied", three e2e tests errored). Each pytest-xdist worker
# draws from its own slice, and no port is handed out twice in a process.
_LOW, _HIGH = 20000, min(_ephemeral_start(), 32768)
_handed_out: set[int] = set()


def find_free_port() -> int:
    """A port free now on loopback that nothing else on this machine picks on its own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    candidates = [p for p in range(_LOW + index % count, _HIGH, count) if p not in _handed_out]
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # no such range here (an unusual ip_local_port_range)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    what: str, predicate: Callable[[], T | None], timeout: float, interval: float = 0.25
) -> T:
    """Poll until ``predicate`` returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _session_pids(sid: int) -> list[int]:
    """Processes alive in session ``sid`` (a session this module created with setsid). A
    zombie is not one: it has exited, and waits for its reaper (an orphan's is PID 1, which
    on this VM reaps every second or two, later under load)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):  # state, ppid, pgrp, session
            pids.append(int(entry.name))
    return pids


def describe(pids: list[int]) -> str:
    """Each process's pid, parent and command line (what a test says was left behind)."""
    lines = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        ppid = stat[stat.rindex(")") + 2 :].split()[1]
        lines.append(f"{pid} (parent {ppid}): {cmd[:120]}")
    return "\n".join(lines)


def stop_process(
    proc: subprocess.Popen[bytes], *, sig: int = signal.SIGTERM, grace: float = 10.0
) -> None:
    """Signal ``proc``, wait ``grace`` seconds, then SIGKILL what is left of its session."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    for pid in _session_pids(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["RAY_AUTH_MODE"] = "disabled"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    for key in ("RAY_ADDRESS", "DYNABATCH_API_TOKEN"):
        env.pop(key, None)
    return env


class ApiServer:
    """``dynabatch serve`` as a subprocess: start, kill (a crash) and start again."""

    def __init__(self, address: str, port: int, workdir: Path, **settings: Any):
        self.address = address
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.db = workdir / "jobs.db"
        self.workdir = workdir
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.workdir / f"api-{self.starts}.log"

    def logs(self) -> str:
        return "\n".join(
            (self.workdir / f"api-{i}.log").read_text(errors="replace")
            for i in range(1, self.starts + 1)
        )

    def start(self, timeout: float = 120.0) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        env = base_env()
        env["DYNABATCH_SYNC_INTERVAL_S"] = "0.25"
        env["DYNABATCH_LOG_LEVEL"] = "info"
        for key, value in self.settings.items():
            env[f"DYNABATCH_{key.upper()}"] = str(value)
        cmd = [
            str(BIN / "dynabatch"),
            "serve",
            "--address",
            self.address,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--db",
            str(self.db),
        ]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=self.workdir,
            )
        proc, log = self.proc, self.log

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"dynabatch serve exited:\n{tail(log)}")
            try:
                return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for("the API to be ready", ready, timeout=timeout, interval=0.3)

    def kill(self) -> None:
        """A crash: SIGKILL, no shutdown hooks."""
        if self.proc is not None:
            stop_process(self.proc, sig=signal.SIGKILL, grace=5.0)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, sig=signal.SIGTERM, grace=15.0)


def promql(url: str, query: str) -> list[dict[str, Any]]:
    """An instant query; returns the result vector."""
    r = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=5)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]

"""Real processes for the service's end-to-end tests, all on loopback.

* ``ray_head``: Ray as its own cluster, one for the session (``ray start --head --block``,
  2 CPUs, a temporary directory, its dashboard on loopback for Ray's log API), so detached
  coordinators outlive an API process. Torn down by stopping the processes this fixture
  started (its own session), never with ``ray stop``: that would
  also stop every other Ray cluster on a shared machine.
* ``api_server``: ``dynabatch serve --address ...`` as a subprocess that a test can kill and
  start again on the same port and database.
* ``prometheus``: the Debian ``prometheus`` binary with a temporary config and TSDB,
  scraping the API every second.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.procs import (
    BIN,
    ApiServer,
    base_env,
    find_free_port,
    stop_process,
    tail,
    wait_for,
)


@pytest.fixture
def free_port() -> int:
    return find_free_port()


@pytest.fixture(scope="session")
def ray_head() -> Iterator[str]:
    """``ray start --head`` on loopback with 2 CPUs; yields its GCS address.

    One for the session: the modules that use it (``test_service_e2e``, ``test_job_page_e2e``)
    each start their own API on it, and their jobs end (or are cancelled) in their test, so a
    second head would only cost its start."""
    port = find_free_port()
    # Short path: Ray's unix sockets live under it.
    temp = Path(tempfile.mkdtemp(prefix="dbx-ray-", dir="/tmp"))
    log = temp / "ray-start.log"
    cmd = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=2",
        # The dashboard serves Ray's log API: the job log gets the actors' output from it.
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={find_free_port()}",
        f"--dashboard-agent-listen-port={find_free_port()}",
        f"--temp-dir={temp}",
        "--object-store-memory=200000000",
        "--disable-usage-stats",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=base_env()
        )
    try:

        def started() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"ray start exited:\n{tail(log)}")
            return "block forever" in log.read_text(errors="replace")

        # A liveness bound: on a loaded host (several Rays starting at once) it took over 90 s.
        wait_for("the Ray head to start", started, timeout=180)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(proc, grace=5.0)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def api_server(ray_head: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    server = ApiServer(ray_head, find_free_port(), tmp_path_factory.mktemp("api"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prometheus(api_server: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus on loopback scraping the API every second; yields its URL."""
    exe = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None
    )
    if exe is None:
        pytest.fail("prometheus is not installed: run `make prometheus` (Debian package)")
    work = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "dynabatch-api",
                # As deploy/prometheus/prometheus.yml: no honor_labels (the series' job
                # label is job_id, which collides with nothing).
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [f"127.0.0.1:{api_server.port}"]}],
            }
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = find_free_port()
    log = work / "prometheus.log"
    cmd = [
        exe,
        f"--config.file={work / 'prometheus.yml'}",
        f"--storage.tsdb.path={work / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1h",
        "--log.level=warn",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=work
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{tail(log)}")
            try:
                return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for("Prometheus to be ready", ready, timeout=60)
        yield url
    finally:
        stop_process(proc, grace=10.0)

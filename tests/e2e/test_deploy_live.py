"""The Grafana dashboards against the real thing: every query returns data.

A real `dynabatch serve` (uvicorn, embedded Ray) runs a real job; a real Prometheus, started
on loopback with the scrape job of deploy/prometheus/prometheus.yml (its honor_labels and
all, pointed at this API, scraping every second), scrapes it; a parameter-server job runs beside
it for the parameter-server panels. Then every PromQL expression of
every dashboard panel, and every template variable's query, is sent to Prometheus with
Grafana's variables substituted, and must return data. No panel may query a metric that the
service does not export: the metric names in the dashboards are also checked against the
API's live /metrics.
"""

from __future__ import annotations

import copy
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.procs import find_free_port, stop_process, tail, wait_for
from tests.unit.test_deploy_static import (
    PROMETHEUS,
    ROOT,
    dashboard_expressions,
    dashboards,
    label_values_parts,
    panel_queries,
    promql_metric_names,
    substitute,
    variable_query,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRAPE_INTERVAL = "1s"
RATE_INTERVAL = "10s"  # Grafana's $__rate_interval for a 1 s scrape interval, with margin
API_JOB = "dynabatch-api"

# A job that runs until the test cancels it: two workers, one emulated twice as slow, so the
# policy rebalances and every per-worker series moves. Both sleep 10x and 20x their compute:
# the test waits for 15 s of samples, not for training, and at full speed the jobs' workers
# would take the 2 cores.
JOB_SPEC = {
    "name": "deploy-live",
    "dataset": {"name": "digits", "limit": 480},
    "model": {"name": "mlp", "hidden": 32},
    "workers": 2,
    "global_batch": 32,
    "epochs": 10_000,
    "policy": "affine",
    "rebalance": {"mode": "steps", "every_steps": 10},
    "emulation": {"slowdowns": [10, 20]},
}


def get_ok(url: str, **kw: Any) -> httpx.Response | None:
    try:
        r = httpx.get(url, timeout=5, **kw)
    except httpx.HTTPError:
        return None
    return r if r.status_code == 200 else None


@pytest.fixture(scope="module")
def live_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`dynabatch serve` on a free loopback port, with an embedded Ray of four logical CPUs."""
    tmp = tmp_path_factory.mktemp("deploy-api")
    port = find_free_port()
    log = tmp / "api.log"
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        # Logical CPUs: the sync job's two workers and the parameter-server job's two
        # learners run side by side (on the machine's 2 cores).
        "DYNABATCH_RAY_NUM_CPUS": "4",
    }
    for var in ("RAY_ADDRESS", "DYNABATCH_RAY_ADDRESS", "DYNABATCH_API_TOKEN"):
        env.pop(var, None)
    argv = [
        sys.executable,
        "-m",
        "dynabatch.api.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--db",
        str(tmp / "jobs.db"),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            "the API to be ready",
            lambda: proc.poll() is not None or get_ok(f"{url}/readyz"),
            timeout=120,
        )
        assert proc.poll() is None, f"dynabatch serve exited:\n{tail(log)}"
        yield url
    finally:
        stop_process(proc, sig=signal.SIGINT, grace=30.0)
        if proc.returncode not in (0, -signal.SIGINT):
            print(f"dynabatch serve exited with {proc.returncode}:\n{tail(log)}")


def prometheus_config(api_target: str) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml's API scrape job, aimed at ``api_target``. The Ray
    job is left out: its DNS names exist only inside compose."""
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = [copy.deepcopy(j) for j in cfg["scrape_configs"] if j["job_name"] == API_JOB]
    job["static_configs"] = [{**job["static_configs"][0], "targets": [api_target]}]
    job["scrape_interval"] = job["scrape_timeout"] = SCRAPE_INTERVAL
    glob = {
        **cfg.get("global", {}),
        "scrape_interval": SCRAPE_INTERVAL,
        "scrape_timeout": SCRAPE_INTERVAL,
        "evaluation_interval": SCRAPE_INTERVAL,
    }
    return {"global": glob, "scrape_configs": [job]}


@pytest.fixture(scope="module")
def live_prometheus(live_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = os.environ.get("PROMETHEUS_BIN") or "prometheus"
    if subprocess.run(["sh", "-c", f"command -v {binary}"], capture_output=True).returncode:
        pytest.skip("prometheus is not installed (see `make prometheus`)")
    tmp = tmp_path_factory.mktemp("deploy-prometheus")
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(live_api.removeprefix("http://"))))
    port = find_free_port()
    log = tmp / "prometheus.log"
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            "Prometheus to be ready",
            lambda: proc.poll() is not None or get_ok(f"{url}/-/ready"),
            timeout=60,
        )
        assert proc.poll() is None, f"prometheus exited:\n{tail(log)}"
        yield url
    finally:
        stop_process(proc, sig=signal.SIGTERM, grace=30.0)


def promql(prom: str, path: str, **params: Any) -> Any:
    r = httpx.get(f"{prom}/api/v1/{path}", params=params, timeout=30)
    body = r.json()
    assert body.get("status") == "success", f"{path} {params}: {body}"
    return body["data"]


def has_finite_value(result: list[dict[str, Any]]) -> bool:
    for series in result:
        values = series.get("values") or [series.get("value")]
        for v in values:
            if v and math.isfinite(float(v[1])):
                return True
    return False

# The parameter-server panels need a job with protocol ps: asynchronous, two learners, one
# emulated twice as slow (10x and 20x, as the sync job), so staleness differs per learner.
PS_JOB_SPEC = {
    "name": "deploy-live-ps",
    "dataset": {"name": "digits", "limit": 480},
    "model": {"name": "mlp", "hidden": 32},
    "workers": 2,
    "global_batch": 32,
    "epochs": 10_000,
    "protocol": {"name": "ps", "mode": "async"},
    "emulation": {"slowdowns": [10, 20]},
}


def is_ps_panel(title: str) -> bool:
    return title.startswith("Parameter server")


# The cluster scheduler's series (api/metrics.py) have samples only while a scheduler
# runs (DYNABATCH_CLUSTER_SCHEDULER); `dynabatch_cluster_nodes` is Ray's and always has.
SCHEDULER_SERIES = (
    "dynabatch_cluster_queue_length",
    "dynabatch_cluster_allocated_workers",
    "dynabatch_cluster_utilization_ratio",
    "dynabatch_cluster_resizes_total",
)


def needs_scheduler(expr: str) -> bool:
    return bool(promql_metric_names(expr) & set(SCHEDULER_SERIES))


@pytest.fixture(scope="module")
def running_job(live_api: str, live_prometheus: str) -> Iterator[dict[str, Any]]:
    """A job that has finished a few epochs while Prometheus scraped it; cancelled after."""
    started = time.time()
    r = httpx.post(f"{live_api}/v1/jobs", json=JOB_SPEC, timeout=60)
    assert r.status_code == 201, r.text
    job_id = r.json()["job_id"]

    def progressed() -> bool:
        job = httpx.get(f"{live_api}/v1/jobs/{job_id}", timeout=10).json()
        if job["state"] in ("FAILED", "CANCELLED", "SUCCEEDED"):
            pytest.fail(f"job {job_id} ended early: {job['state']}: {job.get('reason')}")
        # Three finished epochs, and 15 s of per-worker series in Prometheus: enough for the
        # epoch-time histogram, the accuracy, and every rate window.
        res = promql(
            live_prometheus,
            "query",
            query=f'count_over_time(dynabatch_worker_batch_size{{job_id="{job_id}"}}[15s])'
            f' >= 12 and on (job_id) dynabatch_job_epoch{{job_id="{job_id}"}} >= 3',
        )
        return bool(res["result"])

    r = httpx.post(f"{live_api}/v1/jobs", json=PS_JOB_SPEC, timeout=60)
    assert r.status_code == 201, r.text
    ps_id = r.json()["job_id"]

    def ps_progressed() -> bool:
        job = httpx.get(f"{live_api}/v1/jobs/{ps_id}", timeout=10).json()
        if job["state"] in ("FAILED", "CANCELLED", "SUCCEEDED"):
            pytest.fail(f"job {ps_id} ended early: {job['state']}: {job.get('reason')}")
        # 15 s of samples, and gradients applied within the staleness panels' rate window
        # (a version above 0 alone was not enough: on a loaded machine one early update,
        # then none in any 10 s window, left those panels empty, 0/0).
        res = promql(
            live_prometheus,
            "query",
            query=f'count_over_time(dynabatch_ps_server_version{{job_id="{ps_id}"}}[15s])'
            f" >= 12 and on (job_id) sum by (job_id) (rate(dynabatch_ps_staleness_count"
            f'{{job_id="{ps_id}"}}[{RATE_INTERVAL}])) > 0',
        )
        return bool(res["result"])

    try:
        wait_for(f"job {job_id} to run three epochs under Prometheus", progressed, timeout=180)
        wait_for(f"ps job {ps_id} to push under Prometheus", ps_progressed, timeout=180)
        yield {"id": job_id, "ps_id": ps_id, "start": started, "api": live_api}
    finally:
        for j in (job_id, ps_id):
            httpx.post(f"{live_api}/v1/jobs/{j}/cancel", json={"reason": "test done"},
                       timeout=30)


def test_dashboards_query_only_metrics_the_live_api_exports(
    live_api: str, running_job: dict[str, Any]
) -> None:
    text = httpx.get(f"{live_api}/metrics", timeout=10).text
    exported = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    if httpx.get(f"{live_api}/v1/cluster", timeout=10).json()["scheduler"] is None:
        # Without a cluster scheduler its families are exported without samples.
        assert all(f"# TYPE {n} " in text for n in SCHEDULER_SERIES)
        exported |= set(SCHEDULER_SERIES)
    missing = {}
    for name, what, expr in dashboard_expressions():
        unknown = promql_metric_names(substitute(expr, job=running_job["id"])) - exported
        if unknown:
            missing[f"{name} {what}"] = sorted(unknown)
    assert not missing, f"dashboards query metrics the API does not export: {missing}"


def test_job_variable_lists_the_running_job(
    live_prometheus: str, running_job: dict[str, Any]
) -> None:
    for name, d in dashboards().items():
        for var in d["templating"]["list"]:
            if var["type"] != "query":
                continue
            selector, label = label_values_parts(variable_query(var))
            values = promql(
                live_prometheus,
                f"label/{label}/values",
                **{"match[]": substitute(selector, job=running_job["id"])},
            )
            assert values, f"{name}: variable {var['name']} has no values"
            if var["name"] == "job":
                assert running_job["id"] in values, (name, values)


def test_every_dashboard_query_returns_data(
    live_prometheus: str, running_job: dict[str, Any]
) -> None:
    end = time.time()
    start = running_job["start"] - 5
    empty, checked = [], 0
    # Without a cluster scheduler its panels are empty by design (`GET /v1/cluster` says
    # so); with one, they must have data like every other panel.
    scheduler = httpx.get(f"{running_job['api']}/v1/cluster", timeout=10).json()["scheduler"]
    for name, d in dashboards().items():
        for title, _panel, target in panel_queries(d):
            if scheduler is None and needs_scheduler(target["expr"]):
                continue
            expr = substitute(
                target["expr"],
                job=running_job["ps_id" if is_ps_panel(title) else "id"],
                rate_interval=RATE_INTERVAL,
                interval=SCRAPE_INTERVAL,
            )
            where = f"{name} / {title} / {target['refId']}: {expr}"
            data = promql(live_prometheus, "query_range", query=expr, start=start, end=end, step=1)
            if not has_finite_value(data["result"]):
                empty.append(where)
            if target.get("instant"):  # tables and bar charts: the latest value
                now = promql(live_prometheus, "query", query=expr, time=end)
                if not has_finite_value(now["result"]):
                    empty.append(f"{where} (instant)")
            checked += 1
    assert checked >= 30, checked
    assert not empty, "queries without data:\n" + "\n".join(empty)

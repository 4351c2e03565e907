"""The service for real: uvicorn on loopback, Ray as its own cluster, a real Prometheus.

One digits job (2 workers, emulated slow enough to outlast an API restart) goes through
the whole lifecycle: submitted over REST, RUNNING with per-worker series in /metrics and in
Prometheus, the API process killed mid-job and started again, the job re-attached and
watched to SUCCEEDED with the CLI. Meanwhile a second job that cannot get its workers (it
asks for more CPUs than any node has) stays PENDING with the reason, and is cancelled (then
409 on a second cancel).
"""

from __future__ import annotations

import subprocess
from typing import Any

import httpx
import pytest
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.service.rest_client import ApiError, DynabatchClient
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.procs import BIN, ApiServer, base_env, promql, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

EPOCHS = 8
JOB: dict[str, Any] = {
    "name": "e2e-digits",
    "dataset": {"name": "digits"},
    "workers": 2,
    "global_batch": 64,
    "epochs": EPOCHS,
    # The workers sleep 60x and 120x their compute: seconds per epoch, so the job is still
    # training when the API is killed and started again (and the policy rebalances).
    "emulation": {"slowdowns": [60, 120]},
}
# The cluster's only node has 2 CPUs: a gang of two 1-CPU workers waits for the first job's
# (the scheduler never starts part of a gang), and a 3-CPU worker could never start.
QUEUED: dict[str, Any] = {
    "name": "e2e-queued",
    "dataset": {"name": "digits"},
    "workers": 2,
    "min_workers": 2,
    "global_batch": 8,
    "epochs": 1,
}
NEVER: dict[str, Any] = {
    **QUEUED,
    "name": "e2e-never",
    "workers": 1,
    "min_workers": 1,
    "worker_cpus": 3,
}


def _worker_series(text: str, job: str, metric: str) -> dict[str, float]:
    for family in text_string_to_metric_families(text):
        if family.name == metric:
            return {
                s.labels["worker"]: s.value for s in family.samples if s.labels.get("job_id") == job
            }
    return {}


def test_job_lifecycle_with_metrics_prometheus_and_api_restart(
    api_server: ApiServer, prometheus: str
) -> None:
    client = DynabatchClient(api_server.url, retries=6)
    assert httpx.get(f"{api_server.url}/healthz").json() == {"status": "ok"}

    # Submit the job (its workers take a while to start).
    job = client.submit(JOB).job_id

    # The cluster scheduler (on by default) refuses a job no set of nodes can hold, naming
    # the field; a job that must wait for the first one's nodes stays PENDING, queued, and
    # says why; cancel, then 409. (Meanwhile the first job's workers start.)
    with pytest.raises(ApiError) as never:
        client.submit(NEVER)
    assert never.value.status == 422 and "could never start" in str(never.value), str(never.value)
    blocked = client.submit(QUEUED).job_id
    pending = wait_for(
        "the queued job to show why it waits",
        lambda: (
            (d := client.get(blocked)).state == JobState.PENDING
            and d.reason
            and d.reason.startswith("queued: position 1 of 1")
            and d
        ),
        timeout=60,
    )
    assert "min_workers 2" in (pending.reason or ""), pending.reason
    cancelled = client.cancel(blocked, "e2e: not needed")
    if not cancelled.state.is_terminal:
        cancelled = wait_for(
            "the cancel to land",
            lambda: (d := client.get(blocked)).state.is_terminal and d,
            timeout=30,
        )
    assert cancelled.state == JobState.CANCELLED and cancelled.reason == "e2e: not needed"
    with pytest.raises(ApiError) as conflict:
        client.cancel(blocked)
    assert conflict.value.status == 409

    # The first job trains with both workers.
    running = wait_for(
        "the job to run with 2 workers",
        lambda: (d := client.get(job)).state == JobState.RUNNING and len(d.workers) == 2 and d,
        timeout=120,
    )
    assert sum(w.batch for w in running.workers) == 64

    # Per-worker series in /metrics, read from the live job at scrape time.
    metrics = httpx.get(f"{api_server.url}/metrics", follow_redirects=False)
    assert metrics.status_code == 200
    for name in (
        "dynabatch_worker_batch_size",
        "dynabatch_worker_partition_samples",
        "dynabatch_worker_throughput_samples_per_second",
        "dynabatch_worker_compute_seconds",
        "dynabatch_worker_wait_seconds",
    ):
        assert set(_worker_series(metrics.text, job, name)) == {"w0", "w1"}, name

    # Prometheus scraped it: the batch sizes of the running job, by PromQL.
    query = (
        f'dynabatch_worker_batch_size{{job_id="{job}"}} '
        f'and on(job_id) (dynabatch_job_state{{job_id="{job}",state="RUNNING"}} == 1)'
    )
    series = wait_for(
        "Prometheus to return the running job's batch sizes",
        lambda: (r := promql(prometheus, query)) and len(r) == 2 and r,
        timeout=30,
        interval=0.5,
    )
    assert {s["metric"]["worker"] for s in series} == {"w0", "w1"}
    assert sum(float(s["value"][1]) for s in series) == pytest.approx(64, abs=1)

    # The node view shows where the workers are.
    nodes = client.nodes().nodes
    hosting = [n for n in nodes if any(j.job_id == job for j in n.jobs)]
    assert len(hosting) == 1 and hosting[0].alive
    assert sorted(next(j for j in hosting[0].jobs if j.job_id == job).workers) == ["w0", "w1"]

    # Kill the API mid-job (no shutdown hooks), then start it again on the same database.
    before = client.get(job)
    assert before.state == JobState.RUNNING, "the job finished before the restart"
    assert before.epochs_completed < EPOCHS
    api_server.kill()
    api_server.start()
    assert f"job {job}: re-attached to its coordinator" in api_server.log.read_text()

    listed = {j.job_id: j for j in client.list().items}
    assert listed[blocked].state == JobState.CANCELLED  # finished jobs survive the restart
    assert listed[job].state in (JobState.RUNNING, JobState.SUCCEEDED)

    # Watch it to the end with the CLI.
    watch = subprocess.run(
        [str(BIN / "dynabatch"), "watch", job, "--url", api_server.url, "--interval", "0.5"],
        capture_output=True,
        text=True,
        timeout=180,
        env=base_env(),
    )
    assert watch.returncode == 0, watch.stdout + watch.stderr
    assert f"job {job} SUCCEEDED" in watch.stdout

    done = client.get(job)
    assert done.state == JobState.SUCCEEDED and done.epochs_completed == EPOCHS
    history = client.history(job).records
    assert [r.epoch for r in history] == list(range(EPOCHS))
    assert len(history) > before.epochs_completed  # epochs reported after the restart
    assert all(len(r.workers) == 2 for r in history)
    assert any("SUCCEEDED" in line.message for line in client.logs(job).lines)

    text = httpx.get(f"{api_server.url}/metrics").text
    states = {
        s.labels["state"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "dynabatch_job_state"
        for s in f.samples
        if s.labels["job_id"] == job
    }
    assert states["SUCCEEDED"] == 1 and states["RUNNING"] == 0

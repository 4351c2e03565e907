"""The polled reads (a job's status, its history, the job list, /metrics) are answered from
what was built at the store's current version: no Ray call, no SQL query, no worker thread
while nothing changed; a change shows at the next read; ETag and 304 (api/cached.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
from dynabatch.api import cached
from dynabatch.api.app import create_app
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.service.job_service import JobService
from dynabatch.service.schemas import JobDetail, JobHistory, JobList, JobSummary
from dynabatch.service.settings import Settings
from fastapi.testclient import TestClient

from tests.fakes import FakeCluster

SPEC = {"name": "digits", "workers": 2, "global_batch": 64, "epochs": 50}


@pytest.fixture
def app(tmp_path: Path) -> Iterator[tuple[TestClient, JobService, FakeCluster]]:
    cluster = FakeCluster()
    # No sync loop: the test decides when the store changes.
    application = create_app(Settings(db_path=str(tmp_path / "jobs.db"), sync_interval_s=0.0),
                             cluster=cluster)
    with TestClient(application) as client:
        yield client, application.state.service, cluster


def _submit(client: TestClient) -> str:
    r = client.post("/v1/jobs", json=SPEC)
    assert r.status_code == 201, r.text
    return r.json()["job_id"]


def _running(client: TestClient, service: JobService, epochs: int = 2) -> str:
    """A RUNNING job with ``epochs`` finished epochs in the store."""
    job = _submit(client)
    while len(service.history(job)) < epochs:
        service.reconciler.sync_once()
    assert service.get(job).state == JobState.RUNNING
    return job


class Watch:
    """SQL statements run by the store, Ray calls made, threads handed work."""

    def __init__(self, service: JobService, cluster: FakeCluster,
                 monkeypatch: pytest.MonkeyPatch):
        self.sql: list[str] = []
        self.threads = 0
        self.cluster = cluster
        self.calls0 = len(cluster.calls)
        service.store._db.set_trace_callback(self.sql.append)
        run_sync = anyio.to_thread.run_sync

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.threads += 1
            return await run_sync(*args, **kwargs)

        monkeypatch.setattr(anyio.to_thread, "run_sync", counted)

    @property
    def ray_calls(self) -> list[tuple[str, str]]:
        return self.cluster.calls[self.calls0:]


def _builds(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The answers the views build from now on: each build tags its body once."""
    built: list[bytes] = []
    tag = cached.etag_of

    def tagging(data: bytes) -> str:
        built.append(data)
        return tag(data)

    monkeypatch.setattr(cached, "etag_of", tagging)
    return built


def _paths(job: str) -> list[str]:
    return [f"/v1/jobs/{job}", f"/v1/jobs/{job}/history", "/v1/jobs", "/metrics"]


def test_unchanged_reads_do_no_ray_call_no_query_and_no_thread_hand_off(
    app: tuple[TestClient, JobService, FakeCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, service, cluster = app
    # /metrics is re-rendered at least once per sync interval (at most 1 s; none here):
    # a slow test must not see that as a change.
    monkeypatch.setattr(service, "metrics_ttl_s", 3600.0)
    job = _running(client, service)
    built = _builds(monkeypatch)
    first = {p: client.get(p) for p in _paths(job)}  # built once
    assert all(r.status_code == 200 for r in first.values())
    builds = len(built)
    watch = Watch(service, cluster, monkeypatch)
    for _ in range(5):
        for p in _paths(job):
            r = client.get(p)
            assert r.status_code == 200
            assert r.content == first[p].content, p
    assert watch.sql == []
    assert watch.ray_calls == []
    assert watch.threads == 0  # async dependencies and routes: no thread pool round trip
    assert len(built) == builds


def test_a_change_is_read_once_and_shown_at_the_next_request(
    app: tuple[TestClient, JobService, FakeCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, service, cluster = app
    job = _running(client, service)
    before = {p: client.get(p) for p in _paths(job)[:3]}
    built = _builds(monkeypatch)
    # The coordinator moved on a step (a whole epoch: the spec re-plans at epochs' ends):
    # the job's row changed.
    service.reconciler.sync_job(job)
    builds = len(built)
    status = client.get(f"/v1/jobs/{job}")
    assert status.json()["epoch"] != before[f"/v1/jobs/{job}"].json()["epoch"]
    assert status.headers["etag"] != before[f"/v1/jobs/{job}"].headers["etag"]
    assert len(built) == builds + 1  # built again, once
    watch = Watch(service, cluster, monkeypatch)
    for _ in range(3):
        assert client.get(f"/v1/jobs/{job}").content == status.content
    assert (len(built), watch.sql, watch.threads) == (builds + 1, [], 0)  # then kept
    listed = client.get("/v1/jobs").json()["items"][0]
    assert (listed["step"], listed["updated_at"]) == (status.json()["step"],
                                                      status.json()["updated_at"])
    # The history has its own version: a step that finished no epoch leaves it as it was.
    history = client.get(f"/v1/jobs/{job}/history")
    old = before[f"/v1/jobs/{job}/history"]
    if len(service.history(job)) == len(old.json()["records"]):
        assert history.headers["etag"] == old.headers["etag"]


def test_a_new_epoch_shows_in_the_history(
    app: tuple[TestClient, JobService, FakeCluster]
) -> None:
    client, service, _ = app
    job = _running(client, service)
    n = len(client.get(f"/v1/jobs/{job}/history").json()["records"])
    while len(service.history(job)) == n:
        service.reconciler.sync_once()
    records = client.get(f"/v1/jobs/{job}/history").json()["records"]
    assert [r["epoch"] for r in records] == list(range(n + 1))
    assert [r["epoch"] for r in client.get(f"/v1/jobs/{job}/history?since=1").json()
            ["records"]] == list(range(1, n + 1))


def test_a_cancel_shows_at_once(app: tuple[TestClient, JobService, FakeCluster]) -> None:
    client, service, _ = app
    job = _running(client, service)
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "RUNNING"
    assert client.get("/v1/jobs?state=RUNNING").json()["total"] == 1
    assert client.post(f"/v1/jobs/{job}/cancel").status_code == 200
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "CANCELLED"
    assert client.get("/v1/jobs?state=RUNNING").json()["total"] == 0
    assert client.get("/v1/jobs").json()["items"][0]["state"] == "CANCELLED"


def test_answers_are_the_response_models(app: tuple[TestClient, JobService, FakeCluster]
                                         ) -> None:
    client, service, _ = app
    job = _running(client, service, epochs=3)
    rec = service.get(job)
    assert client.get(f"/v1/jobs/{job}").json() == JobDetail.of(rec).model_dump(mode="json")
    assert client.get(f"/v1/jobs/{job}/history?since=1").json() == JobHistory(
        job_id=job, records=service.history(job, 1)).model_dump(mode="json")
    records, total = service.list(None, offset=0, limit=50)
    assert client.get("/v1/jobs").json() == JobList(
        items=[JobSummary.of(r) for r in records], total=total, offset=0, limit=50
    ).model_dump(mode="json")
    r = client.get(f"/v1/jobs/{job}")
    assert r.headers["content-type"] == "application/json"
    assert r.headers["cache-control"] == "no-cache"


@pytest.mark.parametrize("path", ["/v1/jobs/{job}", "/v1/jobs/{job}/history", "/v1/jobs"])
def test_etag_and_if_none_match(app: tuple[TestClient, JobService, FakeCluster],
                                path: str) -> None:
    client, service, _ = app
    job = _running(client, service)
    url = path.format(job=job)
    r = client.get(url)
    etag = r.headers["etag"]
    assert etag.startswith('"') and etag.endswith('"')
    for header in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        again = client.get(url, headers={"If-None-Match": header})
        assert again.status_code == 304, header
        assert again.content == b""
        assert again.headers["etag"] == etag
    assert client.get(url, headers={"If-None-Match": '"other"'}).status_code == 200
    # Once the job changed, the old tag no longer matches: the new body comes.
    while client.get(url).headers["etag"] == etag:
        service.reconciler.sync_once()
    changed = client.get(url, headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag


def test_unknown_and_malformed_jobs(app: tuple[TestClient, JobService, FakeCluster]) -> None:
    client, _, _ = app
    for path in ("/v1/jobs/0123456789ab", "/v1/jobs/0123456789ab/history"):
        r = client.get(path)
        assert r.status_code == 404 and "not found" in r.json()["detail"]
    assert client.get("/v1/jobs/NOT-AN-ID").status_code == 422


def test_the_token_still_guards_cached_reads(tmp_path: Path) -> None:
    settings = Settings(db_path=str(tmp_path / "jobs.db"), sync_interval_s=0.0,
                        api_token="s3cret")
    with TestClient(create_app(settings, cluster=FakeCluster())) as client:
        auth = {"Authorization": "Bearer s3cret"}
        job = client.post("/v1/jobs", json=SPEC, headers=auth).json()["job_id"]
        for path in (f"/v1/jobs/{job}", f"/v1/jobs/{job}/history", "/v1/jobs"):
            assert client.get(path, headers=auth).status_code == 200  # now kept
            assert client.get(path).status_code == 401
            assert client.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401

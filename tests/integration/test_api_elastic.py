"""The REST API's membership and resume endpoints on a real multi-node Ray cluster, with the
service's defaults: the cluster scheduler on, so a scale or a drain is a request to it.

The app runs in this process (TestClient) on the session's cluster, already connected: the
service is built here and handed to ``create_app``, so the app's shutdown never calls
``ray.shutdown()``. The jobs' workers run on the session's three nodes, already up (no node
is removed or added here; three fresh nodes of the module's own took 39 s to set up beside
the other pytest worker, and the first job waited on their agents starting). The scheduler
actor is killed when the module ends: it is detached, and a later ``dynabatch run
--address`` in the session would otherwise queue its job with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from dynabatch.api.app import create_app
from dynabatch.scheduler.runtime.launch import find_coordinator
from dynabatch.service.job_service import build_service
from dynabatch.service.ray_client import RayClusterClient
from dynabatch.service.settings import Settings
from fastapi.testclient import TestClient

from .conftest import find_scheduler, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TAG = "dynabatch_worker"  # the session's nodes (tests/integration/conftest.py)


def _job(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "api-elastic",
        "dataset": {"name": "digits"},
        "model": {"name": "mlp", "hidden": 64},
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "workers": 3,
        "global_batch": 64,
        "epochs": 8,
        "seed": 7,
        "node_resource": TAG,
        "collective_timeout_s": 3,
        "worker_wait_timeout_s": 20,
        # No spare on the node a scale-down or a drain frees: nothing here scales back up.
        "spares": 0,
    }
    base.update(kw)
    return base


@pytest.fixture(scope="module")
def api(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db = tmp_path_factory.mktemp("api") / "jobs.db"
    # Jobs checkpoint under pytest's temporary directories (tmp_path), as a REST client may
    # only name directories under the checkpoint root.
    settings = Settings(
        db_path=str(db),
        sync_interval_s=0.2,
        checkpoint_root=str(tmp_path_factory.getbasetemp()),
    )
    # Not embedded: jobs get detached coordinators, as under `dynabatch serve --address`.
    service = build_service(settings, RayClusterClient(cluster.address))
    assert not service.cluster.embedded
    assert service.scheduling is not None  # the default
    with TestClient(create_app(settings, service=service)) as client:
        yield client
    service.store.close()
    sched = find_scheduler()
    if sched is not None:
        ray.kill(sched, no_restart=True)


def _get(client: TestClient, job: str) -> dict[str, Any]:
    r = client.get(f"/v1/jobs/{job}")
    assert r.status_code == 200, r.text
    return r.json()


def _wait_state(client: TestClient, job: str, timeout: float) -> dict[str, Any]:
    return wait_for(
        lambda: (b := _get(client, job))["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and b,
        timeout=timeout,
        interval=0.2,
    )


def _check_history(client: TestClient, job: str, epochs: int) -> list[dict[str, Any]]:
    records = client.get(f"/v1/jobs/{job}/history").json()["records"]
    assert [r["epoch"] for r in records] == list(range(epochs))
    for r in records:
        assert r["samples_trained"] == r["dataset_size"], r
    return records


def test_scale_down_and_drain_through_the_api_keep_training(api: TestClient) -> None:
    r = api.post("/v1/jobs", json=_job())
    assert r.status_code == 201, r.text
    job = r.json()["job_id"]
    body = wait_for(
        lambda: (b := _get(api, job))["state"] == "RUNNING" and b["epochs_completed"] >= 1 and b,
        # Liveness bounds, not speed checks: the first job on a fresh cluster beside the
        # other pytest worker took 56-60 s to finish its first epoch here.
        timeout=180,
        interval=0.1,
    )
    assert len(body["workers"]) == 3
    # Not a member: the coordinator's KeyError comes back as a 404 through Ray.
    r = api.delete(f"/v1/jobs/{job}/workers/w99")
    assert r.status_code == 404 and "'w99' is not a member" in r.json()["detail"]

    r = api.post(f"/v1/jobs/{job}/scale", json={"workers": 2})
    assert r.status_code == 202, r.text
    assert r.json()["epoch"] < 6, "the job was nearly done before the scale request"
    # The scheduler's next round assigns the job two of its three nodes: the worker on the
    # third leaves at a step boundary, its state handed over.
    members = [w["worker"] for w in r.json()["workers"]]
    two = wait_for(lambda: len((b := _get(api, job))["workers"]) == 2 and b, timeout=120)
    (scaled_out,) = set(members) - {w["worker"] for w in two["workers"]}
    # The owner drains a named worker: the scheduler frees its node's slot; it leaves.
    named = two["workers"][0]["worker"]
    r = api.delete(f"/v1/jobs/{job}/workers/{named}")
    assert r.status_code == 202, r.text
    # Its last worker is not drained: the service says why, as the driver would.
    last_one = two["workers"][1]["worker"]
    r = api.delete(f"/v1/jobs/{job}/workers/{last_one}")
    assert r.status_code == 409 and "cannot drain the last worker" in r.json()["detail"], r.text

    done = _wait_state(api, job, timeout=180)
    assert done["state"] == "SUCCEEDED", done["reason"]
    assert done["worker_events"].get("leave:drained") == 2, done["worker_events"]
    assert done["resumes"] == 0
    records = _check_history(api, job, 8)
    last = records[-1]
    logs = [x["message"] for x in api.get(f"/v1/jobs/{job}/logs").json()["lines"]]
    for w in (scaled_out, named):
        assert f"worker {w} leave: drained" in logs, logs[-30:]
    assert [w["worker"] for w in last["workers"]] == [last_one], (done["worker_events"], logs[-30:])
    assert len(records[0]["workers"]) == 3
    assert sum(w["partition"] for w in last["workers"]) == last["dataset_size"]
    # Finished: no more scaling.
    r = api.post(f"/v1/jobs/{job}/scale", json={"workers": 3})
    assert r.status_code == 409 and "SUCCEEDED" in r.json()["detail"]


def test_killed_coordinator_is_resumed_from_its_checkpoint(api: TestClient, tmp_path: Path) -> None:
    # Two workers: the resume, not the group's size, is what is tested (each worker is a
    # process started twice, before the kill and after it).
    spec = _job(workers=2, epochs=6, checkpoint={"dir": str(tmp_path), "every_epochs": 1})
    r = api.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job = r.json()["job_id"]
    wait_for(lambda: _get(api, job)["epochs_completed"] >= 2, timeout=180, interval=0.1)
    ray.kill(find_coordinator(job), no_restart=True)

    done = _wait_state(api, job, timeout=180)
    assert done["state"] == "SUCCEEDED", done["reason"]
    assert done["resumes"] == 1
    _check_history(api, job, 6)
    lines = api.get(f"/v1/jobs/{job}/logs").json()["lines"]
    assert [x["seq"] for x in lines] == list(range(len(lines)))
    messages = [x["message"] for x in lines]
    assert any("resuming from its checkpoint (automatic resume 1 of 3)" in m for m in messages)
    assert any(m.startswith("resuming from checkpoint at epoch") for m in messages)
    assert messages[-1] == "state SUCCEEDED"

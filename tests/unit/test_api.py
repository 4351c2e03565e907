"""Route logic against the app with a fake cluster (tests/fakes.py): no Ray."""

from __future__ import annotations

import hashlib
import io
import os
import re
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dynabatch.api.app import create_app
from dynabatch.scheduler.checkpoint import checkpoint_path
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.service.job_service import JobService, build_service
from dynabatch.service.reconciler import EMBEDDED_ENDED
from dynabatch.service.settings import Settings
from dynabatch.service.store import JobStore
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes import NODE_IDS, FakeCluster, evaluate

ROOT = Path(__file__).resolve().parents[2]
SPEC = {"name": "digits", "workers": 2, "global_batch": 64, "epochs": 2}

MakeApp = Callable[..., tuple[TestClient, JobService, FakeCluster]]


@pytest.fixture
def make_app(tmp_path: Path) -> Iterator[MakeApp]:
    """Apps on one SQLite file; each call is one API process (started via the lifespan)."""
    clients: list[TestClient] = []

    def make(
        cluster: FakeCluster | None = None, **settings: Any
    ) -> tuple[TestClient, JobService, FakeCluster]:
        cluster = cluster if cluster is not None else FakeCluster()
        options = {
            "db_path": str(tmp_path / "jobs.db"),
            "sync_interval_s": 0.0,
            "checkpoint_root": str(tmp_path),  # where the tests' checkpoint dirs are
            **settings,
        }
        cfg = Settings(**options)
        app = create_app(cfg, cluster=cluster)
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        return client, app.state.service, cluster

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def _stop(client: TestClient) -> None:
    """End an app (as when the API process exits)."""
    client.__exit__(None, None, None)


def _submit(client: TestClient, **overrides: Any) -> str:
    r = client.post("/v1/jobs", json={**SPEC, **overrides})
    assert r.status_code == 201, r.text
    return r.json()["job_id"]


def _sync(service: JobService, times: int = 1) -> None:
    for _ in range(times):
        service.reconciler.sync_once()


# Submit and validation ----------------------------------------------------------------
def test_submit_returns_201_and_id(make_app: MakeApp) -> None:
    client, _, cluster = make_app()
    r = client.post("/v1/jobs", json=SPEC)
    assert r.status_code == 201
    body = r.json()
    assert re.fullmatch(r"[0-9a-f]{12}", body["job_id"])
    assert body["state"] == "PENDING" and body["name"] == "digits"
    assert r.headers["location"] == f"/v1/jobs/{body['job_id']}"
    assert body["job_id"] in cluster.coordinators


def test_submit_reports_accepted_settings_without_effect(make_app: MakeApp) -> None:
    client, _, _ = make_app()
    spec = {**SPEC, "emulation": {"disturbances": [{"worker": 0, "factor": 2, "epoch": 9}]}}
    r = client.post("/v1/jobs", json=spec)  # to the submitter, not the service's log
    assert r.status_code == 201
    assert any("ignored" in w for w in r.json()["warnings"])


@pytest.mark.parametrize(
    ("body", "field", "needle"),
    [
        ({"global_batch": 0}, "global_batch", "greater than or equal to 1"),
        ({"bogus": 1}, "bogus", "unknown field"),
        ({"policy": "best"}, "policy", "'static', 'dbs' or 'affine'"),
        ({"rebalance": {"mode": "never"}}, "rebalance.mode", "'epoch'"),
        ({"workers": 0}, "workers", "between 1 and"),
        ({"workers": 4, "global_batch": 2}, "global_batch", "smaller than workers"),
        ({"dataset": {"name": "nope"}}, "dataset.name", "unknown dataset"),
        # JSON strings and booleans are not integers.
        ({"epochs": "7"}, "epochs", "valid integer"),
        ({"global_batch": True}, "global_batch", "valid integer"),
        ({"rebalance": {"check_steps": "2"}}, "rebalance.check_steps", "valid integer"),
        ({"workers": "7"}, "workers", "between 1 and"),
        ({"workers": True}, "workers", "between 1 and"),
    ],
)
def test_bad_spec_gets_422_naming_the_field(
    make_app: MakeApp, body: dict[str, Any], field: str, needle: str
) -> None:
    client, _, cluster = make_app()
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422
    errors = r.json()["detail"]
    mine = [e for e in errors if e["field"] == field]
    assert mine, errors
    assert needle in mine[0]["msg"]
    assert not cluster.coordinators


def test_each_problem_is_its_own_entry(make_app: MakeApp) -> None:
    client, _, _ = make_app()
    r = client.post(
        "/v1/jobs", json={"workers": 4, "min_workers": 5, "global_batch": 2, "epochs": 0}
    )
    assert r.status_code == 422
    fields = {e["field"] for e in r.json()["detail"]}
    assert {"epochs"} <= fields or {"workers", "global_batch"} <= fields


# What a submitted spec may name (settings) -------------------------------------------------
PLUGINS = "tests.unit.workload_plugins"
USER_CODE = {
    "dataset": {"name": f"{PLUGINS}:arrays_loader"},
    "model": {"name": f"{PLUGINS}:tiny_net"},
}


def _refused(client: TestClient, cluster: FakeCluster, body: dict[str, Any]) -> dict[str, str]:
    """POST the spec, expect 422 and nothing stored or launched; {field: message}."""
    r = client.post("/v1/jobs", json={**SPEC, **body})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    for e in detail:
        assert e["loc"] == ["body", *e["field"].split(".")] and "\n" not in e["msg"], e
    assert client.get("/v1/jobs").json()["total"] == 0, "a refused job is never stored"
    assert not cluster.launches
    return {e["field"]: e["msg"] for e in detail}


def test_user_code_over_rest_is_refused_by_default(make_app: MakeApp) -> None:
    client, _, cluster = make_app()
    errors = _refused(client, cluster, USER_CODE)
    assert set(errors) == {"dataset.name", "model.name"}
    assert "runs no user code" in errors["model.name"]


@pytest.mark.parametrize("modules", [PLUGINS, "tests", "tests.unit, other", "*"])
def test_user_code_from_allowed_modules_is_accepted(make_app: MakeApp, modules: str) -> None:
    client, _, cluster = make_app(user_code_modules=modules)
    job = _submit(client, **USER_CODE)
    assert cluster.launches[job][0].model.name == f"{PLUGINS}:tiny_net"


def test_user_code_outside_the_allowed_prefixes_is_refused(make_app: MakeApp) -> None:
    # "tests.uni" is a prefix of the string, not of the module path.
    client, _, cluster = make_app(user_code_modules="tests.uni, other")
    errors = _refused(client, cluster, {"model": USER_CODE["model"]})
    assert list(errors) == ["model.name"]
    assert "only from the modules tests.uni, other" in errors["model.name"]


def test_paths_over_rest_must_be_under_the_roots(make_app: MakeApp, tmp_path: Path) -> None:
    data, outside = tmp_path / "data", tmp_path / "outside"
    (data / "mnist").mkdir(parents=True)
    outside.mkdir()
    (data / "link").symlink_to(outside)
    client, _, cluster = make_app(data_roots=str(data), checkpoint_root=str(tmp_path / "ckpt"))
    for path in (str(data / ".." / "outside"), str(data / "link"), "mnist", "/etc"):
        errors = _refused(client, cluster, {"dataset": {"name": "mnist", "path": path}})
        assert list(errors) == ["dataset.path"], errors
    errors = _refused(client, cluster, {"checkpoint": {"dir": str(tmp_path / "ckpt" / "..")}})
    assert list(errors) == ["checkpoint.dir"] and "outside" in errors["checkpoint.dir"]
    _submit(
        client,
        dataset={"name": "mnist", "path": str(data / "mnist")},
        checkpoint={"dir": str(tmp_path / "ckpt" / "jobs")},
    )


@pytest.mark.parametrize(("body", "field", "needle"), [
    ({"dataset": {"name": "parquet", "options": {"x": ["a"], "colour": "red"}}},
     "dataset.options", "unknown option 'colour' for parquet (allowed: cache_groups, "),
    ({"dataset": {"name": "npy", "options": {"xs": "x*.npy"}}},
     "dataset.options", "unknown option 'xs' for npy"),
    ({"dataset": {"name": "imagefolder", "options": {"transform": ["flip"]}}},
     "dataset.options", "unknown option 'transform' for imagefolder"),
    ({"dataset": {"name": "synthetic", "options": {"n_sample": 64}}},
     "dataset.options", "unknown option 'n_sample' for synthetic"),
    ({"model": {"name": "mlp", "options": {"layerz": 3}}},
     "model.options", "unknown option 'layerz' for mlp"),
], ids=["parquet", "npy", "imagefolder", "synthetic", "mlp"])
def test_an_unknown_option_of_a_built_in_is_refused_before_the_job_exists(
    make_app: MakeApp, tmp_path: Path, body: dict[str, Any], field: str, needle: str
) -> None:
    (tmp_path / "data").mkdir()
    if "dataset" in body:
        body["dataset"]["path"] = str(tmp_path / "data")
    client, _, cluster = make_app(data_roots=str(tmp_path / "data"))
    errors = _refused(client, cluster, body)
    assert list(errors) == [field] and needle in errors[field], errors


def test_the_options_of_user_code_are_left_to_the_job(make_app: MakeApp) -> None:
    """The service never imports user code: a loader it cannot see is not checked here."""
    client, _, cluster = make_app(user_code_modules="*")
    job = _submit(client, dataset={"name": "not_here_at_all:load", "options": {"sepp": ","}})
    assert cluster.launches[job][0].dataset.options == {"sepp": ","}


def test_paths_over_rest_are_refused_without_roots(make_app: MakeApp, tmp_path: Path) -> None:
    client, _, cluster = make_app(checkpoint_root=None)
    errors = _refused(
        client,
        cluster,
        {"dataset": {"name": "mnist", "path": str(tmp_path)}, "checkpoint": {"dir": str(tmp_path)}},
    )
    assert errors == {
        "dataset.path": "not allowed: this service accepts no dataset paths",
        "checkpoint.dir": "not allowed: this service accepts no checkpoint directories",
    }


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b"", "a JSON body is required"),
    ],
)
def test_malformed_bodies_get_422(make_app: MakeApp, content: bytes, needle: str) -> None:
    client, _, _ = make_app()
    r = client.post("/v1/jobs", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert needle in r.json()["detail"][0]["msg"]


TOO_LARGE_1000 = {"detail": "request body too large: this endpoint takes at most 1000 bytes"}


def test_payload_too_large_gets_413_as_json_naming_the_limit(make_app: MakeApp) -> None:
    client, _, _ = make_app(max_body_bytes=1000)
    big = {**SPEC, "dataset": {"name": "digits", "options": {"pad": "x" * 2000}}}
    r = client.post("/v1/jobs", json=big)
    # FastAPI's own limit (FastAPI(max_body_size=...)), in the API's error shape.
    assert r.status_code == 413 and r.headers["content-type"] == "application/json"
    assert r.json() == TOO_LARGE_1000

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"name": "x", "dataset": {"options": {"pad": "'
        for _ in range(10):
            yield b"y" * 200
        yield b'"}}}'

    r = client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json() == TOO_LARGE_1000
    assert client.post("/v1/jobs", json=SPEC).status_code == 201  # the limit, not a lockout


# Shipping code: POST /v1/code ---------------------------------------------------------
def _zip(files: dict[str, bytes | str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


CODE = _zip({"working_dir/my_loss.py": "def loss(o, t):\n    return o.sum(1)\n"})


def _upload(client: TestClient, data: bytes) -> Any:
    return client.post("/v1/code", content=data, headers={"content-type": "application/zip"})


def test_code_upload_is_refused_unless_the_operator_allows_shipped_code(
    make_app: MakeApp, tmp_path: Path
) -> None:
    client, _, _ = make_app()  # the defaults: no user code, nowhere to keep it
    r = _upload(client, CODE)
    assert r.status_code == 403 and "DYNABATCH_USER_CODE_MODULES='*'" in r.json()["detail"]
    client, _, _ = make_app(user_code_modules="mypkg")  # some modules are not any code
    assert _upload(client, CODE).status_code == 403
    client, _, _ = make_app(user_code_modules="*")  # allowed, but no code root
    r = _upload(client, CODE)
    assert r.status_code == 403 and "DYNABATCH_CODE_ROOT" in r.json()["detail"]
    client, _, _ = make_app(user_code_modules="*", code_root=str(tmp_path / "code"),
                            api_token="s3cret")
    assert _upload(client, CODE).status_code == 401
    assert not (tmp_path / "code").exists()


def test_an_upload_is_kept_once_under_the_code_root_and_a_job_may_ship_it(
    make_app: MakeApp, tmp_path: Path
) -> None:
    root = tmp_path / "code"
    client, _, cluster = make_app(user_code_modules="*", code_root=str(root),
                                  max_body_bytes=1000, max_code_bytes=64 * 1024)
    big_but_allowed = _zip({"working_dir/data.txt": os.urandom(5000)})  # over the JSON limit
    r = _upload(client, big_but_allowed)
    assert r.status_code == 201, r.text
    r = _upload(client, CODE)
    assert r.status_code == 201, r.text
    body = r.json()
    digest = hashlib.sha256(CODE).hexdigest()
    assert body == {"working_dir": (root / f"{digest}.zip").resolve().as_uri(),
                    "sha256": digest, "bytes": len(CODE), "files": 1}
    assert (root / f"{digest}.zip").read_bytes() == CODE
    assert _upload(client, CODE).json() == body  # the same code, the same URI
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [f"{digest}.zip", f"{hashlib.sha256(big_but_allowed).hexdigest()}.zip"])

    job = _submit(client, working_dir=body["working_dir"], loss="my_loss:loss")
    assert cluster.launches[job][-1].working_dir == body["working_dir"]
    # What a job may name: its uploads and remote URIs, never a path on the service's disk.
    for bad, why in ((str(tmp_path), "is a local path: upload the directory"),
                     ("file:///etc/passwd.zip", "is outside the allowed directories"),
                     (f"local://{tmp_path}", "is outside the allowed directories")):
        r = client.post("/v1/jobs", json={**SPEC, "working_dir": bad})
        assert r.status_code == 422, bad
        (problem,) = r.json()["detail"]
        assert problem["field"] == "working_dir" and why in problem["msg"], problem
    assert _submit(client, working_dir="https://example.org/code.zip")


def test_an_upload_over_its_own_limit_gets_413_naming_that_limit(
    make_app: MakeApp, tmp_path: Path
) -> None:
    client, _, _ = make_app(user_code_modules="*", code_root=str(tmp_path / "code"),
                            max_code_bytes=2000)
    r = _upload(client, os.urandom(5000))
    assert r.status_code == 413
    assert r.json() == {"detail": "request body too large: this endpoint takes at most 2000 "
                                  "bytes"}
    assert not (tmp_path / "code").exists()


@pytest.mark.parametrize(("data", "why"), [
    (b"PK\x03\x04 not really a zip", "not a zip archive"),
    (b"", "not a zip archive"),
    (_zip({"../evil.py": "x = 1"}), "points outside the archive"),
    (_zip({"/etc/cron.d/evil": "x"}), "points outside the archive"),
    (_zip({"working_dir/": ""}), "holds no file"),
])
def test_a_bad_zip_gets_422_naming_the_problem(make_app: MakeApp, tmp_path: Path, data: bytes,
                                                why: str) -> None:
    client, _, _ = make_app(user_code_modules="*", code_root=str(tmp_path / "code"))
    r = _upload(client, data)
    assert r.status_code == 422, r.text
    (problem,) = r.json()["detail"]
    assert problem["field"] == "body" and why in problem["msg"]
    assert not list((tmp_path / "code").glob("*.zip"))


def test_a_corrupt_member_is_found_before_it_is_kept(make_app: MakeApp, tmp_path: Path) -> None:
    client, _, _ = make_app(user_code_modules="*", code_root=str(tmp_path / "code"))
    good = _zip({"working_dir/m.py": "VALUE = 1\n" * 50})
    data = bytearray(good)
    at = data.index(b"VALUE")  # stored uncompressed: flip a byte of the member's data
    data[at] ^= 0xFF
    r = _upload(client, bytes(data))
    assert r.status_code == 422 and "is corrupt" in r.json()["detail"][0]["msg"]


# Reading jobs -------------------------------------------------------------------------
def test_job_progresses_to_succeeded_with_history_and_logs(make_app: MakeApp) -> None:
    client, service, _ = make_app()
    job = _submit(client, epochs=3)
    _sync(service)  # the coordinator's first step: its workers start and train epoch 0
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "RUNNING"
    assert [w["worker"] for w in body["workers"]] == ["w0", "w1"]
    assert sum(w["batch"] for w in body["workers"]) == 64
    assert body["spec"]["global_batch"] == 64
    assert body["epochs_completed"] == 1 and body["epoch"] == 1
    _sync(service, 10)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "SUCCEEDED"
    assert body["finished_at"] is not None
    history = client.get(f"/v1/jobs/{job}/history").json()["records"]
    assert [r["epoch"] for r in history] == [0, 1, 2]
    assert all(r["samples_trained"] == 3 * 64 and r["verified"] for r in history)
    assert (
        client.get(f"/v1/jobs/{job}/history", params={"since": 1}).json()["records"][0]["epoch"]
        == 1
    )
    logs = client.get(f"/v1/jobs/{job}/logs").json()
    assert logs["lines"][-1]["message"] == "state SUCCEEDED"
    tail = client.get(f"/v1/jobs/{job}/logs", params={"since": logs["next_since"]}).json()
    assert tail["lines"] == [] and tail["next_since"] == logs["next_since"]


def test_finished_coordinator_is_released(make_app: MakeApp) -> None:
    client, service, cluster = make_app()
    job = _submit(client, epochs=1)
    _sync(service, 6)
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "SUCCEEDED"
    assert cluster.released == [job]


def test_list_filters_by_state_and_paginates(make_app: MakeApp) -> None:
    client, service, _ = make_app()
    jobs = [_submit(client, name=f"j{i}") for i in range(4)]
    client.post(f"/v1/jobs/{jobs[0]}/cancel")
    _sync(service)
    page = client.get("/v1/jobs", params={"limit": 2}).json()
    assert page["total"] == 4 and [j["name"] for j in page["items"]] == ["j3", "j2"]
    page = client.get("/v1/jobs", params={"limit": 2, "offset": 2}).json()
    assert [j["name"] for j in page["items"]] == ["j1", "j0"]
    running = client.get("/v1/jobs", params={"state": "RUNNING"}).json()
    assert running["total"] == 3 and {j["state"] for j in running["items"]} == {"RUNNING"}
    cancelled = client.get("/v1/jobs", params={"state": "CANCELLED"}).json()
    assert [j["job_id"] for j in cancelled["items"]] == [jobs[0]]
    assert client.get("/v1/jobs", params={"state": "BOGUS"}).status_code == 422
    assert client.get("/v1/jobs", params={"limit": 0}).status_code == 422
    assert client.get("/v1/jobs", params={"offset": -1}).status_code == 422


def test_several_jobs_run_at_once(make_app: MakeApp) -> None:
    client, service, _ = make_app()
    a, b = _submit(client), _submit(client)
    _sync(service)  # one step of each: epoch 0 of 2
    assert {client.get(f"/v1/jobs/{j}").json()["state"] for j in (a, b)} == {"RUNNING"}


def test_pending_job_shows_why(make_app: MakeApp) -> None:
    client, service, cluster = make_app(FakeCluster(hold=True))  # every node is down
    job = _submit(client)
    _sync(service, 3)
    hold = cluster.coordinators[job].snapshot().reason  # the coordinator's own words
    assert hold is not None and hold.startswith("waiting for nodes: 0 workers")
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "PENDING" and body["reason"] == hold
    assert client.get("/v1/jobs").json()["items"][0]["reason"] == hold


# Ids ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["", "/history", "/logs"])
def test_malformed_id_is_422_unknown_is_404(make_app: MakeApp, path: str) -> None:
    client, _, _ = make_app()
    r = client.get(f"/v1/jobs/not-an-id{path}")
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "job_id"
    r = client.get(f"/v1/jobs/{'0' * 12}{path}")
    assert r.status_code == 404 and "not found" in r.json()["detail"]
    assert client.post("/v1/jobs/NOTHEX000000/cancel").status_code == 422
    assert client.post(f"/v1/jobs/{'0' * 12}/cancel").status_code == 404


# Cancel -------------------------------------------------------------------------------
def test_cancel_then_409(make_app: MakeApp) -> None:
    client, service, _ = make_app()
    job = _submit(client)
    _sync(service)
    r = client.post(f"/v1/jobs/{job}/cancel", json={"reason": "changed my mind"})
    assert r.status_code == 200
    assert r.json()["state"] == "CANCELLED" and r.json()["reason"] == "changed my mind"
    r = client.post(f"/v1/jobs/{job}/cancel")
    assert r.status_code == 409
    assert r.json()["detail"] == f"job {job} is already CANCELLED"


def test_cancelling_a_finished_job_is_409(make_app: MakeApp) -> None:
    client, service, _ = make_app()
    job = _submit(client, epochs=1)
    _sync(service, 6)
    r = client.post(f"/v1/jobs/{job}/cancel")
    assert r.status_code == 409 and "SUCCEEDED" in r.json()["detail"]


def test_cancel_rejects_bad_reason(make_app: MakeApp) -> None:
    client, _, _ = make_app()
    job = _submit(client)
    assert client.post(f"/v1/jobs/{job}/cancel", json={"reason": ""}).status_code == 422
    assert client.post(f"/v1/jobs/{job}/cancel", json={"why": "x"}).status_code == 422


# Failures of the cluster --------------------------------------------------------------
def test_coordinator_death_fails_the_job_with_reason(make_app: MakeApp) -> None:
    client, service, cluster = make_app()
    job = _submit(client)
    _sync(service)
    cluster.kill(job)
    _sync(service)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "FAILED"
    assert "coordinator actor died" in body["reason"]
    assert body["workers"]  # the last telemetry is kept


def test_launch_errors(make_app: MakeApp) -> None:
    from dynabatch.service.service_errors import ClusterUnavailable, RayCallError

    client, _, cluster = make_app()
    cluster.launch_error = RayCallError("bad resources")
    r = client.post("/v1/jobs", json=SPEC)
    assert r.status_code == 201
    assert r.json()["state"] == "FAILED" and "bad resources" in r.json()["reason"]
    cluster.launch_error = ClusterUnavailable("Ray is gone")
    r = client.post("/v1/jobs", json=SPEC)
    assert r.status_code == 503 and "Ray is gone" in r.json()["detail"]


def test_ray_unreachable_during_sync_keeps_the_job(make_app: MakeApp) -> None:
    client, service, cluster = make_app()
    job = _submit(client)
    _sync(service)
    cluster.unavailable = True
    _sync(service, 3)
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "RUNNING"
    assert client.get("/readyz").status_code == 503
    assert client.get("/readyz").json()["status"] == "unavailable"
    assert client.get("/v1/nodes").status_code == 503
    cluster.unavailable = False
    _sync(service, 12)
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "SUCCEEDED"


# Restart ------------------------------------------------------------------------------
def test_restart_reattaches_running_jobs_and_keeps_finished(make_app: MakeApp) -> None:
    cluster = FakeCluster()  # outlives the API process, like a `ray start` cluster
    client, service, _ = make_app(cluster)
    done = _submit(client, epochs=1)
    running = _submit(client, epochs=4)
    lost = _submit(client, epochs=4)
    _sync(service, 2)  # a step a sync: one epoch each
    assert client.get(f"/v1/jobs/{done}").json()["state"] == "SUCCEEDED"
    _stop(client)
    cluster.kill(lost)  # its coordinator died while the API was down

    client, service, _ = make_app(cluster)
    assert running in cluster.found
    states = {j["job_id"]: j for j in client.get("/v1/jobs").json()["items"]}
    assert states[done]["state"] == "SUCCEEDED"
    assert states[running]["state"] == "RUNNING"
    assert states[lost]["state"] == "FAILED"
    assert "no coordinator actor" in states[lost]["reason"]
    _sync(service, 12)
    body = client.get(f"/v1/jobs/{running}").json()
    assert body["state"] == "SUCCEEDED" and body["epochs_completed"] == 4
    assert len(client.get(f"/v1/jobs/{running}/history").json()["records"]) == 4


def test_embedded_restart_fails_live_jobs_with_reason(make_app: MakeApp) -> None:
    client, service, _ = make_app(FakeCluster(embedded=True))
    job = _submit(client)
    _sync(service)
    # The process dies hard: no lifespan shutdown runs. A new process, a new Ray.
    client, _, _ = make_app(FakeCluster(embedded=True))
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "FAILED" and body["reason"] == EMBEDDED_ENDED


def test_embedded_shutdown_fails_live_jobs(make_app: MakeApp) -> None:
    client, service, _ = make_app(FakeCluster(embedded=True))
    job = _submit(client, epochs=4)  # still running after the shutdown's last sync
    _sync(service)
    _stop(client)
    store = JobStore(service.store.path)
    rec = store.get(job)
    store.close()
    assert rec is not None and rec.state == JobState.FAILED and rec.reason == EMBEDDED_ENDED


def test_embedded_coordinator_gone_during_shutdown_is_the_embedded_end(
        make_app: MakeApp) -> None:
    """A signal to serve's whole process group ends Ray's processes as it ends the API: the
    sync loop may find the coordinator dead before the shutdown runs. That is recorded as
    the embedded Ray's end, not as a coordinator that died on its own."""
    client, service, cluster = make_app(FakeCluster(embedded=True))
    job = _submit(client)
    _sync(service)
    service.reconciler.begin_shutdown()  # serve's signal handler
    cluster.kill(job)
    _sync(service)
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "RUNNING"
    _stop(client)
    store = JobStore(service.store.path)
    rec = store.get(job)
    store.close()
    assert rec is not None and rec.state == JobState.FAILED and rec.reason == EMBEDDED_ENDED


def test_embedded_coordinator_gone_otherwise_is_a_loss(make_app: MakeApp) -> None:
    client, service, cluster = make_app(FakeCluster(embedded=True))
    job = _submit(client)
    _sync(service)
    cluster.kill(job)
    _sync(service)  # waits EMBEDDED_GONE_WAIT_S for a shutdown that does not come
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "FAILED" and "coordinator actor died" in body["reason"]


def test_sync_loop_runs_in_background(make_app: MakeApp) -> None:
    client, _, _ = make_app(sync_interval_s=0.01)
    job = _submit(client, epochs=2)
    deadline = time.monotonic() + 10
    while client.get(f"/v1/jobs/{job}").json()["state"] != "SUCCEEDED":
        assert time.monotonic() < deadline, "the sync loop did not finish the job"
        time.sleep(0.02)


# Nodes and health ---------------------------------------------------------------------
def test_nodes_show_which_jobs_they_host(make_app: MakeApp) -> None:
    client, service, _ = make_app()
    job = _submit(client, workers=3, global_batch=60)
    _sync(service)
    nodes = {n["node_id"]: n for n in client.get("/v1/nodes").json()["nodes"]}
    assert set(nodes) == set(NODE_IDS)
    first = nodes[NODE_IDS[0]]
    assert first["resources"]["CPU"] == 2.0 and first["head"]
    assert first["jobs"] == [{"job_id": job, "name": "digits", "workers": ["w0", "w2"]}]
    assert nodes[NODE_IDS[1]]["jobs"][0]["workers"] == ["w1"]


def test_health_and_readiness(make_app: MakeApp) -> None:
    client, _, _ = make_app()
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


# Auth ---------------------------------------------------------------------------------
def test_token_guards_job_data_and_mutations(make_app: MakeApp) -> None:
    client, _, _ = make_app(api_token="s3cret")
    good = {"Authorization": "Bearer s3cret"}
    for method, path in [
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs"),
        ("GET", f"/v1/jobs/{'0' * 12}"),
        ("GET", f"/v1/jobs/{'0' * 12}/history"),
        ("GET", f"/v1/jobs/{'0' * 12}/logs"),
        ("POST", f"/v1/jobs/{'0' * 12}/cancel"),
        ("POST", f"/v1/jobs/{'0' * 12}/scale"),
        ("DELETE", f"/v1/jobs/{'0' * 12}/workers/w0"),
        ("POST", f"/v1/jobs/{'0' * 12}/resume"),
        ("GET", "/v1/nodes"),
    ]:
        r = client.request(method, path, json=SPEC if method == "POST" else None)
        assert r.status_code == 401, (method, path)
        assert r.headers["www-authenticate"] == "Bearer"
        r = client.request(method, path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, (method, path)
    r = client.post("/v1/jobs", json=SPEC, headers=good)
    assert r.status_code == 201
    assert client.get("/v1/jobs", headers=good).json()["total"] == 1
    # By default health and metrics stay open (probes and scrapers have no token).
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_token_on_health_and_metrics_is_configurable(make_app: MakeApp) -> None:
    client, _, _ = make_app(api_token="s3cret", auth_health=True, auth_metrics=True)
    for path in ("/healthz", "/readyz", "/metrics"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_no_token_configured_means_open(make_app: MakeApp) -> None:
    client, _, _ = make_app(auth_health=True, auth_metrics=True)
    assert client.get("/v1/jobs").status_code == 200
    assert client.get("/metrics").status_code == 200


# Metrics ------------------------------------------------------------------------------
def _documented_metric_names() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Metric names", 1)[1]
    return set(re.findall(r"`(dynabatch_[a-z_]+)", section))


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _exposed_names(text: str) -> set[str]:
    """Names as a PromQL query sees them (counters with ``_total``)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, _kind = line.split()
            names.add(name)
    return names


def test_metrics_answer_200_without_redirect(make_app: MakeApp) -> None:
    client, _, _ = make_app()
    r = client.get("/metrics", follow_redirects=False)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")


def test_metrics_names_are_exactly_the_documented_ones(make_app: MakeApp) -> None:
    client, service, _ = make_app()
    _submit(client)
    _sync(service, 5)
    client.get("/healthz")
    exposed = _exposed_names(client.get("/metrics").text)
    documented = _documented_metric_names()
    assert documented, "docs/architecture.md lists no metric names?"
    assert exposed == documented


def test_metrics_read_live_job_state_at_scrape_time(make_app: MakeApp) -> None:
    client, service, cluster = make_app()
    job = _submit(client, name="metrics-job", policy="dbs", epochs=3)
    _sync(service, 2)  # a step a sync: epoch 1 trained on shares planned from epoch 0
    snap = cluster.coordinators[job].snapshot()
    fams = _families(client.get("/metrics").text)
    batches = {
        s.labels["worker"]: (s.value, s.labels["node"])
        for s in fams["dynabatch_worker_batch_size"].samples
        if s.labels["job_id"] == job
    }
    # The node by its first 8 hex digits, as the CLI and the page show it.
    assert batches == {w.worker: (float(w.batch), w.node[:8]) for w in snap.workers}
    assert {n for _, n in batches.values()} == {NODE_IDS[0][:8], NODE_IDS[1][:8]}
    assert batches["w0"][0] + batches["w1"][0] == 64
    for name in (
        "dynabatch_worker_partition_samples",
        "dynabatch_worker_throughput_samples_per_second",
        "dynabatch_worker_compute_seconds",
        "dynabatch_worker_wait_seconds",
    ):
        assert len(fams[name].samples) == 2, name
    info = fams["dynabatch_job_info"].samples[0]
    assert info.labels == {"job_id": job, "name": "metrics-job", "policy": "dbs"}
    states = {s.labels["state"]: s.value for s in fams["dynabatch_job_state"].samples}
    assert states == {"PENDING": 0, "RUNNING": 1, "SUCCEEDED": 0, "FAILED": 0, "CANCELLED": 0}
    assert fams["dynabatch_job_rebalances"].samples[0].value == snap.rebalances_total
    hist = {
        s.name: s
        for s in fams["dynabatch_job_epoch_duration_seconds"].samples
        if s.name.endswith(("_count", "_sum"))
    }
    assert hist["dynabatch_job_epoch_duration_seconds_count"].value == 2
    assert hist["dynabatch_job_epoch_duration_seconds_sum"].value == pytest.approx(
        sum(snap.epoch_durations_s)
    )
    jobs = {s.labels["state"]: s.value for s in fams["dynabatch_jobs"].samples}
    assert jobs["RUNNING"] == 1
    assert fams["dynabatch_cluster_nodes"].samples[0].value == 2
    assert cluster.coordinators[job].epoch == 2


def test_metrics_and_history_show_each_metric_by_its_name_in_the_spec(
    make_app: MakeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np
    import torch
    from dynabatch.actors.workloads.objective import objective_for

    client, service, cluster = make_app(user_code_modules=PLUGINS)
    metrics = ["accuracy", {"name": "top2", "fn": f"{PLUGINS}:top2_metric"},
               f"{PLUGINS}:top2_metric"]
    job = _submit(client, epochs=3, metrics=metrics)
    # The scores as a worker computes them for this spec (its objective's keys).
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0], [1.0, 3.0, 2.0]])
    scores = evaluate(objective_for(cluster.launches[job][0], "classes"),
        torch.nn.Identity(), logits.numpy(), np.array([1, 1, 1]), torch.device("cpu"))
    scores.pop("loss")
    fake_history = cluster.history

    def history(job_id: str, since: int = 0) -> list[Any]:
        # The simulated job has no model: its records get the scores (and a held-out loss).
        return [r.model_copy(update={"test_metrics": scores, "test_loss": 1.1})
                for r in fake_history(job_id, since)]

    monkeypatch.setattr(cluster, "history", history)
    _sync(service)  # one epoch ends
    fams = _families(client.get("/metrics").text)
    (loss,) = fams["dynabatch_job_test_loss"].samples
    assert loss.labels == {"job_id": job} and loss.value == pytest.approx(1.1)
    exported = {s.labels["metric"]: s.value for s in fams["dynabatch_job_test_metric"].samples}
    want = {"accuracy": pytest.approx(1 / 3), "top2": 1.0, "top2_metric": 1.0}
    assert exported == want
    # The REST history (the page's charts and the CLI's tables read it) names them the same.
    (rec,) = client.get(f"/v1/jobs/{job}/history").json()["records"]
    assert rec["test_metrics"] == want
    # The job's spec reads back as it was written.
    assert client.get(f"/v1/jobs/{job}").json()["spec"]["metrics"] == metrics


def test_an_ended_job_keeps_its_state_series_but_not_its_workers(make_app: MakeApp) -> None:
    client, service, _ = make_app()
    job = _submit(client, epochs=1)
    _sync(service, 6)
    assert service.get(job).state == JobState.SUCCEEDED
    fams = _families(client.get("/metrics").text)
    for name in ("dynabatch_worker_batch_size", "dynabatch_worker_wait_seconds"):
        assert not [s for s in fams[name].samples if s.labels["job_id"] == job], name
    states = {s.labels["state"]: s.value for s in fams["dynabatch_job_state"].samples
              if s.labels["job_id"] == job}
    assert states["SUCCEEDED"] == 1


def test_metrics_scrapes_share_one_store_read_until_it_changes(
    make_app: MakeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, service, _ = make_app(sync_interval_s=30.0)
    job = _submit(client)
    service.reconciler.sync_once()
    reads = {"n": 0}
    live = service.store.live

    def counted() -> list[Any]:
        reads["n"] += 1
        return live()

    monkeypatch.setattr(service.store, "live", counted)
    for _ in range(5):
        assert job in client.get("/metrics").text
    assert reads["n"] == 1  # one read for five scrapes
    service.reconciler.sync_job(job)  # the store changed: the next scrape reads it
    client.get("/metrics")
    assert reads["n"] == 2


def test_concurrent_scrapes_share_one_render_per_interval(
    make_app: MakeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dynabatch.api.metrics

    client, service, _ = make_app(sync_interval_s=30.0)  # the cache lives 1 s at most
    job = _submit(client)
    service.reconciler.sync_once()
    renders = {"n": 0}
    render = dynabatch.api.metrics.generate_latest

    def counted(registry: Any) -> bytes:
        renders["n"] += 1
        return render(registry)

    monkeypatch.setattr(dynabatch.api.metrics, "generate_latest", counted)
    bodies = {client.get("/metrics").text for _ in range(10)}
    assert renders["n"] == 1 and len(bodies) == 1 and job in bodies.pop()
    service.reconciler.sync_job(job)  # a change: rendered again
    client.get("/metrics")
    assert renders["n"] == 2
    time.sleep(1.05)  # never older than the interval
    client.get("/metrics")
    assert renders["n"] == 3


def test_request_metrics_use_route_templates(make_app: MakeApp) -> None:
    client, _, _ = make_app()
    client.get(f"/v1/jobs/{'0' * 12}")
    client.get(f"/v1/jobs/{'1' * 12}")
    client.get("/no/such/path")
    fams = _families(client.get("/metrics").text)
    counts = {
        (s.labels["route"], s.labels["method"], s.labels["status"]): s.value
        for s in fams["dynabatch_http_requests"].samples
    }
    assert counts[("/v1/jobs/{job_id}", "GET", "404")] == 2
    assert counts[("unmatched", "GET", "404")] == 1
    latency = [
        s
        for s in fams["dynabatch_http_request_duration_seconds"].samples
        if s.name.endswith("_count") and s.labels["route"] == "/v1/jobs/{job_id}"
    ]
    assert latency[0].value == 2


def test_finished_jobs_leave_metrics_after_retention(make_app: MakeApp) -> None:
    client, service, _ = make_app(metrics_retention_s=0.0)
    job = _submit(client, epochs=1)
    _sync(service, 6)
    time.sleep(0.01)
    text = client.get("/metrics").text
    assert job not in text
    assert 'dynabatch_jobs{state="SUCCEEDED"} 1.0' in text


def test_apps_have_their_own_registries(tmp_path: Path) -> None:
    a = create_app(Settings(db_path=str(tmp_path / "a.db")), cluster=FakeCluster())
    b = create_app(Settings(db_path=str(tmp_path / "b.db")), cluster=FakeCluster())
    assert a.state.registry is not b.state.registry


def test_create_app_accepts_a_ready_service(tmp_path: Path) -> None:
    cfg = Settings(db_path=str(tmp_path / "c.db"), sync_interval_s=0)
    service = build_service(cfg, FakeCluster())
    with TestClient(create_app(cfg, service=service)) as client:
        assert client.get("/v1/jobs").json()["total"] == 0
        assert service.cluster.ping()


def test_openapi_is_complete(make_app: MakeApp) -> None:
    client, _, _ = make_app()
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    assert set(paths) == {
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/history",
        "/v1/jobs/{job_id}/logs",
        "/v1/jobs/{job_id}/events",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/scale",
        "/v1/jobs/{job_id}/workers/{worker}",
        "/v1/jobs/{job_id}/resume",
        "/v1/jobs/{job_id}/model",
        "/v1/code",
        "/v1/nodes",
        "/v1/cluster",
        "/healthz",
        "/readyz",
        "/metrics",
    }
    upload = paths["/v1/code"]["post"]
    assert {"201", "401", "403", "413", "422"} <= set(upload["responses"])
    assert "application/zip" in upload["requestBody"]["content"]
    post = paths["/v1/jobs"]["post"]
    assert {"201", "401", "413", "422", "503"} <= set(post["responses"])
    assert post["requestBody"]["content"]["application/json"]["examples"]
    assert "409" in paths["/v1/jobs/{job_id}/cancel"]["post"]["responses"]
    scale = paths["/v1/jobs/{job_id}/scale"]["post"]
    assert {"202", "404", "409", "422"} <= set(scale["responses"])
    assert scale["requestBody"]["content"]["application/json"]["examples"]
    drain = paths["/v1/jobs/{job_id}/workers/{worker}"]["delete"]
    assert {"202", "404", "409", "422"} <= set(drain["responses"])
    worker = next(p for p in drain["parameters"] if p["name"] == "worker")
    assert worker["schema"]["pattern"] == "^w[0-9]{1,6}$" and worker["schema"]["examples"]
    assert {"202", "404", "409"} <= set(paths["/v1/jobs/{job_id}/resume"]["post"]["responses"])
    assert "404" in paths["/v1/jobs/{job_id}"]["get"]["responses"]
    model = paths["/v1/jobs/{job_id}/model"]["get"]["responses"]
    assert {"200", "401", "404", "409"} <= set(model) and "application/zip" in model["200"][
        "content"]
    comps = schema["components"]["schemas"]
    assert "JobSpec" in comps and "JobDetail" in comps
    assert comps["JobDetail"].get("example") and comps["JobSpec"].get("examples")
    assert comps["ScaleRequest"].get("example") == {"workers": 3}
    assert "HTTPBearer" in schema["components"]["securitySchemes"]


# Scale and drain ----------------------------------------------------------------------
def _running(client: TestClient, service: JobService, **overrides: Any) -> str:
    job = _submit(client, **overrides)
    _sync(service)
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "RUNNING"
    return job


def _workers(body: dict[str, Any]) -> list[str]:
    return [w["worker"] for w in body["workers"]]


def test_scale_answers_202_with_the_new_membership(make_app: MakeApp) -> None:
    client, service, cluster = make_app()
    job = _running(client, service, workers=3, global_batch=60, epochs=5)
    r = client.post(f"/v1/jobs/{job}/scale", json={"workers": 2})
    assert r.status_code == 202, r.text
    # Queued: the coordinator applies it at its next step boundary.
    assert _workers(r.json()) == ["w0", "w1", "w2"]
    assert ("scale", job) in cluster.calls
    assert service.get(job).target_workers == 2
    _sync(service)
    body = client.get(f"/v1/jobs/{job}").json()
    # The slowest left: w1, alone on the slower node.
    assert _workers(body) == ["w0", "w2"] and sum(w["batch"] for w in body["workers"]) == 60
    assert body["worker_events"]["leave:drained"] == 1
    r = client.post(f"/v1/jobs/{job}/scale", json={"workers": 4})
    assert r.status_code == 202
    # w3 starts on the node w1 left (2 CPUs), w4 beside it at the next node listing: w0
    # and w2 hold the other node's 2 CPUs (the simulator counts them, as Ray does).
    _sync(service, 3)
    assert _workers(client.get(f"/v1/jobs/{job}").json()) == ["w0", "w2", "w3", "w4"]
    assert any("scale requested: 4" in x["message"] for x in client.get(
        f"/v1/jobs/{job}/logs").json()["lines"])


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"workers": 0}, "greater than or equal to 1"),
        ({"workers": 4097}, "less than or equal to 4096"),
        ({"workers": "many"}, "valid integer"),
        ({"workers": 2.5}, "valid integer"),
        ({}, "Field required"),
        ({"workers": 2, "extra": 1}, "unknown field"),
        ({"workers": 65}, "above the job's global_batch (64)"),
    ],
)
def test_scale_rejects_bad_input_with_422(
    make_app: MakeApp, body: dict[str, Any], needle: str
) -> None:
    client, service, cluster = make_app()
    job = _running(client, service)
    r = client.post(f"/v1/jobs/{job}/scale", json=body)
    assert r.status_code == 422, r.text
    assert any(needle in e["msg"] for e in r.json()["detail"]), r.json()
    assert ("scale", job) not in cluster.calls
    assert client.post(f"/v1/jobs/{job}/scale").status_code == 422  # no body


def test_scale_respects_max_batch(make_app: MakeApp) -> None:
    client, service, _ = make_app()
    job = _running(client, service, workers=2, max_batch=32)
    r = client.post(f"/v1/jobs/{job}/scale", json={"workers": 1})
    assert r.status_code == 422
    problem = r.json()["detail"][0]
    assert problem["field"] == "workers" and "max_batch" in problem["msg"]


def test_scale_unknown_job_404_finished_job_409(make_app: MakeApp) -> None:
    client, service, cluster = make_app()
    assert client.post(f"/v1/jobs/{'0' * 12}/scale", json={"workers": 2}).status_code == 404
    assert client.post("/v1/jobs/nope/scale", json={"workers": 2}).status_code == 422
    done = _submit(client, epochs=1)
    _sync(service, 2)
    r = client.post(f"/v1/jobs/{done}/scale", json={"workers": 1})
    assert r.status_code == 409 and r.json()["detail"] == (
        f"job {done} has finished (SUCCEEDED); a finished job cannot be scaled"
    )
    # It finished on the cluster, and the store has not seen it yet: still 409, stored.
    racing = _running(client, service, epochs=3)
    cluster.coordinators[racing].cancel("gone")
    cluster.advance(racing)  # the coordinator ends the job at its next step boundary
    r = client.post(f"/v1/jobs/{racing}/scale", json={"workers": 1})
    assert r.status_code == 409 and "CANCELLED" in r.json()["detail"]
    assert client.get(f"/v1/jobs/{racing}").json()["state"] == "CANCELLED"


def test_drain_removes_one_worker(make_app: MakeApp) -> None:
    client, service, _ = make_app()
    job = _running(client, service, workers=3, global_batch=60, epochs=5)
    r = client.delete(f"/v1/jobs/{job}/workers/w1")
    assert r.status_code == 202, r.text
    assert service.get(job).target_workers == 2
    _sync(service)  # applied at the coordinator's next step boundary
    body = client.get(f"/v1/jobs/{job}").json()
    assert _workers(body) == ["w0", "w2"]
    assert body["worker_events"] == {"join:node available": 3, "leave:drained": 1}
    # No longer a member: 404, naming it.
    r = client.delete(f"/v1/jobs/{job}/workers/w1")
    assert r.status_code == 404 and r.json()["detail"] == (
        f"worker 'w1' is not a member of job {job}"
    )
    assert client.delete(f"/v1/jobs/{job}/workers/w2").status_code == 202
    assert service.get(job).target_workers == 1
    # One left once w2's drain is applied (it is queued): the last is not drained.
    r = client.delete(f"/v1/jobs/{job}/workers/w0")
    assert r.status_code == 409 and r.json()["detail"] == "cannot drain the last worker"
    _sync(service)
    assert _workers(client.get(f"/v1/jobs/{job}").json()) == ["w0"]
    _sync(service, 12)
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "SUCCEEDED"


@pytest.mark.parametrize("worker", ["1", "x1", "w", "W1", "w1234567", "w-1", "w1a"])
def test_drain_rejects_malformed_worker_ids(make_app: MakeApp, worker: str) -> None:
    client, service, cluster = make_app()
    job = _running(client, service)
    r = client.delete(f"/v1/jobs/{job}/workers/{worker}")
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "worker"
    assert ("drain", job) not in cluster.calls


def test_drain_unknown_job_404_finished_job_409(make_app: MakeApp) -> None:
    client, service, _ = make_app()
    assert client.delete(f"/v1/jobs/{'0' * 12}/workers/w0").status_code == 404
    job = _running(client, service)
    client.post(f"/v1/jobs/{job}/cancel")
    r = client.delete(f"/v1/jobs/{job}/workers/w0")
    assert r.status_code == 409 and "CANCELLED" in r.json()["detail"]


def test_drain_when_the_coordinator_died_is_404_and_the_job_fails(make_app: MakeApp) -> None:
    client, service, cluster = make_app()
    job = _running(client, service)
    cluster.kill(job)
    r = client.delete(f"/v1/jobs/{job}/workers/w0")
    assert r.status_code == 404 and "coordinator was lost" in r.json()["detail"]
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "FAILED"


def test_membership_metrics_come_from_the_snapshot(make_app: MakeApp) -> None:
    client, service, cluster = make_app()
    job = _running(client, service, workers=3, global_batch=60, epochs=4)
    client.delete(f"/v1/jobs/{job}/workers/w2")
    _sync(service)  # applied at the coordinator's next step boundary: a regroup
    snap = cluster.coordinators[job].snapshot()
    fams = _families(client.get("/metrics").text)
    events = {
        (s.labels["kind"], s.labels["reason"]): s.value
        for s in fams["dynabatch_job_worker_events"].samples
        if s.labels["job_id"] == job and s.name.endswith("_total")
    }
    assert events == {("join", "node available"): 3.0, ("leave", "drained"): 1.0}
    assert fams["dynabatch_job_workers"].samples[0].value == 2
    assert fams["dynabatch_job_membership_generation"].samples[0].value == 2
    regroups = fams["dynabatch_job_regroup_seconds"].samples[0].value
    assert regroups == pytest.approx(snap.regroup_seconds_total) and regroups > 0
    assert fams["dynabatch_job_retried_samples"].samples[0].value == 0


def test_worker_event_reasons_with_colons_stay_whole() -> None:
    from dynabatch.api.metrics import JobCollector
    from dynabatch.scheduler.telemetry import JobSnapshot

    snap = JobSnapshot(
        job_id="j",
        name="n",
        state=JobState.RUNNING,
        generation=4,
        regroup_seconds_total=1.5,
        retried_samples_total=96,
        worker_events={"failure:failed while joining: timeout": 2, "join:node available": 3},
    )
    fams = {f.name: f for f in JobCollector._job_families([snap])}
    samples = {
        (s.labels["kind"], s.labels["reason"]): s.value
        for s in fams["dynabatch_job_worker_events"].samples
    }
    assert samples == {
        ("failure", "failed while joining: timeout"): 2.0,
        ("join", "node available"): 3.0,
    }
    assert fams["dynabatch_job_membership_generation"].samples[0].value == 4
    assert fams["dynabatch_job_regroup_seconds"].samples[0].value == 1.5
    assert fams["dynabatch_job_retried_samples"].samples[0].value == 96


# Resume -------------------------------------------------------------------------------
def _ckpt_spec(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    return {"checkpoint": {"dir": str(tmp_path / "ckpt")}, "epochs": 3, **overrides}


def _checkpointed(tmp_path: Path, job: str) -> Path:
    """The checkpoint the job's coordinator wrote (at the end of each epoch)."""
    path = checkpoint_path(tmp_path / "ckpt", job)
    assert path.is_file(), f"no checkpoint of job {job}"
    return path


def test_dead_coordinator_with_a_checkpoint_is_resumed(
    make_app: MakeApp, tmp_path: Path
) -> None:
    client, service, cluster = make_app()
    job = _submit(client, **_ckpt_spec(tmp_path))
    _sync(service)  # epoch 0 trained and checkpointed
    _checkpointed(tmp_path, job)
    before = client.get(f"/v1/jobs/{job}/logs").json()["lines"]
    cluster.kill(job)
    _sync(service)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "PENDING" and body["resumes"] == 1
    assert "coordinator actor died" in body["reason"]
    assert "resuming from its checkpoint (automatic resume 1 of 3)" in body["reason"]
    assert body["workers"] == []  # they died with the coordinator
    assert len(cluster.launches[job]) == 2
    _sync(service, 12)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "SUCCEEDED" and body["resumes"] == 1
    assert [r["epoch"] for r in client.get(f"/v1/jobs/{job}/history").json()["records"]] == [
        0,
        1,
        2,
    ]
    # The earlier coordinator's lines are kept; the resume and the new ones follow.
    lines = client.get(f"/v1/jobs/{job}/logs").json()["lines"]
    assert lines[: len(before)] == before
    assert [x["seq"] for x in lines] == list(range(len(lines)))
    messages = [x["message"] for x in lines]
    i = next(i for i, m in enumerate(messages) if "automatic resume 1 of 3" in m)
    assert lines[i]["level"] == "WARNING"
    assert messages[i + 1] == "resuming from checkpoint at epoch 1 step 0"
    assert messages[-1] == "state SUCCEEDED"
    assert service.get(job).auto_resumes == 0  # it finished epochs after the resume


def test_dead_coordinator_without_a_checkpoint_fails(make_app: MakeApp, tmp_path: Path) -> None:
    client, service, cluster = make_app()
    job = _submit(client, **_ckpt_spec(tmp_path))  # a checkpoint dir, but no file yet
    cluster.kill(job)  # before its coordinator's first step
    assert not checkpoint_path(tmp_path / "ckpt", job).exists()
    _sync(service)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "FAILED" and "coordinator actor died" in body["reason"]
    assert body["resumes"] == 0 and len(cluster.launches[job]) == 1


def test_a_crash_loop_ends_failed_after_the_limit(make_app: MakeApp, tmp_path: Path) -> None:
    # Its coordinators step only when told: each resumed one dies before finishing an epoch.
    cluster = FakeCluster(auto_advance=False)
    client, service, _ = make_app(cluster, auto_resume_limit=2)
    job = _submit(client, **_ckpt_spec(tmp_path))
    cluster.advance(job)  # epoch 0 trained and checkpointed
    _sync(service)
    _checkpointed(tmp_path, job)
    for attempt in (1, 2):
        cluster.kill(job)
        _sync(service)  # resumed
        assert f"automatic resume {attempt} of 2" in service.get(job).reason
        _sync(service)
    cluster.kill(job)
    _sync(service)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "FAILED" and body["resumes"] == 2
    assert body["reason"].endswith(
        "not resumed again: 2 automatic resumes without finishing an epoch (limit 2)"
    )
    assert len(cluster.launches[job]) == 3


def test_auto_resume_can_be_turned_off(make_app: MakeApp, tmp_path: Path) -> None:
    client, service, cluster = make_app(auto_resume_limit=0)
    job = _submit(client, **_ckpt_spec(tmp_path))
    _sync(service)  # epoch 0 trained and checkpointed
    _checkpointed(tmp_path, job)
    cluster.kill(job)
    _sync(service)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "FAILED" and "automatic resume is off" in body["reason"]


def test_a_resumed_job_keeps_the_size_asked_for(make_app: MakeApp, tmp_path: Path) -> None:
    client, service, cluster = make_app()
    job = _submit(client, **_ckpt_spec(tmp_path, workers=3, global_batch=60, min_workers=2))
    _sync(service)
    _checkpointed(tmp_path, job)
    assert client.post(f"/v1/jobs/{job}/scale", json={"workers": 1}).status_code == 202
    cluster.kill(job)
    _sync(service, 2)
    spec = cluster.launches[job][-1]
    assert (spec.workers, spec.max_workers, spec.min_workers) == (1, 1, 1)
    assert len(_workers(client.get(f"/v1/jobs/{job}").json())) == 1
    assert client.get(f"/v1/jobs/{job}").json()["spec"]["workers"] == 3  # as submitted


def test_scale_after_the_coordinator_died_applies_to_the_resumed_one(
    make_app: MakeApp, tmp_path: Path
) -> None:
    client, service, cluster = make_app()
    job = _submit(client, **_ckpt_spec(tmp_path))
    _sync(service)
    _checkpointed(tmp_path, job)
    cluster.kill(job)
    r = client.post(f"/v1/jobs/{job}/scale", json={"workers": 1})
    assert r.status_code == 202 and r.json()["state"] == "PENDING" and r.json()["resumes"] == 1
    assert cluster.launches[job][-1].workers == 1


def test_resume_on_request(make_app: MakeApp, tmp_path: Path) -> None:
    client, service, cluster = make_app(auto_resume_limit=0)
    job = _submit(client, **_ckpt_spec(tmp_path))
    _sync(service)  # epoch 0 trained and checkpointed
    # Live with its coordinator: nothing to resume.
    _checkpointed(tmp_path, job)
    r = client.post(f"/v1/jobs/{job}/resume")
    assert r.status_code == 409 and "coordinator is alive" in r.json()["detail"]
    cluster.kill(job)
    _sync(service)
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "FAILED"
    r = client.post(f"/v1/jobs/{job}/resume")
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["state"] == "PENDING" and body["resumes"] == 1 and body["finished_at"] is None
    assert body["reason"].startswith("resume requested; job was FAILED (the job's coordinator")
    _sync(service, 12)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "SUCCEEDED" and body["epochs_completed"] == 3
    r = client.post(f"/v1/jobs/{job}/resume")
    assert r.status_code == 409 and "has finished (SUCCEEDED)" in r.json()["detail"]


def test_resume_of_a_live_job_whose_coordinator_is_gone(
    make_app: MakeApp, tmp_path: Path
) -> None:
    client, service, cluster = make_app()
    job = _submit(client, **_ckpt_spec(tmp_path))
    _sync(service)
    _checkpointed(tmp_path, job)
    cluster.kill(job)  # not seen by a sync yet
    r = client.post(f"/v1/jobs/{job}/resume")
    assert r.status_code == 202 and r.json()["state"] == "PENDING"
    assert service.get(job).auto_resumes == 0


def test_resume_conflicts(make_app: MakeApp, tmp_path: Path) -> None:
    client, service, cluster = make_app(auto_resume_limit=0)
    assert client.post(f"/v1/jobs/{'0' * 12}/resume").status_code == 404
    assert client.post("/v1/jobs/xyz/resume").status_code == 422
    plain = _submit(client)  # no checkpoint dir
    _sync(service)
    cluster.kill(plain)
    _sync(service)
    r = client.post(f"/v1/jobs/{plain}/resume")
    assert r.status_code == 409 and "no checkpoint.dir" in r.json()["detail"]
    no_file = _submit(client, **_ckpt_spec(tmp_path))
    cluster.kill(no_file)  # before its coordinator's first step
    _sync(service)
    r = client.post(f"/v1/jobs/{no_file}/resume")
    assert r.status_code == 409 and "no checkpoint yet" in r.json()["detail"]
    cancelled = _submit(client, **_ckpt_spec(tmp_path))  # cancelled before a checkpoint
    client.post(f"/v1/jobs/{cancelled}/cancel")
    r = client.post(f"/v1/jobs/{cancelled}/resume")
    assert r.status_code == 409 and "no checkpoint yet" in r.json()["detail"]


def test_a_cancelled_job_resumes_from_its_checkpoint(make_app: MakeApp, tmp_path: Path) -> None:
    client, service, cluster = make_app()
    job = _submit(client, **_ckpt_spec(tmp_path))
    _sync(service)  # epoch 0 trained and checkpointed
    _checkpointed(tmp_path, job)  # as the coordinator writes one on cancel
    assert client.post(f"/v1/jobs/{job}/cancel").json()["state"] == "CANCELLED"
    assert cluster.released == [job]
    r = client.post(f"/v1/jobs/{job}/resume")
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["state"] == "PENDING" and body["resumes"] == 1 and body["finished_at"] is None
    assert body["reason"].startswith("resume requested; job was CANCELLED (cancelled by user)")
    _sync(service, 12)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "SUCCEEDED" and body["epochs_completed"] == 3
    messages = [x["message"] for x in client.get(f"/v1/jobs/{job}/logs").json()["lines"]]
    assert "resuming from checkpoint at epoch 1 step 0" in messages


def test_resume_launch_failure_leaves_the_job_failed(make_app: MakeApp, tmp_path: Path) -> None:
    from dynabatch.service.service_errors import RayCallError

    client, service, cluster = make_app(auto_resume_limit=0)
    job = _submit(client, **_ckpt_spec(tmp_path))
    _sync(service)
    _checkpointed(tmp_path, job)
    cluster.kill(job)
    _sync(service)
    cluster.launch_error = RayCallError("no head node")
    r = client.post(f"/v1/jobs/{job}/resume")
    assert r.status_code == 502
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "FAILED" and "could not start a new coordinator" in body["reason"]


def test_restart_resumes_jobs_whose_coordinator_is_gone(
    make_app: MakeApp, tmp_path: Path
) -> None:
    cluster = FakeCluster()
    client, service, _ = make_app(cluster)
    saved = _submit(client, **_ckpt_spec(tmp_path))
    lost = _submit(client)
    _sync(service)  # epoch 0 trained and checkpointed
    _checkpointed(tmp_path, saved)
    _stop(client)
    cluster.kill(saved)
    cluster.kill(lost)
    client, service, _ = make_app(cluster)
    jobs = {j["job_id"]: j for j in client.get("/v1/jobs").json()["items"]}
    assert jobs[lost]["state"] == "FAILED"
    assert jobs[saved]["state"] == "PENDING" and "lost while the API was down" in (
        jobs[saved]["reason"]
    )
    assert len(cluster.launches[saved]) == 2
    _sync(service, 12)
    body = client.get(f"/v1/jobs/{saved}").json()
    assert body["state"] == "SUCCEEDED" and body["resumes"] == 1


@pytest.mark.parametrize(
    ("allowed", "now", "field"),
    [
        ({}, {"checkpoint_root": "/elsewhere"}, "checkpoint.dir"),
        ({"user_code_modules": "tests"}, {}, "model.name"),
    ],
)
def test_a_spec_the_settings_no_longer_allow_is_not_resumed(
    make_app: MakeApp, tmp_path: Path, allowed: dict[str, str], now: dict[str, str], field: str
) -> None:
    cluster = FakeCluster()
    client, service, _ = make_app(cluster, **allowed)
    extra = {"model": USER_CODE["model"]} if allowed else {}
    job = _submit(client, **_ckpt_spec(tmp_path, **extra))
    _sync(service)  # epoch 0 trained and checkpointed
    _checkpointed(tmp_path, job)
    _stop(client)
    cluster.kill(job)
    # The API comes back with settings that no longer allow what the stored spec names.
    client, service, _ = make_app(cluster, **now)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "FAILED" and body["resumes"] == 0
    assert f"not resumed: its spec is not allowed by this service's settings ({field}: " in (
        body["reason"]
    )
    r = client.post(f"/v1/jobs/{job}/resume")
    assert r.status_code == 409, r.text
    assert r.json()["detail"].startswith(f"job {job} cannot be resumed: its spec is not allowed")
    assert len(cluster.launches[job]) == 1, "launched once, at submit time"


def test_embedded_restart_resumes_checkpointed_jobs(make_app: MakeApp, tmp_path: Path) -> None:
    client, service, first = make_app(FakeCluster(embedded=True))
    saved = _submit(client, **_ckpt_spec(tmp_path))
    plain = _submit(client, epochs=4)  # still running at the shutdown
    _sync(service)  # epoch 0 trained and checkpointed
    _checkpointed(tmp_path, saved)
    _stop(client)  # a clean shutdown: Ray ends with the process
    # Their coordinators were stopped after the last sync, not left to train and log
    # until Ray's own end, unread.
    assert first.coordinators == {} and set(first.released) == {saved, plain}
    store = JobStore(service.store.path)  # the app closed its own
    rec, failed = store.get(saved), store.get(plain)
    store.close()
    assert rec is not None and rec.state == JobState.PENDING
    assert "resumes from its checkpoint when the API starts again" in (rec.reason or "")
    assert failed is not None and failed.state == JobState.FAILED
    assert failed.reason == EMBEDDED_ENDED

    cluster = FakeCluster(embedded=True)  # a new process, a new Ray
    client, service, _ = make_app(cluster)
    body = client.get(f"/v1/jobs/{saved}").json()
    assert body["state"] == "PENDING" and body["resumes"] == 1
    assert body["reason"].startswith(EMBEDDED_ENDED)
    assert saved in cluster.coordinators
    _sync(service, 12)
    assert client.get(f"/v1/jobs/{saved}").json()["state"] == "SUCCEEDED"


def test_embedded_hard_restart_resumes_checkpointed_jobs(
    make_app: MakeApp, tmp_path: Path
) -> None:
    client, service, _ = make_app(FakeCluster(embedded=True))
    job = _submit(client, **_ckpt_spec(tmp_path))
    _sync(service)
    _checkpointed(tmp_path, job)
    # The process dies hard: no lifespan shutdown runs.
    client, service, cluster = make_app(FakeCluster(embedded=True))
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "PENDING" and body["resumes"] == 1
    assert job in cluster.coordinators


def test_resume_replaces_a_failed_jobs_kept_coordinator(
    make_app: MakeApp, tmp_path: Path
) -> None:
    client, service, cluster = make_app(release_finished=False)
    job = _submit(client, **_ckpt_spec(tmp_path))
    _sync(service)  # epoch 0 trained and checkpointed
    _checkpointed(tmp_path, job)
    cluster.coordinators[job].finish(JobState.FAILED, "only 1 workers available")
    _sync(service)
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "FAILED"
    assert job in cluster.coordinators  # kept: release_finished is off
    r = client.post(f"/v1/jobs/{job}/resume")
    assert r.status_code == 202, r.text
    assert "only 1 workers available" in r.json()["reason"]
    assert cluster.released == [job] and len(cluster.launches[job]) == 2


def test_a_coordinator_killed_outside_ray_is_resumed_under_a_new_generation(
    make_app: MakeApp, tmp_path: Path
) -> None:
    cluster = FakeCluster()
    client, service, _ = make_app(cluster)
    job = _submit(client, **_ckpt_spec(tmp_path))
    _sync(service)  # epoch 0 trained and checkpointed
    _checkpointed(tmp_path, job)
    cluster.kill(job, keep_name=True)  # kill -9 of its process: Ray keeps the name taken
    _sync(service)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "PENDING", body["reason"]
    assert body["resumes"] == 1 and cluster.generations[job] == 1
    # An API restart finds the coordinator under the generation the store recorded.
    _stop(client)
    client, service, _ = make_app(cluster)
    assert job in cluster.found and len(cluster.launches[job]) == 2
    _sync(service, 12)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["state"] == "SUCCEEDED" and body["resumes"] == 1


def test_a_job_resumed_on_another_cluster_is_found_there_after_a_restart(
    make_app: MakeApp, tmp_path: Path
) -> None:
    client, service, _ = make_app(FakeCluster(embedded=True))
    job = _submit(client, **_ckpt_spec(tmp_path))
    _sync(service)
    _checkpointed(tmp_path, job)
    # The API comes back on an external cluster: the job is resumed there...
    external = FakeCluster()
    client, service, _ = make_app(external)
    assert service.get(job).cluster == external.address
    _sync(service)
    # ...and after the next restart it is re-attached there, not resumed a second time.
    client, service, _ = make_app(external)
    assert job in external.found and len(external.launches[job]) == 1
    assert client.get(f"/v1/jobs/{job}").json()["resumes"] == 1


# Parameter-server jobs (protocol ps) ----------------------------------------------------
PS = {"name": "ps", "mode": "async"}


@pytest.mark.parametrize(
    ("protocol", "extra", "field", "needle"),
    [
        ({**PS, "on_stale": "wait"}, {}, "protocol.on_stale", "needs max_staleness"),
        ({**PS, "mode": "softsync", "n": 3}, {}, "protocol.n", "greater than the number"),
        ({**PS, "max_staleness": -1}, {}, "protocol.max_staleness", "greater than or equal"),
        ({**PS, "shards": 0}, {}, "protocol.shards", "greater than or equal to 1"),
        (PS, {"dataset": {"name": "pysource"}}, "dataset.name", "classification"),
    ],
)
def test_ps_spec_422_names_the_field(
    make_app: MakeApp, protocol: dict, extra: dict, field: str, needle: str
) -> None:
    client, _, cluster = make_app()
    r = client.post("/v1/jobs", json={**SPEC, **extra, "protocol": protocol})
    assert r.status_code == 422
    mine = [e for e in r.json()["detail"] if e["field"] == field]
    assert mine and needle in mine[0]["msg"], r.json()
    assert not cluster.coordinators


def test_ps_hardsync_staleness_options_are_accepted_with_a_warning(make_app: MakeApp) -> None:
    client, _, _ = make_app()
    r = client.post("/v1/jobs", json={**SPEC, "protocol": {
        "name": "ps", "mode": "hardsync", "max_staleness": 2}})
    assert r.status_code == 201
    assert r.json()["warnings"] == [
        "protocol.max_staleness is ignored by mode hardsync (staleness is always 0)"]


def test_get_job_shows_the_parameter_server(make_app: MakeApp) -> None:
    from dynabatch.scheduler.telemetry import PSStatus, PSWorkerStatus

    client, service, cluster = make_app()
    job = _submit(client, protocol=PS)
    fake = cluster.coordinators[job]
    ps = PSStatus(mode="async", version=7, applied=7, refused=1, deferred=0, pushes=8,
                  pushes_per_s=3.5, workers=[
                      PSWorkerStatus(worker="w0", batch=32, pushes=4, applied=4, refused=0,
                                     staleness_mean=0.5, staleness_max=1,
                                     staleness_counts={0: 2, 1: 2})])
    plain = fake.snapshot
    fake.snapshot = lambda: plain().model_copy(update={"ps": ps})
    _sync(service)
    body = client.get(f"/v1/jobs/{job}").json()
    assert body["spec"]["protocol"]["name"] == "ps"
    assert body["ps"]["version"] == 7 and body["ps"]["pushes_per_s"] == 3.5
    assert body["ps"]["workers"][0]["staleness_counts"] == {"0": 2, "1": 2}

"""What people see of the cluster scheduler: ``GET /v1/cluster``, ``dynabatch cluster``, a
queued job's status, the cluster metrics, and bad input (issue 31, items 5 and 8).

The app runs on a fake cluster (tests/fakes.py); the scheduler's round is a real
``decide(...)`` over the jobs the app stored, read through ``view_of`` and handed to the
service as its ``cluster_view()``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from dynabatch.actors.spec import JobSpec
from dynabatch.api.app import create_app
from dynabatch.api.cli import cluster_commands as cluster_cli
from dynabatch.api.cli import job_commands as jobs_cli
from dynabatch.scheduler.core.cluster.decision import decide
from dynabatch.scheduler.core.cluster.throughput import ThroughputModel
from dynabatch.scheduler.core.cluster.values import ClusterJob, ClusterKnobs, ClusterNode
from dynabatch.scheduler.core.cluster.view import ClusterView, view_of
from dynabatch.service.job_service import JobService
from dynabatch.service.rest_client import DynabatchClient
from dynabatch.service.settings import Settings
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from tests.asgi import AppTransport
from tests.fakes import FakeCluster

SPEC = {"name": "digits", "workers": 2, "global_batch": 64, "epochs": 2}
NODES = (ClusterNode("n1", "H100", 2), ClusterNode("n2", "cpu", 2))
MODEL = ThroughputModel.of(
    {"H100": 100.0, "cpu": 20.0}, measured=["H100"], overhead_s=0.01, global_batch=64
)


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Callable[..., tuple[TestClient, JobService]]]:
    clients: list[TestClient] = []

    def make(**settings: Any) -> tuple[TestClient, JobService]:
        options = {
            "db_path": str(tmp_path / "jobs.db"),
            "sync_interval_s": 0.0,
            "checkpoint_root": str(tmp_path),
            **settings,
        }
        application = create_app(Settings(**options), cluster=FakeCluster(auto_advance=False))
        client = TestClient(application)
        client.__enter__()
        clients.append(client)
        return client, application.state.service

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def _submit(client: TestClient, **overrides: Any) -> str:
    r = client.post("/v1/jobs", json={**SPEC, **overrides})
    assert r.status_code == 201, r.text
    return r.json()["job_id"]


def _round(job_ids: list[str]) -> ClusterView:
    """A real round over 4 slots: the first job (3-4 workers) runs, the others (2 and 3
    workers) wait, in submit order."""
    sizes = [(3, 4), (2, 2), (3, 3)]
    jobs = [
        ClusterJob(j, lo, hi, MODEL, submit_s=float(i))
        for i, (j, (lo, hi)) in enumerate(zip(job_ids, sizes, strict=True))
    ]
    decision = decide(NODES, jobs, 10.0, ClusterKnobs())
    return view_of(NODES, jobs, decision, round_no=7, decided_s=10.0, resizes=2)


def _with_round(
    client: TestClient, service: JobService, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[str], ClusterView]:
    ids = [_submit(client, name=f"job{i}") for i in range(3)]
    view = _round(ids)
    monkeypatch.setattr(service, "cluster_view", lambda: view)
    return ids, view


def _invoke(http: TestClient, *args: str) -> Any:
    cli = typer.Typer(pretty_exceptions_enable=False)
    jobs_cli.register(cli)
    cluster_cli.register(cli)

    def factory(url: str, token: str | None) -> DynabatchClient:
        return DynabatchClient(url, token=token, transport=AppTransport(http))

    result = CliRunner().invoke(cli, list(args), obj={"client_factory": factory})
    assert "Traceback" not in result.output, result.output
    return result


# GET /v1/cluster ----------------------------------------------------------------------
def test_cluster_without_a_scheduler_is_an_honest_empty_answer(app) -> None:
    client, _ = app()
    r = client.get("/v1/cluster")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["scheduler"] is None
    assert body["nodes"] == body["queue"] == body["jobs"] == []
    assert "no cluster scheduler runs" in body["message"]


def test_cluster_lists_nodes_queue_allocations_and_speeds(app, monkeypatch) -> None:
    client, service = app()
    (a, b, c), _ = _with_round(client, service, monkeypatch)
    body = client.get("/v1/cluster").json()
    assert body["scheduler"] == {
        "policy": "goodput",
        "round": 7,
        "decided_s": 10.0,
        "capacity": 4,
        "used": 4,
        "utilization": 1.0,
        "resizes": 2,
    }
    assert body["message"] is None
    assert [
        (n["node_id"], n["node_type"], n["capacity"], n["used"], n["jobs"]) for n in body["nodes"]
    ] == [
        ("n1", "H100", 2, 2, [{"job_id": a, "workers": 2}]),
        ("n2", "cpu", 2, 2, [{"job_id": a, "workers": 2}]),
    ]
    assert [(q["position"], q["job_id"]) for q in body["queue"]] == [(1, b), (2, c)]
    assert body["queue"][0]["reason"].startswith("queued: position 1 of 2 (min_workers 2")
    jobs = {j["job_id"]: j for j in body["jobs"]}
    assert jobs[a]["workers"] == 4 and jobs[a]["position"] is None
    assert jobs[a]["by_type"] == {"H100": 2, "cpu": 2}
    assert jobs[a]["allocation"] == [
        {"node_id": "n1", "workers": 2},
        {"node_id": "n2", "workers": 2},
    ]
    assert jobs[a]["speed"] == [
        {"node_type": "H100", "samples_per_s": 100.0, "measured": True},
        {"node_type": "cpu", "samples_per_s": 20.0, "measured": False},
    ]
    assert jobs[b]["workers"] == 0 and jobs[b]["position"] == 1


def test_cluster_needs_the_token(app) -> None:
    client, _ = app(api_token="s3cret")
    assert client.get("/v1/cluster").status_code == 401
    ok = client.get("/v1/cluster", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


# A queued job's status says why ----------------------------------------------------------
def test_a_queued_jobs_status_says_why(app, monkeypatch) -> None:
    client, service = app()
    (a, b, c), view = _with_round(client, service, monkeypatch)
    why_c = view.job(c).reason
    assert why_c.startswith("queued: position 2 of 2 (")
    assert client.get(f"/v1/jobs/{c}").json()["reason"] == why_c
    listed = {j["job_id"]: j["reason"] for j in client.get("/v1/jobs").json()["items"]}
    assert listed[c] == why_c and listed[b] == view.job(b).reason
    assert listed[a] != view.job(a).reason  # a running job keeps its own reason
    # The job page reads the same record through its event stream.
    with client.stream("GET", f"/v1/jobs/{c}/events", params={"interval_s": 0.02}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                assert json.loads(line[5:])["reason"] == why_c
                break
    out = _invoke(client, "status", c)
    assert out.exit_code == 0, out.output
    assert "queued: position 2 of 2" in " ".join(out.stdout.split())


def test_a_cached_status_follows_the_queue(app, monkeypatch) -> None:
    client, service = app()
    (_, b, c), _ = _with_round(client, service, monkeypatch)
    late = _submit(client, name="late")
    first = client.get(f"/v1/jobs/{c}")
    assert first.json()["reason"].startswith("queued: position 2 of 2")
    listed = client.get("/v1/jobs")
    # The next round queues it first; the store did not change, yet the kept answers must
    # not be served.
    moved = _round([b, c, late])
    assert moved.job(c).reason.startswith("queued: position 1 of 2")
    monkeypatch.setattr(service, "cluster_view", lambda: moved)
    again = client.get(f"/v1/jobs/{c}", headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 200
    assert again.json()["reason"] == moved.job(c).reason
    relisted = client.get("/v1/jobs", headers={"If-None-Match": listed.headers["etag"]})
    assert relisted.status_code == 200
    reasons = {j["job_id"]: j["reason"] for j in relisted.json()["items"]}
    assert reasons[c] == moved.job(c).reason and reasons[late] == moved.job(late).reason


# dynabatch cluster ----------------------------------------------------------------------
def test_cli_cluster_prints_nodes_and_queue(app, monkeypatch) -> None:
    client, service = app()
    (a, b, c), _ = _with_round(client, service, monkeypatch)
    out = _invoke(client, "cluster")
    assert out.exit_code == 0, out.output
    text = out.stdout
    # What is in use of what is offered: GPUs on a GPU node, CPUs on the others (a node's
    # workers of half a CPU are 4 on 2 CPUs: not "slots 2/2" beside 4 workers).
    assert "policy goodput  round 7  in use 4/4  utilization 1.00  resizes 2" in text
    assert "in use" in next(x for x in text.splitlines() if "node" in x and "jobs" in x)
    rows = [
        [c.strip() for c in x.strip().strip("│").split("│")]
        for x in text.splitlines()
        if x.startswith("│")
    ]
    assert rows[:2] == [["n1", "H100", "2/2", f"{a} (2)"], ["n2", "cpu", "2/2", f"{a} (2)"]]
    # The placed job: its allocation; no report from it yet.
    assert rows[2] == [a, "4 (n1: 2, n2: 2)", "-", "-"]
    assert [r[:3] for r in rows[3:]] == [["1", b, "0"], ["2", c, "0"]]
    assert rows[4][3].startswith("queued: position 2 of 2 (min_workers 3")


def test_a_jobs_allocation_and_its_members_are_shown_side_by_side(app, monkeypatch) -> None:
    """Views show facts: the scheduler's allocation, the members the job reported and why
    they differ, in REST, the CLI and /metrics alike."""
    client, service = app()
    ids = [_submit(client, name=f"job{i}") for i in range(3)]
    a = ids[0]
    base = _round(ids)
    jobs = [
        ClusterJob(j, lo, hi, MODEL, submit_s=float(i))
        for i, (j, (lo, hi)) in enumerate(zip(ids, [(3, 4), (2, 2), (3, 3)], strict=True))
    ]
    decision = decide(NODES, jobs, 10.0, ClusterKnobs())
    why = "starting 1 worker on node n2"
    view = view_of(NODES, jobs, decision, round_no=7, decided_s=10.0,
                   facts={a: ((("n1", 2), ("n2", 1)), why, None)})
    assert view.job(a).allocation == base.job(a).allocation
    monkeypatch.setattr(service, "cluster_view", lambda: view)
    entry = next(j for j in client.get("/v1/cluster").json()["jobs"] if j["job_id"] == a)
    assert entry["allocation"] == [{"node_id": "n1", "workers": 2}, {"node_id": "n2", "workers": 2}]
    assert entry["members"] == [{"node_id": "n1", "workers": 2}, {"node_id": "n2", "workers": 1}]
    assert (entry["workers"], entry["differs"], entry["waits"]) == (4, why, None)
    out = _invoke(client, "cluster")
    assert out.exit_code == 0, out.output
    row = next(x for x in out.stdout.splitlines() if x.startswith(f"│ {a}"))
    cells = [c.strip() for c in row.strip().strip("│").split("│")]
    assert cells == [a, "4 (n1: 2, n2: 2)", "3 (n1: 2, n2: 1)", why]
    samples = {
        (s.name, s.labels.get("job_id")): s.value
        for f in text_string_to_metric_families(client.get("/metrics").text)
        for s in f.samples
    }
    assert samples[("dynabatch_cluster_member_workers", a)] == 3.0
    assert ("dynabatch_cluster_member_workers", ids[1]) not in samples  # queued: none


def test_cli_cluster_json_is_the_rest_answer(app, monkeypatch) -> None:
    client, service = app()
    _with_round(client, service, monkeypatch)
    out = _invoke(client, "cluster", "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == client.get("/v1/cluster").json()


def test_cli_cluster_without_a_scheduler_says_so(app) -> None:
    client, _ = app()
    out = _invoke(client, "cluster")
    assert out.exit_code == 0, out.output
    assert out.stdout.strip().startswith("no cluster scheduler runs")


# Metrics ------------------------------------------------------------------------------
def test_cluster_metrics_read_the_round(app, monkeypatch) -> None:
    client, service = app()
    (a, _, _), _ = _with_round(client, service, monkeypatch)
    fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert fams["dynabatch_cluster_queue_length"].samples[0].value == 2
    assert fams["dynabatch_cluster_utilization_ratio"].samples[0].value == 1.0
    assert fams["dynabatch_cluster_resizes"].samples[0].value == 2
    alloc = {
        (s.labels["job_id"], s.labels["node_type"]): s.value
        for s in fams["dynabatch_cluster_allocated_workers"].samples
    }
    assert alloc == {(a, "H100"): 2.0, (a, "cpu"): 2.0}


def test_cluster_metrics_are_empty_without_a_scheduler(app) -> None:
    client, _ = app()
    fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in (
        "dynabatch_cluster_queue_length",
        "dynabatch_cluster_utilization_ratio",
        "dynabatch_cluster_resizes",
        "dynabatch_cluster_allocated_workers",
    ):
        assert fams[name].samples == [], name


# Bad input (item 8) ---------------------------------------------------------------------
@pytest.mark.parametrize("priority", [1001, -1001])
def test_priority_out_of_range_is_a_422_naming_the_field(app, priority: int) -> None:
    client, _ = app()
    r = client.post("/v1/jobs", json={**SPEC, "priority": priority})
    assert r.status_code == 422
    assert [d["field"] for d in r.json()["detail"]] == ["priority"]


def test_cli_submit_names_priority_out_of_range(app, tmp_path: Path) -> None:
    client, _ = app()
    config = tmp_path / "job.yaml"
    config.write_text("name: p\npriority: 5000\n")
    out = _invoke(client, "submit", str(config), "--no-wait")
    assert out.exit_code == 1
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "priority" in lines[0]


def test_serve_names_an_unknown_cluster_policy_in_one_line(monkeypatch) -> None:
    monkeypatch.setenv("DYNABATCH_CLUSTER_POLICY", "biggest")
    cli = typer.Typer(pretty_exceptions_enable=False)
    jobs_cli.register(cli)
    result = CliRunner().invoke(cli, ["serve"])
    assert "Traceback" not in result.output
    assert result.exit_code == 1
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, result.stderr
    assert "DYNABATCH_CLUSTER_POLICY" in lines[0] and "'fifo', 'fair' or 'goodput'" in lines[0]


def test_min_workers_no_node_set_can_meet_is_refused_at_submit(app) -> None:
    client, service = app()  # two nodes of 2 CPUs: 4 workers of 1 CPU at most
    r = client.post("/v1/jobs", json={**SPEC, "workers": 5, "min_workers": 5})
    assert r.status_code == 422, r.text
    (problem,) = r.json()["detail"]
    assert problem["field"] == "min_workers"
    assert problem["msg"] == (
        "min_workers 5: the cluster has 4 worker slots; the job could never start"
    )
    assert service.list()[1] == 0  # nothing stored
    # Bigger workers hold fewer slots: 2 CPUs each fit one per node.
    r = client.post("/v1/jobs", json={**SPEC, "workers": 3, "min_workers": 3, "worker_cpus": 2})
    assert r.status_code == 422
    assert r.json()["detail"][0]["msg"] == (
        "min_workers 3: the cluster's worker slots hold 2 workers of 2 CPUs (worker_cpus 2); "
        "the job could never start"
    )
    # A GPU job on nodes without GPUs: no node hosts one.
    r = client.post("/v1/jobs", json={**SPEC, "min_workers": 1, "worker_gpus": 1})
    assert (
        r.status_code == 422
        and "hold 0 of this job's workers (1 CPU, 1.0 GPU each)" in (r.json()["detail"][0]["msg"])
    )
    # What the nodes hold is accepted (they may be busy: it then waits in the queue).
    assert client.post("/v1/jobs", json={**SPEC, "workers": 4, "min_workers": 4}).status_code == 201


@pytest.mark.parametrize(
    ("spec", "resources", "held"),
    [
        ({}, {"CPU": 4.0}, 4),
        ({"worker_cpus": 0.1}, {"CPU": 0.3}, 3),  # no float shortfall
        ({"worker_cpus": 2}, {"CPU": 3.0}, 1),
        ({"worker_gpus": 0.5}, {"CPU": 8.0, "GPU": 1.0}, 2),
        ({"worker_gpus": 1}, {"CPU": 8.0}, 0),
        ({"worker_gpus": "auto"}, {"CPU": 8.0, "GPU": 2.0}, 2),
        ({"worker_gpus": "auto"}, {"CPU": 3.0}, 3),  # trains on the CPU
        ({"worker_gpus": "auto", "device": "cuda"}, {"CPU": 3.0}, 0),
        ({"node_resource": "fast"}, {"CPU": 2.0}, 0),
        ({"node_resource": "fast"}, {"CPU": 2.0, "fast": 1.0}, 2),
    ],
)
def test_workers_a_node_holds(spec: dict[str, Any], resources: dict[str, float], held: int) -> None:
    job = JobSpec.model_validate({**SPEC, **spec})
    assert job.workers_on(resources) == held

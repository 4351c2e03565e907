"""A parameter-server job's status in REST's snapshot, Prometheus and the CLI table."""

from __future__ import annotations

from dynabatch.actors.spec import JobSpec
from dynabatch.api.cli.common import ps_table
from dynabatch.api.metrics import ps_families
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.ps.batch_policy import PerfAwareBatches
from dynabatch.scheduler.core.ps.engine import learners
from dynabatch.scheduler.core.ps.machine import PSCore
from dynabatch.scheduler.core.ps.rudra import PSConfig
from dynabatch.scheduler.ps.driver import ps_status
from dynabatch.scheduler.telemetry import JobSnapshot
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector
from rich.console import Console

SPEC = JobSpec.model_validate({"workers": 2, "protocol": {"name": "ps", "mode": "async"}})


def _snapshot() -> JobSnapshot:
    core = PSCore(PSConfig("async"), dataset_size=20, epochs=1, seed=0,
                  batches=PerfAwareBatches(4))
    core.join("w0")
    core.join("w1")
    a, _ = core.request("w0")
    b, _ = core.request("w1")
    core.push("w0", a.ticket, a.version, 0.1)
    core.push("w1", b.ticket, b.version, 0.1)  # τ = 1
    snap = core.snapshot()
    snap["pushes_per_s"] = 1.0  # the server's rolling rate (tests/unit/test_ps_sim.py)
    return JobSnapshot(job_id="abc", name="j", state=JobState.RUNNING,
                       ps=ps_status(SPEC, snap))


def test_snapshot_carries_per_worker_staleness_and_round_trips():
    s = _snapshot()
    assert s.ps.version == 2 and s.ps.applied == 2 and s.ps.pushes_per_s == 1.0
    w1 = {w.worker: w for w in s.ps.workers}["w1"]
    assert w1.staleness_counts == {1: 1} and w1.staleness_max == 1
    assert JobSnapshot.model_validate_json(s.model_dump_json()) == s


def test_prometheus_families():
    snap = _snapshot()

    class C(Collector):
        def collect(self):
            return ps_families([snap])

    reg = CollectorRegistry()
    reg.register(C())
    text = generate_latest(reg).decode()
    assert 'dynabatch_ps_staleness_bucket{job_id="abc",le="0.0",worker="w1"} 0.0' in text
    assert 'dynabatch_ps_staleness_bucket{job_id="abc",le="1.0",worker="w1"} 1.0' in text
    assert 'dynabatch_ps_gradients_total{job_id="abc",outcome="applied"} 2.0' in text
    assert 'dynabatch_ps_server_version{job_id="abc"} 2.0' in text
    assert 'dynabatch_ps_pushes_per_second{job_id="abc"} 1.0' in text
    assert 'dynabatch_ps_deferred_updates_total{job_id="abc"} 0.0' in text


def test_run_live_view_shows_staleness_per_worker():
    from dynabatch.api.cli.run import render

    console = Console(width=160, record=True)
    console.print(render(_snapshot(), []))
    out = console.export_text()
    assert "parameter server (async)" in out and "staleness mean" in out and "w1" in out


def test_cli_table_shows_staleness_per_worker():
    console = Console(width=140, record=True)
    console.print(ps_table(_snapshot().ps))
    out = console.export_text()
    assert "staleness mean" in out and "w1" in out and "1.00" in out


def test_a_running_ps_jobs_learners_are_its_snapshots_workers_with_their_nodes():
    """The job's members have one source for both protocols, ``snapshot.workers``: the
    cluster scheduler's poll, ``/v1/cluster``, ``status`` and the metrics read them. A
    parameter-server job listed none, so a running one showed ``members 0 (none)`` and
    "starting 2 workers" in ``dynabatch cluster``, and an empty workers table in ``status``."""
    from tests.unit.test_ps_export import _job

    coord, _ = _job("ps-members", epochs=3)
    assert coord.start()
    while not coord.history():
        assert coord.step()
    snap = coord.snapshot()
    on = learners(coord.engine_state)
    assert on and {(w.worker, w.node) for w in snap.workers} == set(on.items())
    batch = {w.worker: w.batch for w in snap.ps.workers}
    assert all(w.joined and w.batch == batch[w.worker] > 0 for w in snap.workers)
    assert [w.rank for w in snap.workers] == list(range(len(on)))
    assert snap.group_size == len(on)  # REST's and the metrics' worker count (it was 0)


def test_a_learner_the_server_has_not_met_yet_shows_the_batch_it_will_get_not_zero():
    """Between its spawn and the server's next snapshot a learner is a RUNNING job's
    worker that the server does not list: its batch is the one the server gives a learner
    it has not met (μ, global_batch over the learners), as the job page and ``status``
    show it; it was 0 (the job page's end-to-end test caught it once the learners started
    quicker)."""
    from tests.unit.test_ps_export import _job

    coord, _ = _job("ps-first-batch", epochs=3)
    assert coord.start()
    snap = coord.snapshot()
    assert snap.state == JobState.RUNNING and len(snap.workers) == 2
    mu = coord.spec.global_batch // 2
    assert [w.batch for w in snap.workers] == [mu, mu]


def test_a_parameter_server_job_is_one_before_its_servers_first_snapshot():
    """A RUNNING job's ``ps`` is never None: the job page, ``status`` and ``run`` show
    a learner's partition and step times as "-" because it is a parameter-server job, and
    read that from ``ps``. Before the server's first snapshot it was None, and the page
    showed the learners' partition and step times as zeros (the page's end-to-end test
    caught it)."""
    from tests.unit.test_ps_export import _job

    coord, _ = _job("ps-before-first-snapshot", epochs=3)
    assert coord.start()
    snap = coord.snapshot()
    assert snap.state == JobState.RUNNING and len(snap.workers) == 2
    assert snap.ps is not None and snap.ps.mode == coord.spec.protocol.mode
    assert (snap.ps.version, snap.ps.pushes, snap.ps.workers) == (0, 0, [])

"""Issue 31, items 3, 4 and 8 on a real Ray cluster: the cluster scheduler actor shares two
nodes (their own node type, ``node-type:csched``) between jobs.

(a) The issue's deadlock, through the service: two jobs each asking for both slots,
submitted at once (behind (c)'s job, so both contend for the slots it frees). No job ever
holds a partial allocation; one trains while the other waits PENDING with the queue's
reason, holding nothing, then the other; both SUCCEED with every epoch verified.
(b) goodput: a running job shrinks at a step boundary to admit a new one, grows back when
that one finishes, keeps training while the scheduler actor is killed, and a new scheduler
adopts it with the same allocation. No restart, every epoch verified.
(c) ``dynabatch run --address``'s job path with the scheduler running: the run's job
queues there and trains on the nodes it grants; jobs then submitted through the service
queue behind it (fifo) and start once the run reports its job finished. (a) and (c) are one
test: a run's job, then (a)'s two.
(d) Item 7's behaviour, not its times: 3 elastic jobs at once and a 4th once the first has
finished an epoch, under goodput on 4 nodes of two types (2 more, 3x slower, beside the
module's): every job SUCCEEDS with every epoch verified, jobs are resized, none restarts.
"""

from __future__ import annotations

import io
import json
import threading

import pytest
import ray
from dynabatch.actors.spec import JobSpec
from dynabatch.api.cli.run import run_job
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.runtime.cluster_scheduler import JobEntry, ensure_scheduler
from dynabatch.scheduler.runtime.launch import find_coordinator
from dynabatch.service.job_service import build_service
from dynabatch.service.ray_client import RayClusterClient
from dynabatch.service.settings import Settings
from rich.console import Console

from .conftest import find_scheduler, wait_for

pytestmark = pytest.mark.integration

TAG = "csched"


@pytest.fixture(scope="module")
def slots(cluster):
    """Two one-CPU nodes of type ``csched``."""
    nodes = [
        cluster.add_node(
            num_cpus=1, resources={TAG: 1, f"node-type:{TAG}": 1}, object_store_memory=80 * 2**20
        )
        for _ in range(2)
    ]
    cluster.wait_for_nodes()
    yield sorted(n.node_id for n in nodes)
    for n in nodes:
        cluster.remove_node(n)


def _spec(name: str, **kw) -> JobSpec:
    base = dict(
        name=name,
        dataset={"name": "digits"},
        model={"name": "mlp", "hidden": 32},
        optimizer={"name": "sgd", "lr": 0.1},
        global_batch=64,
        epochs=2,
        seed=5,
        node_resource=TAG,
        spares=0,
        collective_timeout_s=5,
        worker_wait_timeout_s=60,
    )
    base.update(kw)
    return JobSpec.model_validate(base)


def _scheduler(policy: str):
    old = find_scheduler()
    if old is not None:
        ray.kill(old, no_restart=True)
        wait_for(lambda: find_scheduler() is None, timeout=30)
    return ensure_scheduler(policy, round_s=0.5, hold_s=0.0)


def _snap(job_id: str):
    handle = find_coordinator(job_id)
    return None if handle is None else ray.get(handle.snapshot.remote(), timeout=30)


def _service(tmp_path, policy: str, hold_s: float = 0.0, round_s: float = 0.5):
    """The service as ``dynabatch serve`` runs it with the scheduler on (its sync loop run by
    the test), on a fresh scheduler; finished coordinators are kept to be read."""
    old = find_scheduler()
    if old is not None:
        ray.kill(old, no_restart=True)
        wait_for(lambda: find_scheduler() is None, timeout=30)
    settings = Settings(
        db_path=str(tmp_path / "jobs.db"),
        sync_interval_s=0,
        cluster_scheduler=True,
        cluster_policy=policy,
        cluster_round_s=round_s,
        cluster_hold_s=hold_s,
        release_finished=False,
    )
    service = build_service(settings, RayClusterClient(ray.get_runtime_context().gcs_address))
    service.cluster.connect()
    service.reconciler.start()
    service.reconciler.sync_once()  # the scheduler exists and has rebuilt: rounds run
    return service


def _stop(service, job_ids) -> None:
    service.reconciler.stop()
    _release(*job_ids)
    sched = find_scheduler()
    if sched is not None:
        ray.kill(sched, no_restart=True)
    service.store.close()


def _release(*job_ids: str) -> None:
    for job_id in job_ids:
        handle = find_coordinator(job_id)
        if handle is not None:
            ray.kill(handle, no_restart=True)


def test_a_run_then_two_gangs_submitted_at_once_hold_both_slots_or_none_in_turn(
    slots, cluster, tmp_path
):
    """(a) and (c) in one job sequence. ``run``'s own job path (``run_job``, as ``dynabatch
    run --address`` calls it) while the scheduler runs: the scheduler sees the job and places
    it on both slots. Two jobs each asking for both slots are then submitted to the service
    at once (as ``dynabatch serve`` runs it with the scheduler on): they queue behind the
    run's job, holding nothing; the run reports its end, and they train one after the
    other, never on a partial gang, the second PENDING with the queue's reason meanwhile.
    (They were two tests, each with its own scheduler, service and second job.)"""
    service = _service(tmp_path, "fifo")
    gang = dict(workers=2, min_workers=2, max_workers=2)
    seen: dict = {"views": [], "a": None, "b": None, "reasons": [], "b_reasons": []}
    done = threading.Event()

    def service_side() -> None:
        # The service's sync loop, and two submits once the run's job holds its nodes.
        while not done.is_set():
            service.reconciler.sync_once()
            view = service.cluster_view()
            if view is not None:
                seen["views"].append(view)
                held = [j for j in view.jobs if j.allocation]
                if seen["a"] is None and held:
                    seen["run"] = held[0].job_id
                    seen["a"] = service.submit(_spec("a", **gang)).id
                    seen["b"] = service.submit(_spec("b", **gang)).id
            if seen["a"] is not None:
                recs = [service.get(seen["a"]), service.get(seen["b"])]
                seen["reasons"].extend(r.reason for r in recs if r.reason)
                if recs[1].reason:
                    seen["b_reasons"].append(recs[1].reason)
                if all(r.state.is_terminal for r in recs):
                    return
            done.wait(0.5)

    thread = threading.Thread(target=service_side, daemon=True)
    thread.start()
    try:
        # In the main thread: run installs its Ctrl-C handler.
        snap = run_job(
            _spec("r", **gang),
            address=cluster.address,
            report=tmp_path / "run.json",
            quiet=True,
            console=Console(file=io.StringIO()),
        )
        assert snap.state == JobState.SUCCEEDED, snap.reason
        run_id = snap.job_id
        assert seen.get("run") == run_id  # the scheduler placed the run's job
        hist = json.loads((tmp_path / "run.json").read_text())["history"]
        assert [r["epoch"] for r in hist] == [0, 1] and all(r["verified"] for r in hist)
        # It ended: reported finished, the scheduler holds it no more.
        sched = find_scheduler()
        wait_for(lambda: ray.get(sched.allocation.remote(run_id), timeout=30) is None)
        thread.join(timeout=400)
        assert not thread.is_alive(), "the submitted jobs did not end"
        for job_id in (seen["a"], seen["b"]):
            rec = service.get(job_id)
            assert rec.state == JobState.SUCCEEDED, (job_id, rec.reason)
            hist = service.history(job_id)
            assert [r.epoch for r in hist] == [0, 1] and all(r.verified for r in hist)
        # Never a partial gang: a job holds both slots or none, and one waited for the
        # other, PENDING with the queue's reason.
        views = seen["views"]
        held = [j.workers for v in views if v for j in v.jobs]
        assert held and all(n in (0, 2) for n in held)
        assert any(v and len(v.queue) == 1 for v in views)
        assert any(r.startswith("queued: position 1 of 1") for r in seen["reasons"])
        # While the run's job held both slots, the submitted ones waited, holding nothing.
        a, b = seen["a"], seen["b"]
        by_job = [{j.job_id: j for j in v.jobs} for v in views]
        during = [v for v in by_job if run_id in v and a in v and b in v and v[run_id].allocation]
        assert during and all(v[a].workers == 0 and v[b].workers == 0 for v in during)
        assert all(sorted(n for n, _ in v[run_id].allocation) == slots for v in during)
        assert any(list(v.queue) == [a, b] for v in views)  # in submit order (fifo)
        assert any(r.startswith("queued: position 1 of 1") for r in seen["b_reasons"])
    finally:
        done.set()
        thread.join(timeout=30)
        _stop(service, [j for j in (seen["a"], seen["b"]) if j])


def test_goodput_shrinks_a_job_to_admit_another_and_a_new_scheduler_adopts_it(slots):
    sched = _scheduler("goodput")
    # Long enough never to end by itself here: the test cancels it once it has been
    # watched through both resizes and the scheduler's restart. Its workers sleep 10x their
    # compute (emulated, equal on both nodes): nothing here depends on its speed, and a job
    # training flat out for the whole test would take most of the 2 cores from the rest.
    a = _spec("a", workers=2, min_workers=1, max_workers=2, epochs=1000,
              emulation={"slowdowns": [10, 10]})
    b = _spec("b", workers=1, min_workers=1, max_workers=1, epochs=1)
    try:
        ray.get(sched.sync.remote([JobEntry("gpa", a, 1.0)]))
        wait_for(
            lambda: (s := _snap("gpa")) and len(s.workers) == 2 and s.state == JobState.RUNNING,
            timeout=180,
        )
        ray.get(sched.register.remote(JobEntry("gpb", b, 2.0)))
        # a shrinks to one worker at a step boundary; b starts on the slot it frees.
        wait_for(lambda: (s := _snap("gpb")) and s.state.is_terminal, timeout=300, interval=0.5)
        assert _snap("gpb").state == JobState.SUCCEEDED, _snap("gpb").reason
        # b ended: a grows back onto both nodes.
        wait_for(
            lambda: sorted(w.node for w in _snap("gpa").workers) == slots, timeout=180, interval=0.5
        )
        view = ray.get(sched.round.remote(), timeout=60)
        assert view.resizes >= 2
        before = ray.get(sched.allocation.remote("gpa"))
        assert before == tuple((n, 1) for n in slots)

        # The scheduler actor dies: the job trains on; a new scheduler adopts it as it runs.
        ray.kill(sched, no_restart=True)
        epoch = _snap("gpa").epoch
        wait_for(lambda: _snap("gpa").epoch >= epoch + 1, timeout=120)
        wait_for(lambda: find_scheduler() is None, timeout=30)
        sched = ensure_scheduler("goodput", round_s=0.5, hold_s=0.0)
        ray.get(sched.sync.remote([JobEntry("gpa", a, 1.0)]))
        assert ray.get(sched.allocation.remote("gpa")) == before
        ray.get(sched.round.remote(), timeout=60)
        assert ray.get(sched.allocation.remote("gpa")) == before

        handle = find_coordinator("gpa")
        ray.get(handle.cancel.remote("test over"))
        wait_for(lambda: _snap("gpa").state.is_terminal, timeout=120)
        snap = _snap("gpa")
        assert snap.state == JobState.CANCELLED, snap.reason
        hist = ray.get(handle.history.remote())
        assert hist and all(r.verified for r in hist)
        assert [r.epoch for r in hist] == list(range(len(hist)))  # no epoch redone
        events = ray.get(handle.membership_events.remote())
        assert not [e for e in events if e.kind in ("failure", "evict")]
        assert [e for e in events if e.kind == "leave"]  # the shrink, at a step boundary
    finally:
        _release("gpa", "gpb")
        ray.kill(sched, no_restart=True)

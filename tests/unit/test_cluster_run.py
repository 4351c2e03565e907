"""Issue 31, item 3: ``dynabatch run --address`` goes through the cluster scheduler.

The scheduler actor's class driven in-process (no Ray: its node listing, coordinator lookup
and launch replaced, rounds run by the test): a run's job is granted, not launched by the
scheduler; the service's sync neither drops it nor forgets it in its rebuild; its nodes
count against the service's jobs until it is reported finished. And ``run``'s side: it
waits in the queue, launches on the granted nodes, and reports the end.
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from dynabatch.actors.spec import JobSpec, parse_spec
from dynabatch.api.cli import run as run_cli
from dynabatch.scheduler.core.cluster.ray_nodes import RayNode
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.membership import NodeAssignment
from dynabatch.scheduler.runtime import cluster_scheduler as cluster_rt
from dynabatch.service import scheduling
from rich.console import Console

from tests.fakes import FakeCluster
from tests.unit.test_cli_run import FakeJob

GANG = {"workers": 2, "min_workers": 2, "max_workers": 2, "global_batch": 64, "epochs": 1}


class Remote:
    """A method of a fake actor: ``.remote()`` returns its answer (``FakeCalls.get`` is
    identity)."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class Coordinator:
    """A running coordinator as the scheduler polls it."""

    def __init__(self) -> None:
        self.assigned_to: list[dict[str, int]] = []
        self.leaving: list[tuple[str, ...]] = []  # each assignment's workers to leave first
        self.workers: list[SimpleNamespace] = []  # its members, as its snapshot reports them
        self.snapshot = Remote(
            lambda: SimpleNamespace(
                state=JobState.RUNNING, workers=list(self.workers), global_batch=64
            )
        )
        self.assign = Remote(self._assign)
        self.assigned = Remote(lambda: None)
        self.ran = False  # run() called: its workers started
        self.run = Remote(self._run)
        self.killed = False

    def _assign(self, a: NodeAssignment) -> None:
        self.assigned_to.append(dict(a.slots))
        self.leaving.append(a.leaving)

    def _run(self) -> None:
        self.ran = True


class FakeCalls(cluster_rt.RayCalls):
    """Ray as the scheduler asks it (:class:`~cluster_rt.RayCalls`): two one-slot nodes,
    coordinators by job id, the launches it made; ``during_launch`` runs while a launch is
    under way (a cancel or a round arriving then)."""

    def __init__(self) -> None:
        self.coordinators: dict[str, Coordinator] = {}
        self.launched: list[tuple[str, dict[str, int]]] = []
        self.node_list = [RayNode(f"n{i}", {"CPU": 1.0, "node-type:t": 1.0}) for i in (1, 2)]
        self.during_launch: dict[str, Any] = {}

    def nodes(self) -> list[RayNode]:
        return list(self.node_list)

    def find(self, job_id: str, generation: int) -> Coordinator | None:
        return self.coordinators.get(job_id)

    def launch(self, job_id, spec, generation, slots, timeout_s) -> Coordinator:
        self.launched.append((job_id, dict(slots)))
        self.coordinators[job_id] = Coordinator()
        if job_id in self.during_launch:
            self.during_launch[job_id]()
        return self.coordinators[job_id]

    def get(self, ref: Any, timeout_s: float) -> Any:
        return ref

    def kill(self, handle: Any) -> None:
        handle.killed = True


class Clock:
    """The scheduler's clock, moved by the test."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def world() -> dict[str, Any]:
    """The fake Ray and clock a scheduler is built on (:func:`_scheduler`)."""
    calls = FakeCalls()
    return {
        "calls": calls,
        "clock": Clock(),
        "coordinators": calls.coordinators,
        "launched": calls.launched,
    }


def _scheduler(
    world: dict[str, Any], policy: str = "fifo", hold_s: float = 0.0
) -> cluster_rt.ClusterScheduler:
    return cluster_rt.ClusterScheduler(
        policy,
        round_s=1.0,
        hold_s=hold_s,
        background=False,
        clock=world["clock"],
        calls=world["calls"],
    )


def test_a_runs_job_is_granted_to_its_run_and_the_services_sync_keeps_it(world) -> None:
    sched = _scheduler(world)
    spec = parse_spec(GANG)
    sched.register(cluster_rt.JobEntry("run1", spec, 1.0, client=True))
    # The service's first sync (its rebuild) lists only its own jobs: none.
    sched.sync([])
    assert sched.grant("run1")[0] is None  # no round yet
    sched.round()
    slots, _ = sched.grant("run1")
    assert slots == (("n1", 1), ("n2", 1))
    assert world["launched"] == []  # its run launches it, not the scheduler
    sched.round()  # granted, not launched yet: not taken for a dead coordinator
    assert sched.grant("run1")[0] == slots

    world["coordinators"]["run1"] = Coordinator()
    sched.launched("run1", slots)
    # A job submitted to the service queues behind it; the service's sync keeps the run's.
    sched.sync([cluster_rt.JobEntry("svc", spec, 2.0)])
    view = sched.round()
    assert [j.job_id for j in view.jobs if j.allocation] == ["run1"]
    assert list(view.queue) == ["svc"]
    assert sched.allocation("run1") == slots
    assert world["launched"] == []

    sched.finished("run1")  # its run saw it end
    sched.round()
    assert world["launched"] == [("svc", {"n1": 1, "n2": 1})]
    with pytest.raises(ValueError, match="does not hold job run1"):
        sched.grant("run1")


def test_a_new_scheduler_adopts_a_runs_job_its_run_tells_it_about(world) -> None:
    """The actor restarted: the service's rebuild does not know the run's job, the run's
    keep-alive does, and it is adopted as it runs, holding its nodes."""
    spec = parse_spec(GANG)
    running = Coordinator()
    running.assigned = Remote(lambda: (("n1", 1), ("n2", 1)))
    world["coordinators"]["run1"] = running
    sched = _scheduler(world)
    sched.register(cluster_rt.JobEntry("run1", spec, 1.0, client=True))  # its keep-alive
    sched.sync([cluster_rt.JobEntry("svc", spec, 2.0)])
    view = sched.round()
    assert sched.allocation("run1") == (("n1", 1), ("n2", 1))
    assert list(view.queue) == ["svc"]
    assert world["launched"] == []


def test_a_queued_runs_job_whose_run_is_gone_is_dropped(world) -> None:
    now = world["clock"]
    sched = _scheduler(world)
    spec = parse_spec(GANG)
    sched.sync([cluster_rt.JobEntry("svc", spec, 1.0)])
    sched.round()
    sched.register(cluster_rt.JobEntry("run1", spec, 2.0, client=True))
    now.now += sched.knobs.client_lease_s / 2
    sched.round()
    assert sched.grant("run1")[0] is None  # queued behind svc, and heard from
    now.now += sched.knobs.client_lease_s + 1
    sched.round()
    with pytest.raises(ValueError, match="does not hold job run1"):
        sched.grant("run1")


def test_a_job_whose_coordinator_died_is_the_services_to_resume_not_restarted(world) -> None:
    """The rounds saw the coordinator die before the service's poll did: the service's
    next sync, which lists the job as it was, does not queue it again (the scheduler
    would start the same generation, and the service never record a resume); the job is
    reported for the service to poll, which resumes it as the next generation."""
    sched = _scheduler(world)
    spec = parse_spec(GANG)
    sched.sync([cluster_rt.JobEntry("svc", spec, 1.0)])
    sched.round()
    assert world["launched"] == [("svc", {"n1": 1, "n2": 1})]

    def died() -> None:
        raise ray.exceptions.RayActorError()

    world["coordinators"]["svc"].snapshot = Remote(died)
    sched.round()  # its poll finds it dead
    assert sched.allocation("svc") is None
    started, _ = sched.sync([cluster_rt.JobEntry("svc", spec, 1.0)])
    assert started == ["svc"]  # for the service to poll
    sched.round()
    assert len(world["launched"]) == 1
    # The service resumed it: its next generation starts.
    started, _ = sched.sync([cluster_rt.JobEntry("svc", spec, 1.0, generation=1)])
    assert started == []
    sched.round()
    assert len(world["launched"]) == 2


class FakeScheduling:
    """The scheduler as ``run`` sees it: queued for ``waits`` polls, then granted."""

    def __init__(self, waits: int = 2):
        self.waits = waits
        self.calls: list[tuple] = []

    def register_client(self, job_id: str, spec: JobSpec, submit_s: float) -> None:
        self.calls.append(("register", job_id))

    def grant(self, job_id: str):
        self.calls.append(("grant", job_id))
        if self.waits:
            self.waits -= 1
            return None, "queued: position 1 of 1 (waits for job x at the head of the queue)"
        return (("n1", 1), ("n2", 1)), ""

    def launched(self, job_id: str, slots) -> None:
        self.calls.append(("launched", job_id, tuple(slots)))

    def finished(self, job_id: str) -> None:
        self.calls.append(("finished", job_id))


def test_run_waits_in_the_queue_then_trains_on_the_granted_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dynabatch.scheduler.runtime.launch as launch_mod
    import dynabatch.service.raycluster

    cluster = FakeCluster()
    placer = FakeScheduling()
    launches: list[tuple[str, Any]] = []
    asked: list[tuple[bool, bool | None]] = []

    def launch(job_id: str, spec: JobSpec, **kw: Any) -> str:
        launches.append((job_id, kw.get("assignment")))
        cluster.launch(job_id, spec)
        return job_id

    def scheduler_for_run(address_given: bool, want: bool | None):
        asked.append((address_given, want))
        return placer if address_given and want is not False else None

    monkeypatch.setattr(dynabatch.service.raycluster, "connect", lambda *a, **k: {})
    monkeypatch.setattr(launch_mod, "launch_coordinator", launch)
    monkeypatch.setattr(scheduling, "scheduler_for_run", scheduler_for_run)
    monkeypatch.setattr(scheduling.time, "sleep", lambda s: None)
    monkeypatch.setattr(run_cli.time, "sleep", lambda s: None)
    monkeypatch.setattr(run_cli, "RayJob", lambda job_id: FakeJob(cluster, job_id))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    err = io.StringIO()
    monkeypatch.setattr(run_cli, "stderr", lambda: Console(file=err, width=300))
    out = Console(file=io.StringIO(), width=200)

    snap = run_cli.run_job(
        parse_spec(GANG), address="ray://head:10001", report=None, quiet=True, console=out
    )
    assert snap.state == JobState.SUCCEEDED
    job_id = snap.job_id
    assert launches == [(job_id, {"n1": 1, "n2": 1})]
    kinds = [c[0] for c in placer.calls]
    assert kinds == ["register", "grant", "grant", "grant", "launched", "finished"]
    assert "cluster scheduler: queued: position 1 of 1" in err.getvalue()
    assert err.getvalue().count("queued: position 1 of 1") == 1  # said once, not per poll

    # The embedded local Ray: launched at once, as before.
    launches.clear()
    snap = run_cli.run_job(parse_spec(GANG), address=None, report=None, quiet=True, console=out)
    assert snap.state == JobState.SUCCEEDED and launches == [(snap.job_id, None)]
    assert asked == [(True, None), (False, None)]


def test_run_interrupted_in_the_queue_leaves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    placer = FakeScheduling(waits=10)
    monkeypatch.setattr(scheduling.time, "sleep", lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        scheduling.run_placed(
            placer,
            parse_spec(GANG),
            lambda *a: pytest.fail("launched while queued"),
            on_wait=lambda why: None,
            interrupted=lambda: True,
            job_id="j1",
        )
    assert placer.calls[-1] == ("finished", "j1")


def test_scheduler_flag_needs_an_address(tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from tests.unit.test_cli_run import CONFIG, _app

    cfg = tmp_path / "job.yaml"
    cfg.write_text(CONFIG)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    result = CliRunner().invoke(_app(), ["run", str(cfg), "--scheduler"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: --scheduler: needs an address: the embedded local Ray runs one job, with no "
        "cluster scheduler"
    )


def test_run_on_a_cluster_goes_through_its_scheduler_starting_one_when_none_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dynabatch run --address`` needs no flag to share a cluster: with no scheduler
    there it gets one (the actor is created at its first call); ``--no-scheduler`` and the
    embedded local Ray (one job) get none."""
    monkeypatch.setenv("DYNABATCH_CLUSTER_POLICY", "fair")
    placer = scheduling.scheduler_for_run(True, None)
    assert isinstance(placer, scheduling.RayScheduling)
    assert placer._args[0] == "fair" and placer._args[-1] is True  # rounds from the start
    assert scheduling.scheduler_for_run(True, False) is None
    assert scheduling.scheduler_for_run(False, None) is None


def test_the_actors_drain_refusals_are_the_pure_machines_reasons(world) -> None:
    """The actor relays ``drain_refusal`` (no second copy of the checks): a job it does
    not run, a node where the job holds no slot, a drain below ``min_workers``; a drain
    it takes frees the slot and says what the job keeps."""
    sched = _scheduler(world)
    gang = parse_spec(GANG)
    flexible = parse_spec({**GANG, "min_workers": 1})
    with pytest.raises(ValueError, match=r"it does not run job a$"):
        sched.request_drain("a", "n1")
    sched.sync([cluster_rt.JobEntry("a", gang, 1.0)])
    sched.round()
    with pytest.raises(ValueError, match="refused: 1 workers would be below its min_workers 2"):
        sched.request_drain("a", "n1")
    sched.finished("a")
    sched.sync([cluster_rt.JobEntry("b", flexible, 2.0)])
    sched.round()
    assert sched.allocation("b") == (("n1", 1), ("n2", 1))
    assert sched.request_drain("b", "n2", "w1").endswith(
        "its slot on node n2 is freed, and its max_workers is now 1"
    )
    assert sched.allocation("b") == (("n1", 1),)
    coordinator = world["coordinators"]["b"]
    # The worker the owner named is the one to leave (not the slowest on its node).
    assert (coordinator.assigned_to[-1], coordinator.leaving[-1]) == ({"n1": 1}, ("w1",))
    with pytest.raises(ValueError, match=r"job b holds no slot on node n2$"):
        sched.request_drain("b", "n2")


ONE = {"workers": 1, "min_workers": 1, "max_workers": 1, "global_batch": 64, "epochs": 1}


def test_an_owners_scale_up_is_assigned_at_once_under_the_default_hold(world) -> None:
    """Issue 50's first finding: under serve's defaults (hold 120 s) a scale above the
    spec's max_workers was recorded, never assigned, and refused in a Ray log. The scale
    is sent to the job at once; what cannot be is refused to the caller with the reason."""
    sched = _scheduler(world, "goodput", hold_s=120.0)
    sched.sync([cluster_rt.JobEntry("a", parse_spec(ONE), 1.0)])
    sched.round()
    coordinator = world["coordinators"]["a"]
    assert world["launched"] == [("a", {"n1": 1})] and coordinator.ran
    world["clock"].now += 1.0  # well within the hold
    answer = sched.request_scale("a", 2)
    assert answer.endswith("scaled to 2 workers from its next step boundary")
    assert coordinator.assigned_to == [{"n1": 1, "n2": 1}]
    assert sched.view().job("a").allocation == (("n1", 1), ("n2", 1))
    with pytest.raises(ValueError, match=r"scale to 3: above the cluster's capacity for this "):
        sched.request_scale("a", 3)
    with pytest.raises(ValueError, match=r"scale to 0: a job needs at least 1 worker$"):
        sched.request_scale("a", 0)


def test_what_the_job_has_and_what_it_refused_are_in_the_view(world) -> None:
    """Members come from the job's own snapshot; an assignment it refuses (its ``assign``
    raises) is recorded and shown, not lost in a log, and not sent again."""
    sched = _scheduler(world, "goodput")
    sched.sync([cluster_rt.JobEntry("a", parse_spec({**GANG, "min_workers": 1}), 1.0)])
    sched.round()
    coordinator = world["coordinators"]["a"]
    coordinator.workers = [SimpleNamespace(node="n1", throughput=5.0, joined=True)]
    view = sched.round()
    assert view.job("a").allocation == (("n1", 1), ("n2", 1))
    assert view.job("a").members == (("n1", 1),)
    assert view.job("a").differs == "starting 1 worker on node n2"

    asked: list[dict[str, int]] = []

    def refuse(a: NodeAssignment) -> None:
        asked.append(dict(a.slots))
        raise ValueError("the job is stopping")

    coordinator.assign = Remote(refuse)
    with pytest.raises(ValueError, match=r"drain: .*; the job refused it: the job is stopping$"):
        sched.request_drain("a", "n1")  # taken by the rounds, refused by the job
    view = sched.view()
    assert view.job("a").differs == "the job refused the assignment (n2: 1): the job is stopping"
    assert view.job("a").allocation == (("n1", 1),)  # what it has
    sched.round()
    sched.round()
    assert asked == [{"n2": 1}]  # not sent again


def test_a_first_start_sends_the_newest_assignment_before_its_workers_start(world) -> None:
    """A round (here the owner's scale) moved the job while its coordinator launched: the
    newest allocation is assigned before ``run``, not the launch's."""
    sched = _scheduler(world, "fifo", hold_s=120.0)
    spec = parse_spec({**GANG, "min_workers": 1})
    world["calls"].during_launch["a"] = lambda: sched.request_scale("a", 1)
    sched.sync([cluster_rt.JobEntry("a", spec, 1.0)])
    sched.round()
    coordinator = world["coordinators"]["a"]
    assert world["launched"] == [("a", {"n1": 1, "n2": 1})]
    assert coordinator.assigned_to == [{"n1": 1}] and coordinator.ran
    assert sched.allocation("a") == (("n1", 1),)


def test_an_owners_scale_whose_send_timed_out_is_sent_again_by_the_next_round(world) -> None:
    """CI's hang (stop 60: a scale answered 202, the job kept 3 workers to its end): the
    scale's ``assign`` call timed out on a loaded machine, the rounds had already recorded
    the new allocation, and no round sent it again. Now an assignment the driver never took
    is sent again, round after round, until it answers; one taken is not."""
    sched = _scheduler(world, "goodput", hold_s=120.0)
    world["calls"].node_list.append(RayNode("n3", {"CPU": 1.0, "node-type:t": 1.0}))
    sched.sync([cluster_rt.JobEntry("a", parse_spec({**GANG, "max_workers": 3}), 1.0)])
    sched.round()
    coordinator = world["coordinators"]["a"]
    assert world["launched"] == [("a", {"n1": 1, "n2": 1, "n3": 1})]
    calls = world["calls"]
    plain_get = calls.get
    timed_out: list[Any] = []

    def timing_out(ref: Any, timeout_s: float) -> Any:
        if ref is None and not timed_out:  # the assign's answer (it returns None here)
            timed_out.append(ref)
            raise TimeoutError("Get timed out: some object(s) not ready.")
        return plain_get(ref, timeout_s)

    calls.get = timing_out
    world["clock"].now += 1.0  # within the hold: the resend is not a move
    assert sched.request_scale("a", 2).endswith("from its next step boundary")
    assert timed_out and sched.allocation("a") == (("n1", 1), ("n2", 1))
    sent = list(coordinator.assigned_to)
    sched.round()
    assert coordinator.assigned_to == [*sent, {"n1": 1, "n2": 1}]
    sched.round()
    sched.round()
    assert coordinator.assigned_to == [*sent, {"n1": 1, "n2": 1}]  # taken: not sent again


def test_a_coordinator_unavailable_for_a_moment_is_not_dropped_and_is_sent_its_scale(world):
    """Ray's ActorUnavailableError (the actor not dead, its node unreachable for a moment)
    answered the scale's ``assign``: the job was dropped from the rounds as if its driver
    had died, re-adopted by the next sync with the allocation it ran on, and the owner's
    scale was lost. Now it stays held and the assignment is sent again; a poll answered so
    keeps the job too."""
    import ray.exceptions

    sched = _scheduler(world, "goodput", hold_s=120.0)
    world["calls"].node_list.append(RayNode("n3", {"CPU": 1.0, "node-type:t": 1.0}))
    sched.sync([cluster_rt.JobEntry("a", parse_spec({**GANG, "max_workers": 3}), 1.0)])
    sched.round()
    coordinator = world["coordinators"]["a"]
    calls = world["calls"]
    plain_get = calls.get
    unavailable = ray.exceptions.ActorUnavailableError("its node is unreachable", None)
    failing = {"assign": 1, "snapshot": 1}

    def flaky(ref: Any, timeout_s: float) -> Any:
        kind = "assign" if ref is None else "snapshot"  # assign answers None here
        if failing[kind]:
            failing[kind] -= 1
            raise unavailable
        return plain_get(ref, timeout_s)

    calls.get = flaky
    world["clock"].now += 1.0
    sched.request_scale("a", 2)
    sched.round()  # its poll fails once more: kept, and the assignment is sent again
    assert sched.allocation("a") == (("n1", 1), ("n2", 1))
    assert coordinator.assigned_to[-1] == {"n1": 1, "n2": 1} and failing == {
        "assign": 0, "snapshot": 0}
    assert sched.view().job("a").allocation == (("n1", 1), ("n2", 1))


def test_a_coordinator_dead_when_sent_its_scale_is_dropped_from_the_rounds(world) -> None:
    """Ray's ActorDiedError answered the scale's ``assign``: that driver is gone, so the
    job leaves the rounds (the next sync adopts its successor), unlike a timeout or a node
    unreachable for a moment."""
    import ray.exceptions

    sched = _scheduler(world, "goodput", hold_s=120.0)
    world["calls"].node_list.append(RayNode("n3", {"CPU": 1.0, "node-type:t": 1.0}))
    sched.sync([cluster_rt.JobEntry("a", parse_spec({**GANG, "max_workers": 3}), 1.0)])
    sched.round()
    calls = world["calls"]
    plain_get = calls.get

    def dead(ref: Any, timeout_s: float) -> Any:
        if ref is None:  # the assign's answer (it returns None here)
            raise ray.exceptions.ActorDiedError()
        return plain_get(ref, timeout_s)

    calls.get = dead
    world["clock"].now += 1.0
    sched.request_scale("a", 2)
    assert sched.allocation("a") is None

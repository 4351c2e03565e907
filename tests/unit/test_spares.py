"""Pre-warmed spares on the real coordinator, without Ray (the simulator's runtime,
``tests.fakes.sim_runtime``).

A fresh worker takes ``START_S`` of virtual time to come up (process, imports, model); a
spare pays that ahead on an idle node, and the worker that later starts there (a scale-up,
a replacement) adopts it. Every run must still train each sample exactly once, with the
spare's worker in the lineage like any other.
"""

from __future__ import annotations

from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sim.cluster_spec import Fault
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator

from tests.fakes import Lineages
from tests.unit.test_engine_faults import _assert_exactly_once, _job, _run_to, _spec

START_S = 2.0
NODE2 = {"class": "node02", "index": 0}  # the idle node, where the spare runs


def _setup(*faults: Fault, **kw) -> tuple[Coordinator, SimRuntime, Lineages]:
    """Two workers (at most two) on a three-node cluster: node02 is idle, so its spare
    waits there."""
    spec = _spec(**{"workers": 2, "max_workers": 2, "epochs": 8, "start_timeout_s": 30, **kw})
    return _job(spec, *faults, speeds={0: 1000, 1: 500, 2: 800}, start_s=START_S)


def _joined(coord: Coordinator, worker: str) -> float | None:
    t = [e.time for e in coord.membership_events() if e.kind == "join" and e.worker == worker]
    return t[0] - coord.clock.time() + coord.clock.now() if t else None


def _scale_to_three(
    coord: Coordinator, rt: SimRuntime, newcomer: str = "w2"
) -> tuple[float, float]:
    """Scale to 3 once the spare is up; returns (request time, the newcomer's join time)."""
    _run_to(coord, 4, 4)
    assert all(up < rt.clock.now() for up in rt._spares.values())  # spares are up by now
    t_request = rt.clock.now()
    coord.scale(3)
    while _joined(coord, newcomer) is None:
        assert coord.step(), coord.snapshot().reason
    return t_request, _joined(coord, newcomer)


def test_a_scale_up_adopts_the_warm_spare_and_joins_at_the_next_boundary():
    coord, rt, lineages = _setup()
    t_request, t_join = _scale_to_three(coord, rt)
    assert rt.record.spares_started == ["node02"] and rt.record.adopted == ["w2"]
    assert "w2" not in rt.record.fresh
    assert t_join - t_request < 1.0  # one segment at most, not a start-up
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert any("w2" in plans for plans in rt.record.plans)  # the adopted worker trained
    assert rt._spares == {}  # none left behind


def test_without_spares_the_same_scale_up_waits_for_a_fresh_start():
    coord, rt, lineages = _setup(spares=0)
    t_request, t_join = _scale_to_three(coord, rt)
    assert rt.record.spares_started == [] and rt.record.fresh == ["w0", "w1", "w2"]
    assert t_join - t_request >= START_S
    coord.run()
    _assert_exactly_once(coord, lineages)


def test_a_spare_that_dies_before_adoption_is_dropped_and_the_worker_starts_fresh():
    coord, rt, lineages = _setup(Fault(kind="spare_dies", node=NODE2))
    t_request, t_join = _scale_to_three(coord, rt)
    assert rt.record.spares_started == ["node02"]  # one spare, never restarted on that node
    assert coord.membership.no_spare == {"node02": "spare process died (simulated)"}
    assert rt.record.adopted == [] and rt.record.fresh == ["w0", "w1", "w2"]
    assert t_join - t_request >= START_S
    assert any("spare worker on node node02 was lost" in x.message for x in coord.logs())
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert rt._spares == {}


def test_a_spare_found_dead_when_adopted_is_replaced_by_a_fresh_worker():
    # Long enough that the fresh start (two start-ups in a row) ends before the job does.
    coord, rt, lineages = _setup(Fault(kind="spare_dies_silently", node=NODE2), epochs=12)
    t_request, t_join = _scale_to_three(coord, rt, newcomer="w3")
    assert rt.record.adopted == ["w2"]  # it failed to start ...
    assert any("worker w2 failed to start" in x.message for x in coord.logs())
    assert rt.record.fresh[-1] == "w3"  # ... and w3 started fresh on the same node
    assert coord.membership.get("w3").node == "node02"
    assert t_join - t_request >= START_S
    coord.run()
    _assert_exactly_once(coord, lineages)


def test_a_lost_worker_is_replaced_by_adopting_the_spare():
    coord, rt, lineages = _setup(Fault(kind="die", worker=1, epoch=5, step=3))
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert rt.record.spares_started[0] == "node02" and rt.record.fresh == ["w0", "w1"]
    assert rt.record.adopted == ["w2"] and coord.membership.get("w2").node == "node02"
    lost = next(e.time for e in coord.membership_events() if e.kind == "failure")
    joined = next(
        e.time for e in coord.membership_events() if e.kind == "join" and e.worker == "w2"
    )
    assert joined - lost < 1.0


def test_spares_are_stopped_when_the_job_ends():
    coord, rt, _ = _setup(epochs=2)
    _run_to(coord, 1, 2)
    assert set(rt._spares) == {"node02"}
    coord.cancel("test")
    coord.run()
    assert coord.snapshot().state == JobState.CANCELLED
    assert rt._spares == {} and rt.record.spares_stopped == ["node02"]

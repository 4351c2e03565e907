"""A parameter-server job under the cluster scheduler: it takes node assignments (its
learners start on the granted slots, and move when a round re-assigns it), so the scheduler
can start and resize it as it does a synchronous job. Driven without Ray: the shipped driver
over the simulator's runtime (real gradients)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.membership import NodeAssignment
from dynabatch.scheduler.core.ps.engine import learners
from dynabatch.scheduler.runtime.seam import GroupReport

from tests.unit.test_ps_export import _job


def _placed(coord) -> Counter:
    return Counter(learners(coord.engine_state).values())


def test_a_ps_job_starts_on_its_assigned_slots_and_moves_when_reassigned() -> None:
    coord, _ = _job("ps-assigned", epochs=3)
    coord.assign({"n1": 2})  # the scheduler's grant, before the start (launch_coordinator)
    assert coord.start()
    assert _placed(coord) == {"n1": 2}
    coord.assign({"n0": 1, "n1": 1})
    assert coord.step()
    assert _placed(coord) == {"n0": 1, "n1": 1}
    left = [e for e in coord.events if e.kind == "leave"]
    assert [e.reason for e in left] == ["assigned elsewhere"] and left[0].node == "n1"
    while coord.step():
        pass
    snap = coord.snapshot()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    assert all(r.verified for r in coord.history()) and len(coord.history()) == 3
    assert coord.assigned() == (("n0", 1), ("n1", 1))


def test_an_assignment_naming_a_leaving_learner_takes_that_one_off_its_node() -> None:
    """An owner's drain under the cluster scheduler: one slot fewer on the learner's node,
    naming the learner. It leaves, not the one a plain re-assignment would move (w2, the
    newest); the others train on."""
    coord, _ = _job("ps-drained", epochs=3)
    coord.assign({"n1": 3})
    assert coord.start()
    on = learners(coord.engine_state)
    for _ in range(3):  # speeds measured: the one named is not simply the slowest
        assert coord.step()
    named = "w0"  # (left alone, the round's slot would go with w2: see the next line)
    assert sorted(on) == ["w0", "w1", "w2"]
    coord.assign(NodeAssignment((("n1", 2),), leaving=(named,)))
    assert coord.step()
    assert named not in learners(coord.engine_state)
    assert set(learners(coord.engine_state)) == set(on) - {named}
    [left] = [e for e in coord.events if e.kind == "leave"]
    assert (left.worker, left.reason) == (named, "drained")
    while coord.step():
        pass
    assert coord.snapshot().state == JobState.SUCCEEDED
    assert all(r.verified for r in coord.history())


def test_an_assigned_ps_job_reports_its_learners_to_the_cluster_scheduler_as_they_change():
    """As a synchronous job reports each group it forms: the scheduler's view shows the
    learners at once (``/v1/cluster``'s members), not at its next round's poll; and what it
    reports is what that poll would read from the job's snapshot. Unassigned, it reports
    nothing (no scheduler placed it)."""
    sent: list[GroupReport] = []
    coord, _ = _job("ps-reports", reports=SimpleNamespace(report=sent.append), epochs=3)
    coord.assign({"n1": 2})
    assert coord.start()
    assert [Counter(n for n, _ in r.workers) for r in sent] == [{"n1": 2}]
    coord.assign({"n0": 1, "n1": 1})
    assert coord.step()
    assert Counter(n for n, _ in sent[-1].workers) == {"n0": 1, "n1": 1}
    assert sent[-1] == GroupReport.of("ps-reports", coord.snapshot())
    quiet: list[GroupReport] = []
    coord, _ = _job("ps-alone", reports=SimpleNamespace(report=quiet.append))
    assert coord.start() and coord.step()
    assert quiet == []


def test_an_assigned_ps_job_refuses_its_own_scale_and_drain() -> None:
    coord, _ = _job("ps-owned")
    coord.assign({"n0": 1})
    assert coord.start()
    with pytest.raises(ValueError, match="assigned"):
        coord.scale(2)
    with pytest.raises(ValueError, match="assigned"):
        coord.drain(next(iter(learners(coord.engine_state))))

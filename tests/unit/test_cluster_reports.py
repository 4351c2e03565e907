"""Issue 50, left open: the members ``/v1/cluster`` shows are the job's own reports, fresh
within one round at the defaults.

The scheduler heard a job's members only when a round (every 30 s by default) polled its
coordinator, so after a scale, a drain or an assignment they lagged up to a round. The job
now reports itself whenever its group forms (the first time and at each regroup): the
scheduler actor (its class driven in-process, no Ray, no round run) steps the report at
once; the coordinator (on the simulator's runtime) sends one after each regroup, and none
when no scheduler placed it.
"""

from __future__ import annotations

from typing import Any

from dynabatch.actors.spec import parse_spec
from dynabatch.scheduler.runtime import cluster_scheduler as cluster_rt
from dynabatch.scheduler.runtime.seam import GroupReport
from dynabatch.scheduler.sync.coordinator import Coordinator

from tests.fakes import Lineages, sim_runtime
from tests.unit.test_assign_nodes import _assert_done, _run_to_epoch
from tests.unit.test_cluster_run import GANG, _scheduler, world  # noqa: F401
from tests.unit.test_engine_faults import N, _spec


def test_a_jobs_report_shows_its_members_at_once_without_a_round(world) -> None:  # noqa: F811
    sched = _scheduler(world)
    sched.sync([cluster_rt.JobEntry("a", parse_spec(GANG), 1.0)])
    sched.round()  # grants a both nodes and starts it; nothing polled it yet
    assert world["coordinators"]["a"].ran
    rounds = sched.view().round_no
    assert sched.view().job("a").members is None

    # Its first group formed on one node (the other worker still starting): told at once.
    sched.report("a", 0, [("n1", 120.0)], 64)
    view = sched.view()
    assert view.round_no == rounds  # no round ran
    assert view.job("a").members == (("n1", 1),)
    assert view.job("a").differs == "starting 1 worker on node n2"
    sched.report("a", 0, [("n1", 120.0), ("n2", 80.0)], 64)
    assert sched.view().job("a").members == (("n1", 1), ("n2", 1))
    assert sched.view().job("a").differs is None

    # A report of another coordinator generation (the job resumed since), or of a job the
    # scheduler does not hold, changes nothing.
    sched.report("a", 1, [("n1", 120.0)], 64)
    sched.report("gone", 0, [("n1", 1.0)], 64)
    assert sched.view().job("a").members == (("n1", 1), ("n2", 1))
    assert sched.view().round_no == rounds


class _Reports:
    """The cluster scheduler as the coordinator tells it of its group."""

    def __init__(self) -> None:
        self.sent: list[GroupReport] = []

    def report(self, report: GroupReport) -> None:
        self.sent.append(report)


def _coord(reports: Any) -> tuple[Coordinator, Lineages]:
    spec = _spec(workers=2, max_workers=3, epochs=3, spares=0)
    lineages = Lineages()
    rt = sim_runtime(spec, n_train=N, nodes=3, speeds={0: 1000, 1: 500, 2: 250},
                     gradients=lineages)
    return Coordinator("job", spec, runtime=rt, clock=rt.clock, reports=reports), lineages


def test_the_job_reports_each_group_it_forms_to_the_cluster_scheduler() -> None:
    reports = _Reports()
    coord, lineages = _coord(reports)
    coord.assign({"node00": 1, "node01": 1})  # the scheduler's first grant
    _run_to_epoch(coord, 1)
    first = reports.sent[0]  # its first group: no speed measured yet
    assert first == GroupReport("job", (("node00", 0.0), ("node01", 0.0)), 64.0)
    assert len(reports.sent) == coord.membership.generation == 1

    coord.assign({"node00": 1, "node01": 1, "node02": 1})  # grown by the scheduler
    _run_to_epoch(coord, 2)
    assert len(reports.sent) == coord.membership.generation == 2
    speeds = dict(reports.sent[-1].workers)  # measured, but the newcomer's
    assert sorted(speeds) == ["node00", "node01", "node02"]
    assert speeds["node00"] > 0 and speeds["node01"] > 0 and speeds["node02"] == 0.0
    coord.run()
    _assert_done(coord, lineages)


def test_a_job_no_scheduler_placed_reports_nothing() -> None:
    reports = _Reports()
    coord, _ = _coord(reports)  # no assignment: its membership decides
    _run_to_epoch(coord, 1)
    assert coord.membership.generation >= 1 and reports.sent == []

"""Issue 31: a cancel that arrives while a round is granting the job its nodes.

The scheduler actor's class driven in-process, step by step (no Ray, no timing: the fake
launch is where the cancel arrives, as the service's ``finished`` call would between the
round's grant and the launch's return). The grant must start no workers for the cancelled
job, keep no coordinator of it, and give its slots to the queue at the next round.
"""

from __future__ import annotations

from dynabatch.actors.spec import parse_spec
from dynabatch.scheduler.runtime import cluster_scheduler as cluster_rt

from tests.unit.test_cluster_run import GANG, _scheduler, world  # noqa: F401


def test_a_cancel_during_the_grant_starts_no_workers_and_frees_its_slots(world) -> None:  # noqa: F811
    w = world
    sched = _scheduler(w)
    spec = parse_spec(GANG)
    # The service's cancel arrives while a's coordinator launches.
    w["calls"].during_launch["a"] = lambda: sched.finished("a")
    sched.sync([cluster_rt.JobEntry("a", spec, 1.0), cluster_rt.JobEntry("b", spec, 2.0)])
    sched.round()  # grants a both nodes; a is cancelled while its coordinator launches
    a = w["coordinators"]["a"]
    assert w["launched"] == [("a", {"n1": 1, "n2": 1})]
    assert not a.ran  # no workers for a cancelled job
    assert a.killed
    assert sched.allocation("a") is None
    started, _ = sched.sync([cluster_rt.JobEntry("b", spec, 2.0)])
    assert started == []  # a is not taken for started (the service would poll it)

    view = sched.round()  # its slots go to the queue at the next round
    assert w["launched"][1] == ("b", {"n1": 1, "n2": 1})
    assert w["coordinators"]["b"].ran
    assert sched.allocation("b") == (("n1", 1), ("n2", 1))
    assert [j.job_id for j in view.jobs] == ["b"]

"""Issue 31, item 2: a node of a type no job has run on joins mid-run.

The rounds (scheduler/core/cluster/rounds.py) estimate every job's speed on the new type
(:func:`bootstrap`: from other jobs' ratios between types once one has run there, else the
per-type hints), may give the node to a job, stay within capacity and decide the same way
from the same state; a job's own measurement replaces the estimate and is kept when a later
measurement covers other types only.
"""

from __future__ import annotations

import pytest
from dynabatch.scheduler.core.cluster.rounds import (
    Entry,
    JobReported,
    NodesSeen,
    RoundState,
    Tick,
    policy_jobs,
    step,
)
from dynabatch.scheduler.core.cluster.throughput import ThroughputModel
from dynabatch.scheduler.core.cluster.values import ClusterKnobs, ClusterNode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

OLD = ("fast", "slow")
NEW = "new"


def _measured(state: RoundState, job_id: str, rates: dict[str, float]) -> JobReported:
    """The job's report of one worker per measured type, on the first node of that type (a
    type with no node listed is not measured)."""
    first = {}
    for n in state.nodes:
        first.setdefault(n.node_type, n.node_id)
    return JobReported(job_id, tuple((first[t], r) for t, r in rates.items() if t in first))


def _rates(state: RoundState, job_id: str) -> ThroughputModel:
    decided, _ = policy_jobs(state)
    return next(j.model for j in decided if j.job_id == job_id)


def _used(state: RoundState) -> dict[str, int]:
    used: dict[str, int] = {}
    for j in state.jobs:
        if j.started:
            for node, k in j.allocation:
                used[node] = used.get(node, 0) + k
    return used


@st.composite
def _run(draw):
    """Old-type nodes, jobs registered and measured on some old types, and the new node."""
    nodes = tuple(
        ClusterNode(f"n{i}", draw(st.sampled_from(OLD)), draw(st.integers(1, 3)))
        for i in range(draw(st.integers(1, 4)))
    )
    jobs = []
    for i in range(draw(st.integers(1, 4))):
        lo = draw(st.integers(1, 3))
        measured = draw(st.lists(st.sampled_from(OLD), unique=True))
        rates = {t: draw(st.floats(0.5, 20.0)) for t in measured}
        jobs.append((f"j{i}", lo, lo + draw(st.integers(0, 3)), draw(st.integers(0, 2)), rates))
    new = ClusterNode("z-new", NEW, draw(st.integers(1, 4)))
    return nodes, jobs, new


@pytest.mark.parametrize("policy", ["fifo", "fair", "goodput"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=_run(), hold=st.sampled_from([0.0, 50.0]))
def test_a_new_type_joining_mid_run_keeps_capacity_and_determinism(policy, run, hold):
    nodes, jobs, new = run
    knobs = ClusterKnobs(policy=policy, hold_s=hold)
    s, _ = step(RoundState(), NodesSeen(nodes), knobs)
    for jid, lo, hi, prio, _ in jobs:
        s, _ = step(s, Entry(jid, lo, hi, prio, 0.0), knobs)
    s, _ = step(s, Tick(1.0), knobs)
    for jid, *_, rates in jobs:
        if rates:
            s, _ = step(s, _measured(s, jid, rates), knobs)
    s, _ = step(s, NodesSeen((*nodes, new)), knobs)
    # Every job has an estimate for the new type (nobody ran there: the equal hints).
    for jid, *_ in jobs:
        assert _rates(s, jid).rate(NEW) > 0.0
        assert NEW not in _rates(s, jid).measured
    after, commands = step(s, Tick(100.0), knobs)
    # The same state decides the same way.
    assert step(s, Tick(100.0), knobs) == (after, commands)
    cap = {n.node_id: n.capacity for n in after.nodes}
    used = _used(after)
    assert all(node in cap and used[node] <= cap[node] for node in used), (used, cap)
    for c in commands:
        entry = after.job(c.job_id)
        assert entry.min_workers <= c.workers <= entry.max_workers
    # Fed back at the same time: nothing moves again (no flapping).
    assert step(after, Tick(100.0), knobs)[1] == ()


def test_the_new_type_is_given_estimated_from_other_jobs_and_replaced_once_measured():
    knobs = ClusterKnobs(policy="goodput", hold_s=0.0)
    old = (ClusterNode("n0", "slow", 1), ClusterNode("n1", "slow", 1))
    s = RoundState()
    for e in (NodesSeen(old), Entry("a", 1, 3, 0, 0.0), Entry("b", 1, 1, 0, 0.0)):
        s, _ = step(s, e, knobs)
    s, _ = step(s, Tick(1.0), knobs)
    s, _ = step(s, _measured(s, "a", {"slow": 10.0}), knobs)
    s, _ = step(s, _measured(s, "b", {"slow": 4.0}), knobs)
    # A node of a type nobody has run on joins; the policy gives it to a (room to grow).
    s, _ = step(s, NodesSeen((*old, ClusterNode("n2", NEW, 2))), knobs)
    s, _ = step(s, Tick(2.0), knobs)
    assert dict(s.job("a").allocation).get("n2", 0) > 0
    # a runs there and is measured on it alone: 3x its slow speed. Its slow measurement is
    # kept, and b's estimate for the new type comes from a's ratio (Sia's bootstrap).
    s, _ = step(s, _measured(s, "a", {NEW: 30.0}), knobs)
    a = _rates(s, "a")
    assert (a.rate("slow"), a.rate(NEW)) == (10.0, 30.0)
    assert a.measured == {"slow", NEW}
    assert _rates(s, "b").rate(NEW) == pytest.approx(12.0)
    assert NEW not in _rates(s, "b").measured
    # b's own measurement replaces the estimate.
    s, _ = step(s, _measured(s, "b", {NEW: 6.0, "slow": 4.0}), knobs)
    assert _rates(s, "b").rate(NEW) == 6.0
    assert NEW in _rates(s, "b").measured

"""Issue 50: the owner's requests in the pure cluster rounds (scheduler/core/cluster/rounds.py).

A scale is an event the rounds answer at once: refused with its reason (returned as a
``RequestRefused`` command, never dropped), or carried out now as far as free slots allow, past
the hold (which is for the scheduler's own moves), with what it still waits for on the
job's entry and in the view. An assignment the job refused is a fact: kept, shown, and not
sent again. The job's members (its own report) sit beside its decided allocation in the
view, with the reason they differ. And a hypothesis property over random runs of requests,
rounds, node losses and job ends: every decided allocation is within the job's bounds and
its nodes' capacity, and every request is answered.
"""

from __future__ import annotations

import pytest
from dynabatch.scheduler.core.cluster.rounds import (
    Abandon,
    AssignRefused,
    AssignTaken,
    Drained,
    Entry,
    JobGone,
    JobReported,
    Launched,
    NodesSeen,
    Reassign,
    RequestRefused,
    ResizeRequested,
    RoundState,
    Run,
    Start,
    Tick,
    step,
)
from dynabatch.scheduler.core.cluster.values import ClusterKnobs, ClusterNode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HOLD = 120.0


def _nodes(n: int, cap: int = 1) -> tuple[ClusterNode, ...]:
    return tuple(ClusterNode(f"n{i}", "cpu", cap) for i in range(n))


def _running(nodes, *jobs: Entry, policy: str = "goodput", at: float = 1.0):
    """The state after the jobs registered and one round started them."""
    knobs = ClusterKnobs(policy=policy, hold_s=HOLD)
    s, _ = step(RoundState(), NodesSeen(nodes), knobs)
    for j in jobs:
        s, _ = step(s, j, knobs)
    s, cmds = step(s, Tick(at), knobs)
    return s, knobs, cmds


def test_a_scale_up_is_assigned_at_once_past_the_hold_and_above_the_specs_max():
    """The issue's first finding: scale 2 -> 3 under serve's defaults (hold 120 s) was
    recorded and never carried out. Now: a Reassign at once, bounds the owner's size."""
    s, knobs, _ = _running(_nodes(4), Entry("a", 2, 2), policy="fifo")
    assert s.job("a").workers == 2
    s, cmds = step(s, ResizeRequested("a", 3, 2.0), knobs)  # within the hold
    assert cmds == (Reassign("a", (("n0", 1), ("n1", 1), ("n2", 1))),)
    a = s.job("a")
    assert (a.min_workers, a.max_workers, a.waits) == (2, 3, None)
    assert s.view.job("a").allocation == a.allocation
    assert "at its owner's request" in s.view.job("a").reason
    # The next round (still within the hold) keeps it: nothing is undone.
    s, cmds = step(s, Tick(3.0), knobs)
    assert cmds == () and s.job("a").workers == 3


def test_a_scale_down_is_assigned_at_once_and_lowers_the_gang():
    s, knobs, _ = _running(_nodes(3), Entry("a", 3, 3))
    s, cmds = step(s, ResizeRequested("a", 1, 2.0), knobs)
    assert [type(c) for c in cmds] == [Reassign] and cmds[0].workers == 1
    assert (s.job("a").min_workers, s.job("a").max_workers) == (1, 1)


def test_a_scale_beyond_the_free_slots_takes_what_is_free_and_says_what_it_waits_for():
    nodes = _nodes(3)
    s, knobs, _ = _running(nodes, Entry("a", 1, 1), Entry("b", 1, 1, submit_s=0.5))
    s, cmds = step(s, ResizeRequested("a", 3, 2.0), knobs)
    assert [c.workers for c in cmds] == [2]  # the one free slot now
    waits = "scale to 3: has 2; 1 more wait for free slots on its node types"
    assert s.job("a").waits == waits and s.view.job("a").waits == waits
    # Not held: once b ends, the next round grows it at once (within the hold).
    s, _ = step(s, JobGone("b"), knobs)
    s, cmds = step(s, Tick(3.0), knobs)
    assert cmds == (Reassign("a", (("n0", 1), ("n1", 1), ("n2", 1))),)
    assert s.job("a").waits is None and s.view.job("a").waits is None


@pytest.mark.parametrize(
    ("workers", "why"),
    [
        (0, "scale to 0: a job needs at least 1 worker"),
        (-2, "scale to -2: a job needs at least 1 worker"),
        (
            5,
            "scale to 5: above the cluster's capacity for this job: the nodes of its types "
            "hold 4 of its workers",
        ),
    ],
)
def test_a_scale_the_cluster_cannot_carry_out_is_refused_with_its_reason(workers, why):
    s, knobs, _ = _running(_nodes(4), Entry("a", 1, 2))
    after, cmds = step(s, ResizeRequested("a", workers, 2.0), knobs)
    assert cmds == (RequestRefused("a", why),) and after == s
    _, cmds = step(s, ResizeRequested("zz", 1, 2.0), knobs)
    assert cmds == (RequestRefused("zz", "the cluster scheduler does not hold job zz"),)


def test_the_capacity_for_a_job_counts_its_workers_sizes_and_types():
    nodes = (
        ClusterNode("c0", "cpu", 4),
        ClusterNode("c1", "cpu", 3),
        ClusterNode("x0", "other", 8),
    )
    s, knobs, _ = _running(nodes, Entry("a", 1, 1, worker_slots=2, eligible=frozenset({"cpu"})))
    # Workers of 2 slots: 2 on c0, 1 on c1; x0 is not its type.
    assert step(s, ResizeRequested("a", 3, 2.0), knobs)[1][0].workers == 3
    assert isinstance(step(s, ResizeRequested("a", 4, 2.0), knobs)[1][0], RequestRefused)


def test_a_refused_assignment_is_kept_shown_and_not_sent_again():
    """The job keeps what it has (its members), the view says why, and the round does not
    resend the very assignment it refused."""
    s, knobs, _ = _running(_nodes(2), Entry("a", 1, 2), policy="fifo")
    assert s.job("a").workers == 2
    s, _ = step(s, JobReported("a", (("n0", 3.0),)), knobs)  # only one worker came up
    s, _ = step(s, AssignRefused("a", (("n0", 1), ("n1", 1)), "2 workers: no"), knobs)
    assert s.job("a").allocation == (("n0", 1),)
    differs = "the job refused the assignment (n0: 1, n1: 1): 2 workers: no"
    assert s.view.job("a").differs == differs
    knobs = ClusterKnobs(policy="goodput", hold_s=0.0)
    s, cmds = step(s, Tick(500.0), knobs)
    assert cmds == ()  # the same assignment is not sent again
    assert s.view.job("a").differs == differs and s.view.job("a").allocation == (("n0", 1),)
    # The owner's new request clears it and is carried out.
    s, cmds = step(s, ResizeRequested("a", 1, 501.0), knobs)
    assert cmds == () and s.view.job("a").differs is None


def test_members_are_shown_beside_the_allocation_with_why_they_differ():
    s, knobs, _ = _running(_nodes(3), Entry("a", 1, 3), policy="fifo")
    assert s.view.job("a").members is None  # no report yet: nothing claimed
    s, _ = step(s, JobReported("a", (("n0", 2.0),)), knobs)
    view = s.view.job("a")
    assert view.allocation == (("n0", 1), ("n1", 1), ("n2", 1))
    assert view.members == (("n0", 1),)
    assert view.differs == "starting 1 worker on node n1; starting 1 worker on node n2"
    s, _ = step(s, JobReported("a", (("n0", 2.0), ("n1", 2.0), ("n2", 1.0), ("n2", 1.0))), knobs)
    assert s.view.job("a").differs == "draining 1 worker on node n2"
    s, _ = step(s, JobReported("a", (("n0", 2.0), ("n1", 2.0), ("n2", 1.0))), knobs)
    assert s.view.job("a").differs is None
    # The report's speeds are the job's model (one source: the snapshot's throughput).
    assert s.job("a").model.rate("cpu") == 2.0 and "cpu" in s.job("a").model.measured


def test_a_drain_refusal_is_returned_not_dropped():
    s, knobs, _ = _running(_nodes(2), Entry("a", 2, 2))
    after, cmds = step(s, Drained("a", "n0", 2.0, floor=2), knobs)
    assert cmds == (RequestRefused("a", "refused: 1 workers would be below its min_workers 2"),)
    assert after == s


def test_a_first_start_carries_out_the_newest_assignment():
    """A round moved the job while its coordinator launched: the newest allocation is sent
    before its workers start; a job no longer held is abandoned."""
    s, knobs, cmds = _running(_nodes(3), Entry("a", 1, 3), policy="fifo")
    (start,) = cmds
    assert start == Start("a", (("n0", 1), ("n1", 1), ("n2", 1)))
    s, _ = step(s, ResizeRequested("a", 1, 2.0), knobs)  # moved during the launch
    s, cmds = step(s, Launched("a", 0, start.slots), knobs)
    assert cmds == (Reassign("a", (("n0", 1),)), Run("a"))
    assert s.job("a").launched
    _, cmds = step(s, Launched("a", 0, (("n0", 1),)), knobs)
    assert cmds == (Run("a"),)
    s, _ = step(s, JobGone("a"), knobs)
    _, cmds = step(s, Launched("a", 0, start.slots), knobs)
    assert [type(c) for c in cmds] == [Abandon]


def test_a_clients_job_not_heard_from_is_dropped_by_the_rounds():
    from dynabatch.scheduler.core.cluster.rounds import Dropped, Heard

    knobs = ClusterKnobs(policy="fifo", hold_s=0.0, client_lease_s=60.0)
    s, _ = step(RoundState(), NodesSeen(_nodes(1)), knobs)
    s, _ = step(s, Entry("svc", 1, 1), knobs)
    s, _ = step(s, Tick(1.0), knobs)
    s, _ = step(s, Entry("run1", 1, 1, submit_s=2.0, client=True), knobs)
    s, _ = step(s, Heard("run1", 2.0), knobs)
    s, cmds = step(s, Tick(50.0), knobs)
    assert cmds == () and s.job("run1") is not None
    s, cmds = step(s, Tick(70.0), knobs)
    assert cmds == (Dropped("run1", "its run is not heard from"),) and s.job("run1") is None


# --- the property ----------------------------------------------------------------------------


@st.composite
def _runs(draw):
    """Random requests, rounds, node losses and job ends over up to 4 jobs and 4 nodes."""
    nodes = [
        ClusterNode(f"n{i}", draw(st.sampled_from(["a", "b"])), draw(st.integers(1, 3)))
        for i in range(draw(st.integers(1, 4)))
    ]
    events: list = [NodesSeen(tuple(nodes))]
    now = 0.0
    for _ in range(draw(st.integers(1, 30))):
        kind = draw(
            st.sampled_from(
                [
                    "register", "tick", "tick", "scale", "scale", "drain", "lose", "end",
                    "poll", "taken", "taken",
                ]
            )
        )
        jid = f"j{draw(st.integers(0, 3))}"
        if kind == "register":
            lo = draw(st.integers(1, 2))
            size = draw(st.sampled_from([1, 1, 2]))
            events.append(Entry(jid, lo, lo + draw(st.integers(0, 2)), 0, now, worker_slots=size))
        elif kind == "tick":
            now += draw(st.sampled_from([0.0, 1.0, HOLD / 2, 2 * HOLD]))
            events.append(Tick(now))
        elif kind == "scale":
            events.append(ResizeRequested(jid, draw(st.integers(-1, 8)), now))
        elif kind == "drain":
            events.append(Drained(jid, draw(st.sampled_from(nodes)).node_id, now,
                                  worker=draw(st.sampled_from([None, "w0"]))))
        elif kind == "lose":
            events.append(NodesSeen(tuple(draw(st.lists(st.sampled_from(nodes), unique=True)))))
        elif kind == "end":
            events.append(JobGone(jid))
        elif kind == "taken":
            # Its driver took what it was sent: resolved against the state when the test
            # reaches it.
            events.append(("taken", jid))
        else:
            node = draw(st.sampled_from(nodes)).node_id
            events.append(JobReported(jid, ((node, 1.0),)))
    events.append(Tick(now + 1.0))
    return events


def _answered(state: RoundState, event, commands) -> bool:
    """A request is carried out (a Reassign, or nothing to do: its size is what it has or
    waits for), or refused with a reason: never silently dropped."""
    refused = [c for c in commands if isinstance(c, RequestRefused)]
    if refused:
        return all(c.why for c in refused) and not any(isinstance(c, Reassign) for c in commands)
    entry = state.job(event.job_id)
    if entry is None:
        return False
    if isinstance(event, ResizeRequested):
        return entry.max_workers == event.workers and (
            entry.waits is not None or not entry.started or entry.workers == event.workers
        )
    return any(isinstance(c, Reassign) for c in commands)


@pytest.mark.parametrize("policy", ["fifo", "goodput"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=_runs())
def test_every_allocation_is_one_its_bounds_accept_and_every_request_is_answered(policy, events):
    knobs = ClusterKnobs(policy=policy, hold_s=HOLD)
    state = RoundState()
    for event in events:
        event = _resolved(state, event)
        if event is None:
            continue
        before = state
        state, commands = step(state, event, knobs)
        if isinstance(event, Tick):
            _check_resends(before, state, commands)
            # The started jobs' drivers come up (not sending what they were started with:
            # the scheduler's launch did).
            for c in commands:
                if isinstance(c, Start):
                    state, _ = step(state, Launched(c.job_id, 0, c.slots), knobs)
        if isinstance(event, ResizeRequested | Drained):
            assert _answered(state, event, commands), (event, commands)
        alive = {n.node_id: n for n in state.nodes}
        used: dict[str, int] = {}
        for j in state.jobs:
            assert j.min_workers <= j.max_workers
            if not j.started:
                continue
            lost = any(node not in alive for node, _ in j.allocation)
            for node, k in j.allocation:
                if node in alive:
                    used[node] = used.get(node, 0) + k * j.size_on(alive[node])
            # Within its bounds, unless a lost node left it short (it keeps its survivors)
            # or an owner's request waits for slots.
            if not lost and j.waits is None and isinstance(event, Tick):
                assert j.workers <= j.max_workers, j
                assert j.workers >= j.min_workers or _short(state, j), j
        if isinstance(event, Tick):
            assert all(used[n] <= alive[n].capacity for n in used), (used, state.nodes)
        for c in commands:
            if isinstance(c, Reassign | Start):
                j = state.job(c.job_id)
                assert c.workers <= j.max_workers and c.slots == j.allocation


def _short(state: RoundState, job: Entry) -> bool:
    """Its view says it keeps fewer than its minimum after a node was lost."""
    return "below its min_workers" in state.view.job(job.job_id).reason


def _resolved(state: RoundState, event):
    """A ("taken", job) placeholder as the real event now, or None when nothing was sent to
    the job."""
    if not isinstance(event, tuple):
        return event
    entry = state.job(event[1])
    return None if entry is None or entry.sent is None else AssignTaken(entry.job_id, entry.sent)


def _check_resends(before: RoundState, after: RoundState, commands) -> None:
    """An assignment a launched job's driver has not taken is sent again at every round
    (unless the round moves it anew), as itself: no resize counted, no hold restarted."""
    decided = after.resizes - before.resizes
    resent = 0
    for j in before.jobs:
        if not (j.launched and j.sent is not None and j.sent == j.allocation):
            continue
        mine = [c for c in commands if c.job_id == j.job_id]
        now = after.job(j.job_id)
        if now is None or now.allocation != j.allocation:
            continue  # moved (a new Reassign), or kept short after a lost node (none)
        assert mine == [Reassign(j.job_id, j.allocation, j.leaving)], (j, commands)
        resent += 1
        assert now.last_resize_s == j.last_resize_s
    assert decided == sum(isinstance(c, Reassign) for c in commands) - resent
    for j in after.jobs:
        sent = [c.slots for c in commands if isinstance(c, Reassign) and c.job_id == j.job_id]
        was = before.job(j.job_id)
        if sent:
            assert j.sent == tuple(sorted(sent[0])), j
        else:
            assert j.sent == (was.sent if was is not None else None), j


def test_a_drain_not_taken_is_sent_again_with_the_worker_its_owner_named():
    """Sent again after a send that timed out, an owner's drain still names its worker:
    the job takes that one off the node, not the slowest there."""
    s, knobs, (start,) = _running(_nodes(1, cap=3), Entry("a", 1, 3), policy="fifo")
    s, _ = step(s, Launched("a", 0, start.slots), knobs)
    s, cmds = step(s, Drained("a", "n0", 2.0, worker="w0"), knobs)
    assert cmds == (Reassign("a", (("n0", 2),), leaving=("w0",)),)
    s, cmds = step(s, Tick(3.0), knobs)  # not taken: sent again, as itself
    assert cmds == (Reassign("a", (("n0", 2),), leaving=("w0",)),)
    s, _ = step(s, AssignTaken("a", (("n0", 2),)), knobs)
    s, cmds = step(s, Tick(4.0), knobs)
    assert cmds == () and s.job("a").sent is None


def test_an_assignment_its_driver_did_not_take_is_sent_again_each_round_until_taken():
    """An owner's scale is a Reassign at once; when its driver never answers (the call
    timed out), every later round sends the same assignment again, counting no new resize
    and restarting no hold, until an AssignTaken; an older assignment taken late does not
    stop a newer one."""
    s, knobs, (start,) = _running(_nodes(3), Entry("a", 1, 3), policy="fifo")
    s, _ = step(s, Launched("a", 0, start.slots), knobs)
    s, cmds = step(s, ResizeRequested("a", 2, 2.0), knobs)
    two = (("n0", 1), ("n1", 1))
    assert cmds == (Reassign("a", two),) and s.job("a").sent == two
    resizes, held_from = s.resizes, s.job("a").last_resize_s
    for now in (3.0, 4.0):
        s, cmds = step(s, Tick(now), knobs)
        assert cmds == (Reassign("a", two),)
        assert (s.resizes, s.job("a").last_resize_s) == (resizes, held_from)
    s, cmds = step(s, ResizeRequested("a", 1, 5.0), knobs)
    s, _ = step(s, AssignTaken("a", two), knobs)  # the old one answered late
    assert s.job("a").sent == (("n0", 1),)
    s, cmds = step(s, Tick(6.0), knobs)
    assert cmds == (Reassign("a", (("n0", 1),)),)
    s, _ = step(s, AssignTaken("a", (("n0", 1),)), knobs)
    s, cmds = step(s, Tick(7.0), knobs)
    assert cmds == () and s.job("a").sent is None

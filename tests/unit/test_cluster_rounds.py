"""The cluster scheduler's rounds (scheduler/core/cluster/rounds.py): random event sequences
keep every node within capacity, start only whole gangs, never resize within the hold
unless a node was lost, and a rebuilt scheduler touches no job. The random runs mix in GPU
nodes and jobs sharing GPUs (fractional ``worker_gpus``)."""

from __future__ import annotations

import pytest
from dynabatch.scheduler.core.cluster.ray_nodes import gpu_units
from dynabatch.scheduler.core.cluster.rounds import (
    Drained,
    Entry,
    FoundRunning,
    JobGone,
    JobReported,
    Listed,
    NodesSeen,
    Reassign,
    RequestRefused,
    RoundState,
    Start,
    StartFailed,
    Tick,
    drain_refusal,
    step,
)
from dynabatch.scheduler.core.cluster.throughput import ThroughputModel
from dynabatch.scheduler.core.cluster.values import GPU_UNITS, ClusterKnobs, ClusterNode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TYPES = ("fast", "slow")
HOLD = 10.0


def _nodes(spec: list[tuple[str, int]]) -> tuple[ClusterNode, ...]:
    return tuple(ClusterNode(f"n{i}", t, c) for i, (t, c) in enumerate(spec))


@st.composite
def _events(draw):
    """A run of events over up to 5 jobs and 5 nodes, with time moving on by ticks."""
    n_nodes = draw(st.integers(1, 5))
    all_nodes = []
    for i in range(n_nodes):
        t = draw(st.sampled_from((*TYPES, "gpu")))
        # A GPU node's capacity is its GPUs in shares of one.
        cap = draw(st.integers(0, 3)) * (GPU_UNITS if t == "gpu" else 1)
        all_nodes.append(ClusterNode(f"n{i}", t, cap, gpu=t == "gpu"))
    events: list = [NodesSeen(tuple(all_nodes))]
    now = 0.0
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(
            st.sampled_from(
                [
                    "register",
                    "register",
                    "tick",
                    "tick",
                    "tick",
                    "finish",
                    "nodes",
                    "measure",
                    "failed",
                    "drain",
                    "listed",
                ]
            )
        )
        jid = f"j{draw(st.integers(0, 4))}"
        if kind == "register":
            lo = draw(st.integers(1, 3))
            events.append(
                Entry(
                    jid,
                    lo,
                    lo + draw(st.integers(0, 3)),
                    draw(st.integers(0, 2)),
                    now,
                    worker_slots=draw(st.sampled_from([1, 1, 2])),
                    gpu_units=gpu_units(draw(st.sampled_from([1.0, 0.0, 0.5, 0.25, 1 / 3]))),
                )
            )
        elif kind == "tick":
            now += draw(st.sampled_from([0.0, 1.0, 5.0, HOLD, 3 * HOLD]))
            events.append(Tick(now))
        elif kind == "finish":
            events.append(JobGone(jid))
        elif kind == "nodes":
            keep = draw(st.lists(st.sampled_from(all_nodes), unique=True))
            events.append(NodesSeen(tuple(keep)))
        elif kind == "measure":  # the job's report: one worker on each node
            workers = tuple((n.node_id, draw(st.floats(0.5, 10.0))) for n in all_nodes)
            events.append(JobReported(jid, workers, 64.0))
        elif kind == "listed":  # the service's sync: the live jobs it knows
            ids = draw(st.sets(st.sampled_from([f"j{i}" for i in range(5)])))
            events.append(Listed(frozenset(ids)))
        elif kind == "drain":
            node = draw(st.sampled_from(all_nodes)).node_id
            events.append(Drained(jid, node, now, draw(st.integers(1, 3))))
        else:
            events.append(StartFailed(jid, "no"))
    events.append(Tick(now + 1.0))
    return events


@pytest.mark.parametrize("policy", ["fifo", "fair", "goodput"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=_events())
def test_random_runs_keep_capacity_gangs_and_holds(policy, events):
    knobs = ClusterKnobs(policy=policy, hold_s=HOLD)
    state = RoundState()
    for event in events:
        before = state
        state, commands = step(state, event, knobs)
        # A generation seen to end is the service's: never held again as it was.
        assert not {j.job_id for j in state.jobs} & {job for job, _ in state.ended}
        if isinstance(event, Listed):
            assert {j.job_id for j in state.jobs} <= event.job_ids
            assert {job for job, _ in state.ended} <= event.job_ids
        if isinstance(event, Drained):
            _check_drain(before, state, event, commands)
            continue
        if not isinstance(event, Tick):
            assert commands == ()
            continue
        cap = {n.node_id: n.capacity for n in state.nodes}
        gpu = {n.node_id: n.gpu for n in state.nodes}
        seen = set()
        for c in commands:
            assert c.job_id not in seen  # one command per job and round
            seen.add(c.job_id)
            entry = before.job(c.job_id)
            assert entry is not None
            assert all(node in cap and k >= 1 for node, k in c.slots)
            if isinstance(c, Start):
                assert not entry.started
                # A whole gang, never more than asked.
                assert entry.min_workers <= c.workers <= entry.max_workers
            else:
                assert isinstance(c, Reassign) and entry.started
                lost = any(node not in cap for node, _ in entry.allocation) or any(
                    k > cap[node] for node, k in entry.allocation if node in cap
                )
                outside = not entry.min_workers <= entry.workers <= entry.max_workers
                # Within the hold only a lost node (or the job's own new bounds) moves it.
                if entry.last_resize_s is not None and event.now - entry.last_resize_s < HOLD:
                    assert lost or outside, (entry, c)
        # What the started jobs hold after the round fits every node (in slots: a worker of
        # a job of worker_slots 2 takes two; on a GPU node, its share of a GPU).
        used: dict[str, int] = {}
        for j in state.jobs:
            if j.started:
                for node, k in j.allocation:
                    if node in cap:
                        size = j.gpu_units if gpu[node] else j.worker_slots
                        used[node] = used.get(node, 0) + k * size
        assert all(used[n] <= cap[n] for n in used), (used, cap)
        # Started jobs are never queued; their allocation is what the commands said.
        assert not [j for j in state.view.jobs if j.queued and state.job(j.job_id).started]
        for c in commands:
            assert state.job(c.job_id).allocation == c.slots
            assert state.job(c.job_id).last_resize_s == event.now


def test_two_jobs_asking_the_whole_cluster_one_at_a_time():
    """The issue's deadlock: two gangs of 2 on 2 slots: one starts whole, the other holds
    nothing and waits, then starts whole when the first finishes."""
    knobs = ClusterKnobs(policy="fifo", hold_s=0.0)
    s = RoundState()
    for e in (
        NodesSeen(_nodes([("cpu", 1), ("cpu", 1)])),
        Entry("a", 2, 2, 0, 0.0),
        Entry("b", 2, 2, 0, 0.0),
    ):
        s, _ = step(s, e, knobs)
    s, cmds = step(s, Tick(1.0), knobs)
    assert cmds == (Start("a", (("n0", 1), ("n1", 1))),)
    assert s.view.job("b").queued and s.view.job("b").allocation == ()
    s, cmds = step(s, Tick(2.0), knobs)
    assert cmds == ()
    s, _ = step(s, JobGone("a"), knobs)
    s, cmds = step(s, Tick(3.0), knobs)
    assert cmds == (Start("b", (("n0", 1), ("n1", 1))),)


def _check_drain(before: RoundState, after: RoundState, event: Drained, commands) -> None:
    """A drain gives up exactly one slot on its node, at once, or changes nothing (the job
    does not run there, or would fall below its floor); its bounds drop to what it keeps, so
    no later round hands the slot back."""
    old = before.job(event.job_id)
    held = dict(old.allocation) if old is not None and old.started else {}
    why = drain_refusal(before, event.job_id, event.node_id, event.floor)
    if held.get(event.node_id, 0) < 1 or sum(held.values()) - 1 < max(1, event.floor):
        assert why is not None  # returned, never dropped: the actor relays it
        assert commands == (RequestRefused(event.job_id, why),) and after == before
        return
    assert why is None
    held[event.node_id] -= 1
    new = after.job(event.job_id)
    assert commands == (Reassign(event.job_id, new.allocation),)
    assert dict(new.allocation) == {n: k for n, k in held.items() if k}
    keeps = sum(held.values())
    assert new.max_workers == min(old.max_workers, keeps) and new.last_resize_s == event.now
    assert new.min_workers == min(old.min_workers, keeps)


def test_a_drain_gives_up_the_slot_and_no_round_gives_it_back():
    knobs = ClusterKnobs(policy="goodput", hold_s=0.0)
    s = RoundState()
    for e in (NodesSeen(_nodes([("cpu", 1)] * 3)), Entry("a", 1, 3, 0, 0.0)):
        s, _ = step(s, e, knobs)
    s, (start,) = step(s, Tick(1.0), knobs)
    assert start.workers == 3
    s, cmds = step(s, Drained("a", "n1", 2.0, worker="w1"), knobs)
    # The owner named the worker: it is the one that leaves its node, not the slowest there.
    assert cmds == (Reassign("a", (("n0", 1), ("n2", 1)), leaving=("w1",)),)
    s, cmds = step(s, Tick(3.0), knobs)
    assert cmds == () and s.job("a").allocation == (("n0", 1), ("n2", 1))
    # Another job takes the freed slot; the drained one grows only when asked to.
    s, _ = step(s, Entry("b", 1, 1, 0, 4.0), knobs)
    s, cmds = step(s, Tick(5.0), knobs)
    assert cmds == (Start("b", (("n1", 1),)),)
    s, cmds = step(s, Drained("a", "n1", 6.0), knobs)  # no slot of its there: refused
    assert cmds == (RequestRefused("a", "job a holds no slot on node n1"),)
    assert drain_refusal(s, "a", "n1", 1) == "job a holds no slot on node n1"
    s, _ = step(s, Drained("a", "n0", 7.0), knobs)
    s, cmds = step(s, Drained("a", "n2", 8.0), knobs)  # its last worker: refused
    assert [type(c) for c in cmds] == [RequestRefused] and s.job("a").allocation == (("n2", 1),)
    assert drain_refusal(s, "a", "n2", 1) == "refused: 0 workers would be below its min_workers 1"
    assert drain_refusal(s, "zz", "n2", 1) == "it does not run job zz"


def test_goodput_shrinks_a_running_job_to_admit_a_new_one_and_grows_it_back():
    knobs = ClusterKnobs(policy="goodput", hold_s=0.0)
    s = RoundState()
    for e in (NodesSeen(_nodes([("cpu", 1)] * 3)), Entry("a", 1, 3, 0, 0.0)):
        s, _ = step(s, e, knobs)
    s, cmds = step(s, Tick(1.0), knobs)
    assert [type(c) for c in cmds] == [Start] and cmds[0].workers == 3
    s, _ = step(s, Entry("b", 2, 2, 0, 2.0), knobs)
    s, cmds = step(s, Tick(3.0), knobs)
    by = {c.job_id: c for c in cmds}
    assert isinstance(by["a"], Reassign) and by["a"].workers == 1
    assert isinstance(by["b"], Start) and by["b"].workers == 2
    assert s.resizes == 1
    s, _ = step(s, JobGone("b"), knobs)
    s, cmds = step(s, Tick(4.0), knobs)
    assert cmds == (Reassign("a", (("n0", 1), ("n1", 1), ("n2", 1))),)
    assert s.view.resizes == 2


def test_a_running_job_is_not_sent_back_to_the_queue_by_a_higher_priority():
    knobs = ClusterKnobs(policy="goodput", hold_s=0.0)
    s = RoundState()
    for e in (NodesSeen(_nodes([("cpu", 1)] * 2)), Entry("low", 2, 2, 0, 0.0)):
        s, _ = step(s, e, knobs)
    s, _ = step(s, Tick(1.0), knobs)
    s, _ = step(s, Entry("high", 2, 2, 5, 2.0), knobs)
    s, cmds = step(s, Tick(3.0), knobs)
    assert cmds == ()
    assert s.view.job("high").queued and s.view.job("high").priority == 5
    assert not s.view.job("low").queued


def test_a_lost_node_reallocates_within_the_hold():
    knobs = ClusterKnobs(policy="goodput", hold_s=100.0)
    nodes = _nodes([("cpu", 1)] * 3)
    s = RoundState()
    for e in (NodesSeen(nodes[:2]), Entry("a", 2, 2, 0, 0.0)):
        s, _ = step(s, e, knobs)
    s, cmds = step(s, Tick(1.0), knobs)
    assert cmds == (Start("a", (("n0", 1), ("n1", 1))),)
    s, _ = step(s, NodesSeen((nodes[0], nodes[2])), knobs)
    s, cmds = step(s, Tick(2.0), knobs)
    assert cmds == (Reassign("a", (("n0", 1), ("n2", 1))),)


def test_a_job_left_below_its_minimum_keeps_its_slots_and_no_one_takes_them():
    knobs = ClusterKnobs(policy="goodput", hold_s=0.0)
    nodes = _nodes([("cpu", 1)] * 2)
    s = RoundState()
    for e in (NodesSeen(nodes), Entry("a", 2, 2, 0, 0.0)):
        s, _ = step(s, e, knobs)
    s, _ = step(s, Tick(1.0), knobs)
    s, _ = step(s, Entry("b", 1, 1, 0, 2.0), knobs)
    s, _ = step(s, NodesSeen(nodes[1:]), knobs)
    s, cmds = step(s, Tick(3.0), knobs)
    assert cmds == ()
    assert s.job("a").allocation == (("n1", 1),)
    assert "below its min_workers 2" in s.view.job("a").reason
    assert s.view.job("b").queued


def test_a_failed_start_waits_again_holding_nothing_and_says_why():
    knobs = ClusterKnobs(policy="fifo", hold_s=0.0)
    s = RoundState()
    for e in (NodesSeen(_nodes([("cpu", 1)])), Entry("a", 1, 1, 0, 0.0)):
        s, _ = step(s, e, knobs)
    s, _ = step(s, Tick(1.0), knobs)
    s, _ = step(s, StartFailed("a", "name taken"), knobs)
    assert s.job("a").allocation == () and not s.job("a").started
    s, cmds = step(s, Tick(2.0), knobs)
    assert cmds == (Start("a", (("n0", 1),)),)


def test_a_generation_seen_to_end_is_never_queued_again_until_the_service_decides():
    """Its driver died (or ended): the service, which still lists the job, must not get it
    started again as the same generation behind its back (no resume recorded, no log
    line); its next generation (a resume) is queued as any job."""
    knobs = ClusterKnobs(policy="fifo", hold_s=0.0)
    s = RoundState()
    for e in (NodesSeen(_nodes([("cpu", 1)])), Entry("a", 1, 1, 0, 0.0, generation=2)):
        s, _ = step(s, e, knobs)
    s, cmds = step(s, Tick(1.0), knobs)
    assert cmds == (Start("a", (("n0", 1),)),)
    s, _ = step(s, JobGone("a"), knobs)
    assert s.job("a") is None and s.ended == (("a", 2),)
    for generation in (2, 1):  # the service's next sync lists it as it was
        s, _ = step(s, Entry("a", 1, 1, 0, 0.0, generation=generation), knobs)
        s, cmds = step(s, Tick(2.0), knobs)
        assert s.job("a") is None and cmds == ()
    s, _ = step(s, Entry("a", 1, 1, 0, 0.0, generation=3), knobs)  # resumed
    assert s.ended == ()
    s, cmds = step(s, Tick(3.0), knobs)
    assert cmds == (Start("a", (("n0", 1),)),)
    # The service no longer lists a job: what the rounds knew of it goes.
    s, _ = step(s, JobGone("a"), knobs)
    s, _ = step(s, Listed(frozenset({"b"})), knobs)
    assert s.ended == () and s.jobs == ()


def test_eligible_types_limit_a_job():
    knobs = ClusterKnobs(policy="goodput", hold_s=0.0)
    s = RoundState()
    for e in (
        NodesSeen(_nodes([("cpu", 2), ("gpu", 2)])),
        Entry("a", 1, 4, 0, 0.0, eligible=frozenset({"gpu"})),
    ):
        s, _ = step(s, e, knobs)
    s, cmds = step(s, Tick(1.0), knobs)
    assert cmds == (Start("a", (("n1", 2),)),)


def rebuild(nodes, running, queued, now: float) -> RoundState:
    """A new scheduler's state as the actor builds it: the running jobs adopted as they run
    (holding their nodes from ``now``), the queued ones registered."""
    knobs = ClusterKnobs()
    state, _ = step(RoundState(), NodesSeen(tuple(nodes)), knobs)
    for job in running:
        state, _ = step(state, FoundRunning(job, now), knobs)
    for job in queued:
        state, _ = step(state, job, knobs)
    return state


def test_rebuild_touches_no_job_and_keeps_the_allocation():
    """A new scheduler from the live jobs: its first round sends no command to a running
    job, and a queued one starts only on what they leave free."""
    knobs = ClusterKnobs(policy="goodput", hold_s=HOLD)
    nodes = _nodes([("cpu", 1)] * 3)
    s = rebuild(
        nodes,
        [Entry("a", 1, 3, allocation=(("n1", 1), ("n0", 1)))],
        [Entry("b", 1, 1, 0, 5.0), Entry("a", 1, 3)],
        now=50.0,
    )
    assert s.job("a").started and s.job("a").allocation == (("n0", 1), ("n1", 1))
    assert not s.job("b").started
    s, cmds = step(s, Tick(51.0), knobs)
    assert cmds == (Start("b", (("n2", 1),)),)
    assert s.view.job("a").allocation == (("n0", 1), ("n1", 1))
    # The same state rebuilt again (a second restart) decides the same.
    again = rebuild(
        nodes,
        [
            Entry("a", 1, 3, allocation=(("n0", 1), ("n1", 1))),
            Entry("b", 1, 1, 0, 5.0, (("n2", 1),)),
        ],
        [],
        now=60.0,
    )
    again, cmds = step(again, Tick(61.0), knobs)
    assert cmds == ()
    assert again.view.job("b").allocation == (("n2", 1),)


def test_two_equal_new_jobs_span_both_gpu_types_from_their_first_round():
    """Issue 52 item 5: before any job has measured a type, the rounds rate the types by a
    prior per node type (the GPU model's class), not as equal, so two equal jobs on an
    H100 node and a V100 node both start on both types. (Each job's step has a fixed cost,
    its all-reduce, so a job gains less from each worker it adds.)"""
    knobs = ClusterKnobs(policy="goodput", hold_s=0.0)
    s = RoundState()
    nodes = (ClusterNode("h", "gpu-H100x2", 2 * GPU_UNITS, gpu=True),
             ClusterNode("v", "gpu-V100x2", 2 * GPU_UNITS, gpu=True))
    unmeasured = ThroughputModel.of({}, (), overhead_s=0.5, global_batch=1.0)
    for e in (NodesSeen(nodes), Entry("a", 1, 4, 0, 0.0, model=unmeasured),
              Entry("b", 1, 4, 0, 0.0, model=unmeasured)):
        s, _ = step(s, e, knobs)
    s, cmds = step(s, Tick(1.0), knobs)
    starts = {c.job_id: dict(c.slots) for c in cmds if isinstance(c, Start)}
    assert set(starts) == {"a", "b"}
    assert all(set(slots) == {"h", "v"} for slots in starts.values()), starts

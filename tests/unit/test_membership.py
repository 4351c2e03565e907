"""Membership: bounds, spawning, holders of the state, regroup plans."""

from __future__ import annotations

import pytest
from dynabatch.scheduler.core.membership import ORIGIN, Membership, NodeInfo, SparePlan
from dynabatch.scheduler.core.sync.loop import MembershipView
from dynabatch.scheduler.core.sync.protocol import Position
from hypothesis import given
from hypothesis import strategies as st


def _nodes(n):
    return [NodeInfo(f"n{i}", cpus=1.0) for i in range(n)]


def _m(**kw):
    base = dict(workers=3, min_workers=None, max_workers=None, smallest_batch=64, max_batch=None)
    base.update(kw)
    return Membership(**base)


def _start_all(m, nodes, starting=True):
    for s in m.spawns(nodes, starting, lambda g: 0.0):
        m.started(s.worker_id)


@given(workers=st.one_of(st.none(), st.integers(1, 50)), max_workers=st.one_of(
    st.none(), st.integers(1, 50)), b=st.integers(1, 40), nodes=st.integers(0, 60),
    rounds=st.integers(1, 4))
def test_never_more_members_than_the_bounds_allow(workers, max_workers, b, nodes, rounds):
    if workers is not None and max_workers is not None and workers > max_workers:
        workers = max_workers
    m = _m(workers=workers, max_workers=max_workers, smallest_batch=b)
    for r in range(rounds):
        _start_all(m, _nodes(nodes), starting=r == 0)
        assert len(m.members) <= m.max_size <= b
        assert len(m.members) + len(m.pending) <= max(m.max_size, 1)
    assert len({x.worker_id for x in m.members}) == len(m.members)


def test_workers_auto_is_bounded_by_global_batch_and_max_workers():
    assert _m(workers=None, smallest_batch=8).max_size == 8
    assert _m(workers=None, smallest_batch=8, max_workers=5).max_size == 5
    assert _m(workers=None, smallest_batch=10**6).max_size == 4096


def test_min_size_covers_the_global_batch_under_max_batch():
    m = _m(min_workers=1, max_batch=24)
    assert m.min_size == 3
    _start_all(m, _nodes(2), starting=False)
    assert "max_batch 24 x workers must hold global_batch 64" in m.shortfall()


def _needs_state(m: Membership) -> bool:
    """What the step loop derives from this membership (its view, a regroup due)."""
    holders = tuple(x.worker_id for x in m.holders())
    return MembershipView(members=m.rank_order(), holders=holders, dirty=True).needs_state


def test_holders_and_rank_order():
    m = _m()
    _start_all(m, _nodes(3))
    assert not _needs_state(m)  # at the origin, the seeded weights are the state
    m.regrouped(m.rank_order())
    m.progressed({"w0": Position(0, 5), "w1": Position(0, 4)})  # w2 lost, no report
    m.remove("w2", "failure", "died")
    assert m.committed == Position(0, 5)
    assert [x.worker_id for x in m.holders()] == ["w0"]
    assert m.rank_order()[0] == "w0" and not _needs_state(m)
    # The holder dies too: a newcomer (at the origin) must not become the source.
    m.remove("w0", "failure", "died")
    m.remove("w1", "failure", "died")
    _start_all(m, _nodes(4), starting=False)
    assert _needs_state(m)
    m.restored(Position(0, 0))
    assert not _needs_state(m)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 20)), min_size=1, max_size=6))
def test_the_source_always_holds_the_furthest_reported_state(reports):
    m = _m(workers=6)
    _start_all(m, _nodes(6))
    m.regrouped(m.rank_order())
    progress = {f"w{w}": Position(1, s) for w, s in reports}
    m.progressed(progress)
    order = m.rank_order()
    assert m.get(order[0]).version == max(progress.values()) == m.committed
    m.regrouped(order)
    assert all(x.version == m.committed for x in m.members)


def test_evicted_straggler_node_gets_no_new_worker():
    m = _m()
    _start_all(m, _nodes(3))
    change = m.remove("w2", "evict", "straggler")
    assert change.kind == "evict" and change.node == "n2"
    full = [NodeInfo(f"n{i}", free=False) for i in range(3)]
    assert m.spawns(full, False, lambda g: 0.0) == []
    # With room on the others, the replacement shares one of them, never the straggler's.
    assert [s.node_id for s in m.spawns(_nodes(3), False, lambda g: 0.0)] == ["n0"]


def test_drain_and_scale_requests():
    m = _m()
    _start_all(m, _nodes(3))
    assert m.draining() == []
    m.request_drain("w1")
    assert m.draining() == ["w1"]  # the engine settles the evaluations before the drain
    assert [c.worker for c in m.apply_drains()] == ["w1"]
    assert m.draining() == []
    with pytest.raises(KeyError):
        m.request_drain("w9")
    m.request_drain("w0")
    with pytest.raises(ValueError, match="last worker"):
        m.request_drain("w2")
    m.request_scale(1000)
    assert m.max_size == 64  # never more workers than samples per step
    assert Position(0, 0) == ORIGIN


# --- spares ---------------------------------------------------------------------------
def _cpu(g):
    return 0.0


def test_a_scale_up_adopts_the_spare_on_the_idle_node():
    m = _m(workers=2, max_workers=2)
    nodes = _nodes(3)
    _start_all(m, nodes)
    assert m.spare_plan(nodes, 1).start == ("n2",)
    assert m.spare_plan(nodes, 1).start == ()  # kept, not started twice
    m.request_scale(3)
    (s,) = m.spawns(nodes, False, _cpu)
    assert (s.node_id, s.adopt) == ("n2", True)
    assert m.spares == set()  # the spare is the pending worker now
    assert m.spare_plan(nodes, 1).start == ()  # no idle node left


def test_no_spare_on_busy_excluded_or_spare_lost_nodes_and_one_on_a_gpu_node():
    m = _m(workers=1, max_workers=1)
    nodes = [NodeInfo("n0"), NodeInfo("n1", free=False), NodeInfo("n2", gpus=1.0),
             NodeInfo("n3"), NodeInfo("n4")]
    _start_all(m, nodes)  # w0 on n0
    m.excluded_nodes["n3"] = "straggler"
    # A GPU node gets a spare too (issue 30 item 7; it holds the GPU its worker will drive,
    # scheduler/runtime/pool.py).
    assert m.spare_plan(nodes, 10).start == ("n2", "n4")
    m.spare_lost("n4", "died")
    assert m.spares == {"n2"}
    assert m.spare_plan(nodes, 10) == m.spare_plan(nodes, 10)
    assert m.spare_plan(nodes, 10).start == ()
    assert m.drop_spares() == ("n2",) and m.spares == set()


_OPS = st.lists(st.tuples(
    st.sampled_from(["plan", "spawn", "start", "lose", "evict", "spare_lost", "scale"]),
    st.integers(0, 7), st.integers(0, 3)), max_size=40)
_NODE_SET = st.lists(st.tuples(st.integers(0, 7), st.booleans(), st.booleans()), max_size=8)


@given(ops=_OPS, views=st.lists(_NODE_SET, min_size=1, max_size=5),
       workers=st.integers(1, 4), max_workers=st.integers(1, 6))
def test_spares_are_bounded_and_never_where_a_worker_is(ops, views, workers, max_workers):
    """Under any sequence of node views, spawns, starts, losses, evictions, scale requests
    and lost spares: at most ``limit`` spares, one per node, each started on a free node,
    and each on an eligible, CPU-only, not excluded node with none of the job's workers,
    whose spare was never lost; a spawn adopts exactly when its node held a spare, and a
    spare is never started twice nor stopped unless it was there."""
    m = _m(workers=min(workers, max_workers), max_workers=max_workers)
    gpus_on = lambda g: 1.0 if g >= 1 else 0.0  # noqa: E731
    lost: set[str] = set()
    for i, (op, a, b) in enumerate(ops):
        view = {f"n{k}": NodeInfo(f"n{k}", free=free, gpus=float(gpu))
                for k, free, gpu in views[i % len(views)]}
        nodes = sorted(view.values(), key=lambda n: n.node_id)
        used = {x.node for x in m.members} | {x.node for x in m.pending.values()}
        before = set(m.spares)
        if op == "plan":
            plan = m.spare_plan(nodes, b)
            assert not set(plan.start) & before and set(plan.stop) <= before
            assert m.spares == (before - set(plan.stop)) | set(plan.start)
            assert len(m.spares) <= b
            assert all(view[n].free for n in plan.start)
            for n in m.spares:
                assert n not in used  # GPU nodes included (their spare holds the GPU)
                assert n not in m.excluded_nodes and n not in lost
        elif op == "spawn":
            for s in m.spawns(nodes, False, gpus_on):
                assert s.adopt == (s.node_id in before and s.node_id not in used)
                before.discard(s.node_id)
                assert s.node_id not in m.spares
        elif op == "start" and m.pending:
            w = sorted(m.pending)[a % len(m.pending)]
            m.started(w)
        elif op in ("lose", "evict") and m.members:
            w = m.members[a % len(m.members)].worker_id
            m.remove(w, "failure" if op == "lose" else "evict", "test")
        elif op == "spare_lost":
            m.spare_lost(f"n{a}", "died")
            lost.add(f"n{a}")
            assert f"n{a}" not in m.spares
        elif op == "scale":
            m.request_scale(b + 1)
        used = {x.node for x in m.members} | {x.node for x in m.pending.values()}
        assert not m.spares & used


@given(ops=_OPS, views=st.lists(_NODE_SET, min_size=1, max_size=5), limit=st.integers(0, 3))
def test_spares_never_change_how_many_workers_start(ops, views, limit):
    """The same events with and without spares: as many spawns each time, each on a free
    node of the view (a spare only decides which free node goes first)."""
    ms = [_m(workers=2, max_workers=3), _m(workers=2, max_workers=3)]
    for i, (op, a, _) in enumerate(ops):
        nodes = [NodeInfo(f"n{k}", free=free) for k, free, _ in views[i % len(views)]]
        nodes = sorted({n.node_id: n for n in nodes}.values(), key=lambda n: n.node_id)
        if op == "plan":
            ms[0].spare_plan(nodes, limit)
        elif op == "spawn":
            counts = []
            for m in ms:
                used = {x.node for x in m.members} | {x.node for x in m.pending.values()}
                spawned = m.spawns(nodes, False, _cpu)
                # A node already used takes another worker only where it has room.
                room = {n.node_id for n in nodes if n.free}
                assert all(s.node_id not in used or s.node_id in room for s in spawned)
                counts.append(len(spawned))
            assert counts[0] == counts[1]
        elif op == "start":
            for m in ms:
                for w in sorted(m.pending)[:1]:
                    m.started(w)
        elif op == "lose":
            for m in ms:
                if m.members:
                    m.remove(m.members[a % len(m.members)].worker_id, "failure", "test")
        assert len(ms[0].members) == len(ms[1].members)


def test_spares_respect_the_limit_and_a_spawn_prefers_a_spare_node():
    m = _m(workers=1, max_workers=1)
    nodes = _nodes(4)
    _start_all(m, nodes)  # w0 on n0
    assert m.spare_plan(nodes, 1).start == ("n1",)
    assert m.spare_plan(nodes, 2).start == ("n2",)
    plan = m.spare_plan(nodes, 1)
    assert plan == type(plan)((), ("n2",)) and m.spares == {"n1"}
    assert m.spare_plan(nodes, 0).stop == ("n1",) and m.spares == set()
    # n1 busy (another job) when the spare is placed: it goes to n2; once n1 is free again,
    # a scale-up still takes n2 first, where the spare is warm.
    busy = [NodeInfo("n0"), NodeInfo("n1", free=False), NodeInfo("n2"), NodeInfo("n3")]
    assert m.spare_plan(busy, 1).start == ("n2",)
    m.request_scale(2)
    (s,) = m.spawns(nodes, False, _cpu)
    assert (s.node_id, s.adopt) == ("n2", True)


def test_a_spare_stays_on_a_node_another_job_filled_unless_a_free_node_needs_it():
    m = _m(workers=1, max_workers=1)
    _start_all(m, _nodes(1))  # w0 on n0
    assert m.spare_plan(_nodes(3), 1).start == ("n1",)
    # Another job takes n1's CPUs: the spare (holding none) stays while no node is free ...
    full = [NodeInfo("n0"), NodeInfo("n1", free=False), NodeInfo("n2", free=False)]
    assert m.spare_plan(full, 1) == m.spare_plan(full, 1) == SparePlan()
    assert m.spares == {"n1"}
    # ... and moves to a free node when there is one.
    moved = m.spare_plan([NodeInfo("n0"), NodeInfo("n1", free=False), NodeInfo("n2")], 1)
    assert (moved.start, moved.stop) == (("n2",), ("n1",))
    # A scale-up takes the free node with the spare before the free one without.
    m.request_scale(2)
    (s,) = m.spawns(_nodes(3), False, _cpu)
    assert (s.node_id, s.adopt) == ("n2", True)

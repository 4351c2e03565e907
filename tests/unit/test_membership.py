"""Membership: bounds, spawning, holders of the state, regroup plans."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.membership import ORIGIN, Membership, NodeInfo
from scheduler.protocols.sync import Position


def _nodes(n):
    return [NodeInfo(f"n{i}", cpus=1.0) for i in range(n)]


def _m(**kw):
    base = dict(workers=3, min_workers=None, max_workers=None, global_batch=64, max_batch=None)
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
    m = _m(workers=workers, max_workers=max_workers, global_batch=b)
    for r in range(rounds):
        _start_all(m, _nodes(nodes), starting=r == 0)
        assert len(m.members) <= m.max_size <= b
        assert len(m.members) + len(m.pending) <= max(m.max_size, 1)
    assert len({x.worker_id for x in m.members}) == len(m.members)


def test_workers_auto_is_bounded_by_global_batch_and_max_workers():
    assert _m(workers=None, global_batch=8).max_size == 8
    assert _m(workers=None, global_batch=8, max_workers=5).max_size == 5
    assert _m(workers=None, global_batch=10**6).max_size == 4096


def test_min_size_covers_the_global_batch_under_max_batch():
    m = _m(min_workers=1, max_batch=24)
    assert m.min_size == 3
    _start_all(m, _nodes(2), starting=False)
    assert "max_batch 24 x workers must hold global_batch 64" in m.shortfall()


def test_holders_and_regroup_plans():
    m = _m()
    _start_all(m, _nodes(3))
    plan = m.regroup_plan()
    assert not plan.needs_state  # at the origin, the seeded weights are the state
    m.regrouped(plan.members)
    m.progressed({"w0": Position(0, 5), "w1": Position(0, 4)})  # w2 lost, no report
    m.remove("w2", "failure", "died")
    assert m.committed == Position(0, 5)
    assert [x.worker_id for x in m.holders()] == ["w0"]
    assert m.regroup_plan().members[0] == "w0"
    # The holder dies too: a newcomer (at the origin) must not become the source.
    m.remove("w0", "failure", "died")
    m.remove("w1", "failure", "died")
    _start_all(m, _nodes(4), starting=False)
    plan = m.regroup_plan()
    assert plan.needs_state
    m.restored(Position(0, 0))
    assert not m.regroup_plan().needs_state


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 20)), min_size=1, max_size=6))
def test_the_source_always_holds_the_furthest_reported_state(reports):
    m = _m(workers=6)
    _start_all(m, _nodes(6))
    m.regrouped(m.regroup_plan().members)
    progress = {f"w{w}": Position(1, s) for w, s in reports}
    m.progressed(progress)
    plan = m.regroup_plan()
    assert m.get(plan.members[0]).version == max(progress.values()) == m.committed
    m.regrouped(plan.members)
    assert all(x.version == m.committed for x in m.members)


def test_evicted_straggler_node_gets_no_new_worker():
    m = _m()
    _start_all(m, _nodes(3))
    change = m.remove("w2", "evict", "straggler")
    assert change.kind == "evict" and change.node == "n2"
    assert m.spawns(_nodes(3), False, lambda g: 0.0) == []


def test_drain_and_scale_requests():
    m = _m()
    _start_all(m, _nodes(3))
    m.request_drain("w1")
    assert [c.worker for c in m.apply_drains()] == ["w1"]
    with pytest.raises(KeyError):
        m.request_drain("w9")
    m.request_drain("w0")
    with pytest.raises(ValueError, match="last worker"):
        m.request_drain("w2")
    m.request_scale(1000)
    assert m.max_size == 64  # never more workers than samples per step
    assert Position(0, 0) == ORIGIN

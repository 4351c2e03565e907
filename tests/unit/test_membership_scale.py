"""Issue 24 item 1: a scale-up places workers on nodes that have room (several on one node
when the job allows it), or says at once why it cannot; a scale-down drains the slowest
worker first, by measured throughput."""

from __future__ import annotations

from dynabatch.scheduler.core.membership import Membership, NodeInfo, slowest_first
from hypothesis import given
from hypothesis import strategies as st


def _cpu(g):
    return 0.0


def _m(**kw):
    base = dict(workers=2, min_workers=None, max_workers=3, smallest_batch=64, max_batch=None)
    base.update(kw)
    return Membership(**base)


def _start(m, nodes, starting):
    out = m.spawns(nodes, starting, _cpu)
    for s in out:
        m.started(s.worker_id)
    return out


def test_scale_up_on_one_machine_shares_its_node_while_it_has_room():
    m = _m()
    _start(m, [NodeInfo("n0", cpus=2.0, room=4)], starting=True)  # w0, w1 on n0
    assert m.worker_ids == ("w0", "w1")
    m.request_scale(3)
    (s,) = _start(m, [NodeInfo("n0", cpus=2.0, room=2)], starting=False)
    assert (s.worker_id, s.node_id) == ("w2", "n0") and m.unplaced is None
    # Down to 1 (the slowest go), then up to 2 again: the node has room again.
    m.request_scale(1, speeds={"w0": 900.0, "w1": 300.0, "w2": 600.0})
    assert sorted(c.worker for c in m.apply_drains()) == ["w1", "w2"]
    m.request_scale(2)
    (s,) = _start(m, [NodeInfo("n0", cpus=2.0, room=3)], starting=False)
    assert s.node_id == "n0" and len(m.members) == 2


def test_a_full_node_takes_no_second_worker_and_the_request_says_why():
    m = _m()
    _start(m, [NodeInfo("n0", cpus=2.0, room=4)], starting=True)
    full = [NodeInfo("n0", cpus=2.0, room=0, free=False)]
    assert m.unplaceable(full, 3) == 1
    m.request_scale(3)
    assert _start(m, full, starting=False) == []
    assert m.unplaced == (1, 3)
    assert m.unplaceable([NodeInfo("n0", cpus=2.0, room=1)], 3) == 0


_NODES = st.lists(st.tuples(st.booleans(), st.integers(0, 3)), min_size=1, max_size=5)


@given(first=_NODES, later=_NODES, initial=st.integers(1, 4), target=st.integers(1, 8))
def test_scale_up_places_within_room_and_reports_the_rest(first, later, initial, target):
    """After any first start, a scale-up: unused nodes get one worker each; used nodes get
    at most their room now; as many workers as fit are placed; what does not fit is
    reported, and the note said so in advance."""
    m = _m(workers=initial, max_workers=None)
    view0 = [NodeInfo(f"n{i}", free=f or r > 0, room=r) for i, (f, r) in enumerate(first)]
    _start(m, view0, starting=True)
    view = [NodeInfo(f"n{i}", free=r > 0, room=r) for i, (_, r) in enumerate(later)]
    used = {x.node for x in m.members}
    have = len(m.members)
    short = m.unplaceable(view, min(target, 64))
    m.request_scale(target)
    spawned = m.spawns(view, False, _cpu)
    per_node: dict[str, int] = {}
    for s in spawned:
        per_node[s.node_id] = per_node.get(s.node_id, 0) + 1
    for x in view:
        if x.node_id in used:
            assert per_node.get(x.node_id, 0) <= x.slots
        else:
            assert per_node.get(x.node_id, 0) <= 1
    unused = sum(1 for x in view if x.node_id not in used)
    room = sum(x.slots for x in view if x.node_id in used)
    want = max(0, min(target, 64) - have)
    assert len(spawned) == min(want, unused + room)
    assert (m.unplaced is not None) == (len(spawned) < want)
    fit_now = sum(1 for x in view if x.node_id not in used and x.slots) + room
    assert short == max(0, want - sum(x.slots for x in view))
    if want <= fit_now:
        assert short == 0


@given(speeds=st.lists(st.one_of(st.just(0.0), st.floats(1.0, 1e4)), min_size=2, max_size=8),
       target=st.integers(1, 8))
def test_scale_down_drains_the_slowest_first(speeds, target):
    n = len(speeds)
    m = _m(workers=n, max_workers=n)
    _start(m, [NodeInfo(f"n{i}") for i in range(n)], starting=True)
    by_worker = {f"w{i}": v for i, v in enumerate(speeds)}
    m.request_scale(target, speeds=by_worker)
    drained = {c.worker for c in m.apply_drains()}
    kept = set(m.worker_ids)
    assert len(kept) == min(n, target)
    # Every drained worker is unmeasured or no faster than every kept measured one.
    for d in drained:
        for k in kept:
            if by_worker[d] > 0 and by_worker[k] > 0:
                assert by_worker[d] <= by_worker[k]
            assert not (by_worker[d] > 0 and by_worker[k] == 0)


# --- the driver (the real coordinator, without Ray) ---------------------------------------
def _coord(room_per_node: int, **kw):
    from dynabatch.actors.spec import JobSpec
    from dynabatch.scheduler.sim.runtime import SimRuntime
    from dynabatch.scheduler.sync.coordinator import Coordinator

    from tests.fakes import sim_runtime

    class OneMachine(SimRuntime):
        """Room for ``room_per_node`` workers on its one node, less those it hosts (the
        simulator's own ``nodes()`` gives no room: one worker per node)."""

        def nodes(self) -> list[NodeInfo]:
            room = max(0, room_per_node - len(self.workers))
            return [NodeInfo(n.node_id, cpus=2.0, free=room > 0, room=room)
                    for n in super().nodes()]

    # The workers share one node: their speeds (1000, 250 and 500 samples/s) are the
    # emulated slowdowns of their ordinals.
    base = dict(workers=2, max_workers=3, min_workers=1, global_batch=64, epochs=6,
                policy="affine", rebalance={"mode": "epoch"}, collective_timeout_s=2,
                worker_wait_timeout_s=5, start_timeout_s=5,
                emulation={"slowdowns": [1, 4, 2]})
    base.update(kw)
    spec = JobSpec.model_validate(base)
    rt = sim_runtime(spec, n_train=1000, nodes=1, runtime=OneMachine)
    return Coordinator("job", spec, runtime=rt, clock=rt.clock), rt


def _run_epoch(coord, epoch):
    while coord.epoch < epoch:
        assert coord.step(), coord.snapshot().reason


def test_driver_scale_up_shares_the_machine_then_drains_the_slowest():
    coord, _ = _coord(room_per_node=4)
    _run_epoch(coord, 1)
    assert coord.membership.worker_ids == ("w0", "w1")
    snap = coord.scale(3)
    assert snap.reason is None
    _run_epoch(coord, 3)  # (joins at the first boundary with nothing sent ahead)
    assert coord.membership.worker_ids == ("w0", "w1", "w2")
    _run_epoch(coord, 4)
    coord.scale(2)  # w1 (250 samples/s) is the slowest, w2 (500) is kept
    coord.run()
    assert sorted(coord.membership.worker_ids) == ["w0", "w2"]
    leaves = [e.worker for e in coord.membership_events() if e.kind == "leave"]
    assert leaves == ["w1"]


def test_driver_scale_up_without_room_says_why_at_once_and_keeps_saying_it():
    coord, _ = _coord(room_per_node=2)
    _run_epoch(coord, 1)
    snap = coord.scale(3)
    assert snap.reason and "2 of 3 requested workers placed" in snap.reason
    _run_epoch(coord, 2)
    snap = coord.snapshot()
    assert len(snap.workers) == 2
    assert "2 of 3 requested workers placed" in (snap.reason or "")
    logged = [x.message for x in coord.logs() if "requested workers placed" in x.message]
    assert logged and len(logged) == 1, logged


def test_slowest_first_the_rule_both_drivers_use():
    # w3 not measured yet (newest unmeasured first), then the slowest measured.
    ws = [("w0", 0), ("w1", 1), ("w2", 2), ("w3", 3), ("w4", 4)]
    speeds = {"w0": 900.0, "w1": 100.0, "w2": 400.0, "w4": 0.0}
    assert slowest_first(ws, speeds) == ["w4", "w3", "w1", "w2", "w0"]
    assert slowest_first(ws, None) == ["w4", "w3", "w2", "w1", "w0"]  # as before: newest

"""Issue 31 item 4 (its seam): "train on these nodes" on the job's control interface.

The pure decision (:func:`placement_plan`, :meth:`Membership.handover`) is checked by
properties; the synchronous driver (the real coordinator on the simulator's runtime,
``tests.fakes.sim_runtime``) is checked to move, grow and shrink a running job by assignment
at step boundaries, with every epoch verified and no step lost, and to refuse a bad
assignment with its reason.
"""

from __future__ import annotations

import pytest
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.membership import (
    Membership,
    NodeAssignment,
    NodeInfo,
    placement_plan,
    slowest_first,
)
from dynabatch.scheduler.core.sync.protocol import Position
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator
from hypothesis import given
from hypothesis import strategies as st

from tests.fakes import Lineages, sim_runtime
from tests.unit.test_engine_faults import SPE, N, _spec


def _cpu(g):
    return 0.0


# --- the assignment value -------------------------------------------------------------
@pytest.mark.parametrize(
    "nodes, message",
    [
        ({}, "names no node"),
        ({"n0": 0}, "node 'n0': slots must be an integer of at least 1, got 0"),
        ({"n0": 1, "n1": -2}, "node 'n1': slots must be an integer of at least 1, got -2"),
        ({"n0": 1.5}, "slots must be an integer of at least 1, got 1.5"),
        ({"n0": True}, "slots must be an integer of at least 1, got True"),
        ({"": 1}, "node '': must be a non-empty node id"),
        (["n0"], "must map node ids to worker slots, got list"),
    ],
)
def test_a_bad_assignment_is_refused_with_a_one_line_reason(nodes, message):
    with pytest.raises(ValueError) as err:
        NodeAssignment.of(nodes)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_assignment_is_ordered_and_counts_its_slots():
    a = NodeAssignment.of({"n2": 1, "n0": 2})
    assert a.slots == (("n0", 2), ("n2", 1)) and a.total == 3
    assert "n0" in a and "n1" not in a and a.get("n1") == 0
    assert str(a) == "n0: 2, n2: 1"


# --- the pure decision ------------------------------------------------------------------
_WORKERS = st.lists(
    st.tuples(st.integers(0, 4), st.one_of(st.just(0.0), st.floats(1.0, 1e4))), max_size=8
)
_ASSIGN = st.dictionaries(
    st.integers(0, 5).map(lambda i: f"n{i}"), st.integers(1, 3), min_size=1, max_size=4
)


def _workers(spec):
    ws = [(f"w{i}", i, f"n{node}") for i, (node, _) in enumerate(spec)]
    return ws, {f"w{i}": v for i, (_, v) in enumerate(spec)}


@given(spec=_WORKERS, nodes=_ASSIGN, data=st.data())
def test_plan_drains_only_what_the_assignment_excludes_and_spawns_exactly_the_gaps(
    spec, nodes, data
):
    ws, speeds = _workers(spec)
    # Workers an owner drained (an assignment's ``leaving``) never keep a slot and go first.
    ids = [w for w, _, _ in ws]
    leaving = tuple(data.draw(st.lists(st.sampled_from(ids), unique=True))) if ids else ()
    a = NodeAssignment(NodeAssignment.of(nodes).slots, leaving)
    plan = placement_plan(ws, a, speeds)
    drained = set(plan.drain)
    assert len(drained) == len(plan.drain) and set(leaving) <= drained
    spawn = dict(plan.spawn)
    kept_total = 0
    for node in {n for _, _, n in ws} | set(nodes):
        staying = [w for w, _, n in ws if n == node and w not in leaving]
        kept = [w for w in staying if w not in drained]
        kept_total += len(kept)
        # A node keeps at most its slots, and drains only beyond them (none if unassigned).
        assert len(kept) == min(len(staying), a.get(node))
        assert spawn.get(node, 0) == a.get(node) - len(kept)
        # The kept are the fastest of the node's workers.
        order = slowest_first([(w, int(w[1:])) for w in staying], speeds)
        assert set(kept) == set(order[len(order) - len(kept) :])
    assert kept_total + sum(spawn.values()) == a.total
    slowest = slowest_first([(w, o) for w, o, _ in ws], speeds)
    assert list(plan.drain) == [w for w in slowest if w in leaving] + [
        w for w in slowest if w in drained and w not in leaving
    ]


@given(spec=_WORKERS, nodes=_ASSIGN)
def test_plan_is_idempotent_once_applied(spec, nodes):
    ws, speeds = _workers(spec)
    a = NodeAssignment.of(nodes)
    plan = placement_plan(ws, a, speeds)
    after = [w for w in ws if w[0] not in plan.drain]
    for node, k in plan.spawn:
        after += [(f"x{node}{j}", 100 + len(after), node) for j in range(k)]
    again = placement_plan(after, a, speeds)
    assert again.drain == () and again.spawn == ()


def _membership(n: int, lo: int | None, hi: int | None) -> Membership:
    m = Membership(workers=n, min_workers=lo, max_workers=hi, smallest_batch=64, max_batch=None)
    for s in m.spawns([NodeInfo(f"n{i}") for i in range(n)], True, _cpu):
        m.started(s.worker_id)
    m.regrouped(m.worker_ids)
    m.progressed({w: Position(1, 0) for w in m.worker_ids})  # they hold trained state
    return m


@given(
    n=st.integers(1, 5),
    lo=st.integers(1, 3),
    extra=st.integers(0, 3),
    nodes=_ASSIGN,
    speeds=st.lists(st.floats(1.0, 1e4), min_size=5, max_size=5),
)
def test_handover_keeps_the_state_and_bounds_and_ends_matching(n, lo, extra, nodes, speeds):
    """Boundary after boundary (drains, then starts, then a regroup) the job reaches the
    assignment: it never has fewer than its minimum, always keeps a holder of the state,
    never holds more than its minimum beyond the assignment. The assignment is taken
    whatever the spec's min_workers and max_workers (the cluster scheduler owns them): its
    total becomes the job's maximum, and its minimum where below it."""
    lo = min(lo, n)
    hi = n + extra
    m = _membership(n, lo, hi)
    a = NodeAssignment.of(nodes)
    m.request_assignment(a)
    assert (m.min_size, m.max_size) == (min(lo, a.total), a.total)
    view = [NodeInfo(f"n{i}") for i in range(6)]
    by_worker = {f"w{i}": v for i, v in enumerate(speeds)}
    for _ in range(6):
        # Who leaves is known before the drain (the engine settles first).
        leaving = m.draining(by_worker)
        assert leaving == sorted(c.worker for c in m.apply_drains(by_worker))
        assert len(m.members) >= m.min_size and m.holders()
        for s in m.spawns(view, False, _cpu):
            assert s.node_id in a
            assert m.started(s.worker_id) is not None
        assert len(m.members) <= a.total + m.min_size
        m.regrouped(m.worker_ids)
    assert m.moving() == [] and not m.pending
    on = {}
    for x in m.members:
        on[x.node] = on.get(x.node, 0) + 1
    assert on == dict(a.slots)
    # Already matching: nothing more to drain or start.
    assert m.draining(by_worker) == []
    assert m.apply_drains(by_worker) == [] and m.spawns(view, False, _cpu) == []


def test_a_node_not_alive_gets_no_worker_and_is_reported():
    m = _membership(2, 1, 3)
    m.request_assignment(NodeAssignment.of({"n1": 1, "n9": 2}))
    assert [s.node_id for s in m.spawns([NodeInfo(f"n{i}") for i in range(3)], False, _cpu)] == []
    assert m.unplaced == (2, 3)


# --- the driver ---------------------------------------------------------------------------
def _coord(
    nodes: int = 3, events: list[dict] | None = None, **kw
) -> tuple[Coordinator, SimRuntime, Lineages]:
    """Two workers (at most two) on ``nodes`` nodes, with the cluster's ``events``."""
    spec = _spec(**{"workers": 2, "max_workers": 2, "epochs": 4, **kw})
    lineages = Lineages()
    rt = sim_runtime(
        spec,
        n_train=N,
        nodes=nodes,
        speeds={0: 1000, 1: 500, 2: 250, 3: 800},
        gradients=lineages,
        events=events,
    )
    return Coordinator("job", spec, runtime=rt, clock=rt.clock), rt, lineages


def _run_to_epoch(coord: Coordinator, epoch: int) -> None:
    while coord.epoch < epoch:
        assert coord.step(), coord.snapshot().reason


def _assert_done(coord: Coordinator, lineages: Lineages) -> None:
    snap = coord.snapshot()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    hist = coord.history()
    assert [r.epoch for r in hist] == list(range(coord.spec.epochs))
    for r in hist:
        assert r.verified and r.samples_trained == r.dataset_size == N, r
    full = [(e, s) for e in range(coord.spec.epochs) for s in range(SPE)]
    for w in coord.membership.worker_ids:  # no step lost: each holds every step once
        assert lineages.lineage(w) == full, w


def _nodes_of(coord: Coordinator) -> dict[str, int]:
    on: dict[str, int] = {}
    for w in coord.snapshot().workers:
        on[w.node] = on.get(w.node, 0) + 1
    return on


def test_a_running_job_moves_from_two_nodes_to_two_others_at_a_step_boundary():
    coord, rt, lineages = _coord()
    _run_to_epoch(coord, 1)
    assert _nodes_of(coord) == {"node00": 1, "node01": 1}
    coord.assign({"node01": 1, "node02": 1})
    _run_to_epoch(coord, 2)
    assert _nodes_of(coord) == {"node01": 1, "node02": 1}
    coord.run()
    _assert_done(coord, lineages)
    events = [(e.kind, e.worker, e.node) for e in coord.membership_events()]
    assert ("leave", "w0", "node00") in events and ("join", "w2", "node02") in events
    assert [e for e in events if e[0] in ("failure", "evict")] == []
    assert rt.record.killed[:1] == ["w0"]


def test_a_job_moved_to_entirely_new_nodes_hands_its_state_over():
    """Nobody on the new nodes holds the state yet: the old workers stay until the new
    ones have joined a regroup, then leave (a drain first would lose the state)."""
    coord, _, lineages = _coord(nodes=4, min_workers=2)
    _run_to_epoch(coord, 1)
    coord.assign({"node02": 1, "node03": 1})
    _run_to_epoch(coord, 3)
    assert _nodes_of(coord) == {"node02": 1, "node03": 1}
    coord.run()
    _assert_done(coord, lineages)
    leaves = {e.worker for e in coord.membership_events() if e.kind == "leave"}
    assert leaves == {"w0", "w1"}


def test_grow_then_shrink_by_assignment():
    coord, _, lineages = _coord(epochs=5, max_workers=4)
    _run_to_epoch(coord, 1)
    coord.assign({"node00": 2, "node01": 1, "node02": 1})  # grow: 2 -> 4
    _run_to_epoch(coord, 2)
    assert _nodes_of(coord) == {"node00": 2, "node01": 1, "node02": 1}
    _run_to_epoch(coord, 3)
    coord.assign({"node00": 1})  # shrink: 4 -> 1, the fastest on node00 stays
    coord.run()
    _assert_done(coord, lineages)
    assert coord.membership.worker_ids == ("w0",)


def test_an_owners_drain_under_the_scheduler_takes_that_worker_not_the_slowest_there():
    """Under the cluster scheduler ``drain W`` frees a slot on W's node (an assignment one
    slot smaller there) and names W as the one leaving: W leaves, not the slowest worker on
    its node, as the owner asked (before, the fastest on the node always stayed)."""
    coord, _, lineages = _coord(epochs=5, max_workers=4)
    _run_to_epoch(coord, 1)
    coord.assign({"node00": 2, "node01": 1})  # w0 (the fastest) and a newcomer share node00
    _run_to_epoch(coord, 2)
    (new,) = {w.worker for w in coord.snapshot().workers if w.node == "node00"} - {"w0"}
    before = len(coord.membership_events())
    coord.assign(NodeAssignment((("node00", 1), ("node01", 1)), leaving=("w0",)))
    _run_to_epoch(coord, 3)
    assert sorted(coord.membership.worker_ids) == sorted(["w1", new])
    coord.run()
    _assert_done(coord, lineages)
    after = coord.membership_events()[before:]
    assert [(e.kind, e.worker) for e in after if e.kind in ("leave", "join")] == [("leave", "w0")]


def test_bad_assignments_and_own_resizing_are_refused_with_reasons():
    coord, _, _ = _coord(min_workers=2, max_workers=3)
    _run_to_epoch(coord, 1)
    with pytest.raises(ValueError, match=r"workers \(65\) is above the job's global_batch"):
        coord.assign({"node00": 33, "node01": 32})
    with pytest.raises(ValueError, match="slots must be an integer of at least 1"):
        coord.assign({"node00": 0, "node01": 2})
    assert _warnings(coord)[-1].startswith("assignment: node 'node00': slots must be")
    assert coord.assignment is None
    coord.scale(3)  # not assigned yet: the job's own scale works as before
    coord.assign({"node01": 1, "node02": 1})
    with pytest.raises(ValueError, match="scale: placement is the cluster scheduler's"):
        coord.scale(3)
    with pytest.raises(ValueError, match="drain: placement is the cluster scheduler's"):
        coord.drain("w1")
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED
    assert _nodes_of(coord) == {"node01": 1, "node02": 1}


def test_an_assigned_node_not_alive_is_said_until_it_joins():
    # A second node of class node02 joins the cluster at step 8 of epoch 2.
    late = "node02-00001"
    coord, rt, lineages = _coord(events=[{"epoch": 2, "step": 8, "join": {"class": "node02"}}])
    _run_to_epoch(coord, 1)
    coord.assign({"node00": 1, late: 1})
    _run_to_epoch(coord, 2)
    assert late not in {n.node_id for n in rt.nodes()}  # not joined yet
    snap = coord.snapshot()
    assert _nodes_of(coord) == {"node00": 1}
    assert "1 of 2 assigned workers placed" in (snap.reason or ""), snap.reason
    coord.run()
    _assert_done(coord, lineages)
    assert _nodes_of(coord) == {"node00": 1, late: 1}
    assert coord.snapshot().reason is None


# --- issue 50: the scheduler's assignment is authoritative ---------------------------------
def test_an_assignment_above_the_specs_max_workers_is_carried_out():
    """The cluster scheduler owns the job's bounds: a job of ``workers: 1`` (``max_workers``
    1 implied) assigned two slots trains on two workers (issue 50: it was refused with "2
    workers is above the job's maximum of 1 (max_workers)", in the scheduler's Ray log
    only)."""
    coord, _, lineages = _coord(workers=1, max_workers=None)
    _run_to_epoch(coord, 1)
    coord.assign({"node00": 1, "node01": 1})
    _run_to_epoch(coord, 2)
    assert _nodes_of(coord) == {"node00": 1, "node01": 1}
    assert (coord.membership.min_size, coord.membership.max_size) == (1, 2)
    coord.run()
    _assert_done(coord, lineages)


def test_the_membership_takes_an_assignments_total_as_its_bounds():
    m = _membership(2, 2, 2)
    m.request_assignment(NodeAssignment.of({"n0": 2, "n1": 2}))  # above max_workers 2
    assert (m.min_size, m.max_size, m.target) == (2, 4, 4)
    m.request_assignment(NodeAssignment.of({"n0": 1}))  # below min_workers 2
    assert (m.min_size, m.max_size, m.target) == (1, 1, 1)


def _warnings(coord: Coordinator) -> list[str]:
    return [line.message for line in coord.logs() if line.level == "WARNING"]


def test_an_assignment_the_batch_cannot_take_is_refused_in_one_line_and_in_the_job_log():
    coord, _, _ = _coord(max_batch=32)
    _run_to_epoch(coord, 1)
    for nodes, why in [
        ({"node00": 40, "node01": 25}, "workers (65) is above the job's global_batch (64)"),
        ({"node00": 1}, "1 workers with max_batch 32 cannot hold the job's global_batch (64)"),
    ]:
        with pytest.raises(ValueError) as err:
            coord.assign(nodes)
        line = str(err.value)
        assert why in line and "\n" not in line and line.startswith("assignment (")
        assert _warnings(coord)[-1] == line
    assert coord.assignment is None
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED


def test_an_assignment_to_a_finished_job_is_refused_and_logged():
    coord, _, _ = _coord(epochs=1)
    coord.run()
    with pytest.raises(ValueError) as err:
        coord.assign({"node00": 1})
    assert "SUCCEEDED" in str(err.value)
    assert _warnings(coord)[-1] == f"assignment (node00: 1): {err.value}"


class _SpawnsAt(SimRuntime):
    """Notes, at each spawn, how many segments had been trained by then."""

    def spawn(self, spawn):
        self.spawned = [*getattr(self, "spawned", []), (spawn.worker_id, self.record.trained)]
        super().spawn(spawn)


def test_an_assignments_new_workers_start_while_the_segment_in_flight_trains():
    """Issue 50: a job given more nodes started their workers only at a boundary with
    nothing in flight (after the segment in flight, sent without one ahead), then their
    cold start followed. They start at the first boundary after the assignment arrives,
    while the old group trains on, and join at a boundary once up; exactly once holds."""
    spec = _spec(workers=2, max_workers=3, epochs=4, spares=0)
    lineages = Lineages()
    rt = sim_runtime(spec, n_train=N, nodes=3, speeds={0: 1000, 1: 500, 2: 250},
                     gradients=lineages, runtime=_SpawnsAt)
    coord = Coordinator("job", spec, runtime=rt, clock=rt.clock)
    coord.assign({"node00": 1, "node01": 1})  # the scheduler's first grant
    _run_to_epoch(coord, 1)
    assert [w for w, _ in rt.spawned] == ["w0", "w1"]
    while coord.pipeline.ahead is None or coord.pipeline.ahead.position.epoch != 1:
        assert coord.step()
    trained = rt.record.trained
    coord.assign({"node00": 1, "node01": 1, "node02": 1})
    assert coord.step()
    assert rt.spawned[2:] == [("w2", trained)]  # before the segment in flight ended
    _run_to_epoch(coord, 2)
    assert _nodes_of(coord) == {"node00": 1, "node01": 1, "node02": 1}
    coord.run()
    _assert_done(coord, lineages)


class _ArrivesInFlight(_SpawnsAt):
    """The cluster scheduler's assignments arrive while a segment is in flight: as the driver
    starts waiting on it (``collect_segment``), before it has run. ``arrivals``: (when
    ``record.trained`` reaches this, the job's coordinator, the nodes), taken in order;
    ``arrived``: ``record.trained`` at each arrival, with the segment not run yet."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.arrivals: list = []
        self.arrived: list[int] = []

    def collect_segment(self, ticket, grace_s):
        while self.arrivals and self.record.trained >= self.arrivals[0][0]:
            _, coord, nodes = self.arrivals.pop(0)
            assert not ticket.ran  # in flight: the driver waits on it
            self.arrived.append(self.record.trained)
            coord.assign(nodes)
        return super().collect_segment(ticket, grace_s)


def _in_flight_job(start_s: float = 0.0):
    """Two workers on node00 and node01 as the scheduler's first grant, in epoch 1; a
    worker is up ``start_s`` after its start."""
    spec = _spec(workers=2, max_workers=3, epochs=4, spares=0, start_timeout_s=2 * start_s + 5)
    lineages = Lineages()
    rt = sim_runtime(spec, n_train=N, nodes=3, speeds={0: 1000, 1: 500, 2: 250},
                     gradients=lineages, runtime=_ArrivesInFlight, start_s=start_s)
    coord = Coordinator("job", spec, runtime=rt, clock=rt.clock)
    coord.assign({"node00": 1, "node01": 1})  # the scheduler's first grant
    _run_to_epoch(coord, 1)
    assert [w for w, _ in rt.spawned] == ["w0", "w1"]
    return coord, rt, lineages


def test_an_assignments_workers_start_as_it_arrives_not_at_the_segments_end():
    """Issue 50, left open: the new workers of an assignment started only at the step
    boundary after the segment in flight (up to 8 steps later), then their cold start
    followed. They start as it arrives, while that segment trains, and join at a boundary
    once up; every epoch stays verified, no step lost."""
    coord, rt, lineages = _in_flight_job()
    at = rt.record.trained + 2
    rt.arrivals = [(at, coord, {"node00": 1, "node01": 1, "node02": 1})]
    _run_to_epoch(coord, 2)
    assert rt.arrived == [at]
    assert rt.spawned[2:] == [("w2", at)]  # before the segment in flight ended
    assert _nodes_of(coord) == {"node00": 1, "node01": 1, "node02": 1}
    coord.run()
    _assert_done(coord, lineages)


def test_workers_a_newer_assignment_withdraws_before_they_join_are_stopped():
    """An assignment's workers start as it arrives; a newer assignment that leaves their
    node out arrives before they are up: they are stopped and never join, and the job
    trains on where the newest one says, every epoch verified."""
    coord, rt, lineages = _in_flight_job(start_s=60.0)  # w2 is up a minute after its start
    at = rt.record.trained + 1
    rt.arrivals = [(at, coord, {"node00": 1, "node01": 1, "node02": 1}),
                   (at + 2, coord, {"node00": 1, "node01": 1})]
    _run_to_epoch(coord, 2)
    assert rt.arrived == [at, at + 2]
    assert rt.spawned[2:] == [("w2", at)]
    assert "w2" in rt.record.killed
    assert "w2" not in coord.membership.pending
    assert all(e.worker != "w2" for e in coord.membership_events())  # it never joined
    assert _nodes_of(coord) == {"node00": 1, "node01": 1}
    coord.run()
    _assert_done(coord, lineages)


def test_a_joining_worker_is_listed_but_not_counted_until_the_group_forms():
    """Issue 50: the status said 3 workers while the group of 3 formed 12.6 s later. A
    worker that is up but joins only at the next regroup is listed (joined false) and not
    counted in the snapshot's group size, which the status, the gauges and the cluster
    scheduler's members report."""
    from dynabatch.scheduler.core.membership import Member

    spec = _spec(workers=2, max_workers=3, epochs=4, spares=0)
    lineages = Lineages()
    rt = sim_runtime(spec, n_train=N, nodes=2, speeds={0: 1000, 1: 500},
                     gradients=lineages, runtime=_SpawnsAt)
    coord = Coordinator("job", spec, runtime=rt, clock=rt.clock)
    _run_to_epoch(coord, 1)
    assert coord.snapshot().group_size == 2
    # The driver's view once a third worker's actor is up (Ray starts it in the background):
    # a member of the job, joining at the next regroup.
    members = coord.membership
    members.pending["w9"] = Member("w9", 9, "node01", 1.0)
    assert members.started("w9") is not None
    snap = coord.snapshot()
    assert [w.worker for w in snap.workers if not w.joined] == ["w9"]
    assert snap.group_size == 2 and len(snap.workers) == 3

"""The simulator's runtime does what Ray's does, on its virtual clock: the driver has one code
path for every runtime (no capability flags), so a simulated job sends segments ahead,
updates the plan of a segment in flight, adopts pre-warmed spares and evaluates in shards
behind the segment it follows.
"""

from __future__ import annotations

import pytest
from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.membership import Spawn
from dynabatch.scheduler.core.sync.update import PlanUpdate
from dynabatch.scheduler.runtime.seam import DataInfo
from dynabatch.scheduler.sim.cluster_spec import parse_cluster
from dynabatch.scheduler.sim.cost_model import SimulatedCluster
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sim.simulator import simulate
from dynabatch.scheduler.sim.timeline import SimClock

from bench.runtime_watch import count_segments
from tests.fakes import sim_job


def _spec(**kw) -> JobSpec:
    base = dict(
        workers="auto",
        global_batch=64,
        epochs=4,
        policy="dbs",
        rebalance={"mode": "adaptive", "check_steps": 2},
        collective_timeout_s=5,
        worker_wait_timeout_s=30,
    )
    base.update(kw)
    return JobSpec.model_validate(base)


def _cluster(count: int = 2, **kw):
    base = {
        "classes": [{"name": "n", "count": count, "a_ms": 2, "c_ms_per_sample": 0.2}],
        "recovery": {"start_s": 3.0, "detect_s": 0.2, "regroup_s": 0.1},
    }
    base.update(kw)
    return parse_cluster(base)


def test_a_simulated_node_slowing_down_is_rebalanced_inside_the_segment_in_flight():
    """As on Ray: segments go out ahead, and the re-plan after the slowdown reaches the
    workers as a plan update to the segment already sent, not one segment later."""
    cluster = _cluster(
        events=[{"epoch": 1, "step": 4, "slowdown": {"class": "n", "index": 0, "factor": 4}}]
    )
    counts = []
    r = simulate(_spec(), cluster, dataset_size=64 * 16,
                 coordinator_hook=lambda c: counts.append(count_segments(c.runtime)))
    assert r.snapshot.state == JobState.SUCCEEDED, r.snapshot.reason
    assert counts[0].sent_ahead > 0
    assert counts[0].updates_applied > 0
    assert all(h.verified and h.samples_trained == 64 * 16 for h in r.history)
    # The slowed worker (index 0 of the class) ends with the smaller share.
    last = sorted(r.history[-1].workers, key=lambda w: w.node)
    assert last[0].batch < last[1].batch


def _runtime(count: int = 2, **cluster_kw) -> SimRuntime:
    spec = _spec(workers=count)
    cluster = SimulatedCluster(_cluster(count, **cluster_kw))
    rt = SimRuntime(spec, cluster, clock=SimClock(0.0), data=DataInfo("sim", 64 * 8, 16))
    for i, n in enumerate(cluster.nodes):
        rt.spawn(Spawn(f"w{i}", i, n.node_id, 1.0, 0.0))
    while len(rt.workers) < count:
        rt.poll_started(10.0)
    assert rt.regroup(1, list(rt.workers), None, 5.0).ok
    return rt


def _segment(first: int, n: int, shares: tuple[int, int]) -> dict[str, SegmentPlan]:
    plans = {}
    for i, w in enumerate(("w0", "w1")):
        lo = sum(shares[:i])
        steps = tuple(
            StepPlan(s, s * 64, 64, s * 64 + lo, shares[i]) for s in range(first, first + n)
        )
        plans[w] = SegmentPlan(0, 0, 64 * 8, steps, updates=True)
    return plans


def test_a_segment_sent_ahead_starts_where_the_last_ended_and_takes_updates_after_its_first_step():
    rt = _runtime()
    one = rt.submit_segment(_segment(0, 2, (32, 32)))
    two = rt.submit_segment(_segment(2, 2, (32, 32)))
    rt.collect_segment(one, 5.0)
    t_one = rt.clock.now()
    # Its first step started when the one before ended: too late to change it.
    refused = PlanUpdate(
        0,
        2,
        {"w0": _segment(2, 2, (48, 16))["w0"].steps, "w1": _segment(2, 2, (48, 16))["w1"].steps},
    )
    assert not rt.update_segment(refused, 2.0)
    new = _segment(3, 1, (48, 16))
    assert rt.update_segment(PlanUpdate(0, 3, {w: p.steps for w, p in new.items()}), 2.0)
    out = {o.worker: o.result for o in rt.collect_segment(two, 5.0)}
    assert [s.batch for s in out["w0"].steps] == [32, 48]
    assert [s.batch for s in out["w1"].steps] == [32, 16]
    # No bubble: the second segment's steps took all the time since the first one ended.
    took = sum(s.compute_s + s.wait_s for s in out["w0"].steps)
    assert abs((rt.clock.now() - t_one) - took) < 1e-9


def test_a_run_counts_its_segments_and_keeps_their_plans_only_when_asked():
    """``simulate`` of a large cluster must not hold every segment's per-worker plans to the
    end of the run; the tests that read them ask for them."""
    rt = _runtime()
    for first in (0, 2, 4):
        rt.collect_segment(rt.submit_segment(_segment(first, 2, (32, 32))), 5.0)
    assert rt.record.trained == 3 and rt.record.plans == []
    rt.record.keep_plans = True
    rt.collect_segment(rt.submit_segment(_segment(6, 2, (32, 16))), 5.0)
    assert rt.record.trained == 4
    kept = [{w: [(s.step, s.own_size) for s in p.steps] for w, p in plans.items()}
            for plans in rt.record.plans]
    assert kept == [{"w0": [(6, 32), (7, 32)], "w1": [(6, 16), (7, 16)]}]


def test_an_evaluation_sent_behind_a_segment_waits_for_it():
    rt = _runtime()
    seg = rt.submit_segment(_segment(0, 2, (32, 32)))
    ev = rt.submit_evaluation({"w0": (0, 8), "w1": (8, 16)})
    assert rt.poll_evaluation(ev, 0.0) == []  # the segment before it is still running
    assert rt.record.trained == 0
    rt.collect_segment(seg, 5.0)
    shards = rt.poll_evaluation(ev, 0.0)
    assert sorted((s.worker, s.sums["n"]) for s in shards) == [("w0", 8.0), ("w1", 8.0)]
    assert rt.poll_evaluation(ev, 0.0) == []  # each shard is handed out once


def test_a_simulated_evaluation_takes_its_shards_time_and_the_segment_behind_it_waits():
    """A worker scores its shard in ``eval_ms_per_sample`` per sample; the shards run at
    once, and the segment queued behind them starts where the slowest ended."""
    rt = _runtime(classes=[{"name": "n", "count": 2, "a_ms": 2, "c_ms_per_sample": 0.2,
                            "eval_ms_per_sample": 5}])
    rt.collect_segment(rt.submit_segment(_segment(0, 2, (32, 32))), 5.0)
    t0 = rt.clock.now()
    ev = rt.submit_evaluation({"w0": (0, 8), "w1": (8, 24)})
    behind = rt.collect_segment(rt.submit_segment(_segment(2, 2, (32, 32))), 5.0)
    took = {s.worker: s.seconds for s in rt.poll_evaluation(ev, 0.0)}
    assert took == pytest.approx({"w0": 8 * 0.005, "w1": 16 * 0.005})
    steps = next(o.result.steps for o in behind if o.worker == "w0")
    trained = sum(s.compute_s + s.wait_s for s in steps)
    assert rt.clock.now() - t0 == pytest.approx(16 * 0.005 + trained)


def test_a_simulated_job_reports_the_evaluation_its_cluster_charges():
    """The driver's records read the simulated shards' time as they read Ray's: per epoch,
    the evaluation's critical part plus the part the split hid is the whole set's scoring
    (100 held-out samples at 10 ms), and the run takes longer than with evaluation free."""
    spec = JobSpec.model_validate(dict(workers=3, global_batch=48, epochs=3, policy="static",
                                       collective_timeout_s=5, spares=0))
    ends = {}
    for cost in (0.0, 10.0):
        coord, rt, _ = sim_job(spec, n_train=480, eval_ms_per_sample=cost)
        snap = coord.run()
        assert snap.state == JobState.SUCCEEDED
        ends[cost] = rt.clock.now()
        history = coord.history()
        if cost:
            assert [r.evaluation_s + r.evaluation_hidden_s for r in history] == pytest.approx(
                [100 * cost / 1e3] * 3)
            assert all(r.evaluation_s == pytest.approx(34 * cost / 1e3) for r in history)
    assert ends[10.0] - ends[0.0] >= 3 * 34 * 0.010 - 1e-9


def test_a_simulated_lost_worker_is_replaced_by_adopting_the_warm_spare():
    """A fresh worker takes ``start_s`` (3 s) to come up; the spare on the idle node paid
    that ahead, so the worker that adopts it is back in training well under it."""
    cluster = _cluster(3, events=[{"epoch": 2, "step": 2, "fail": {"class": "n", "index": 0}}])
    spec = _spec(workers=2, max_workers=2, min_workers=1, spares=1, epochs=5)
    r = simulate(spec, cluster, dataset_size=64 * 16)
    assert r.snapshot.state == JobState.SUCCEEDED, r.snapshot.reason
    assert any("adopting its spare" in line.message for line in r.logs)
    assert r.recoveries and r.recoveries[0].seconds < 3.0
    assert all(h.verified for h in r.history)


def test_an_epoch_end_rebalance_takes_effect_in_the_next_epoch_not_one_later():
    """``rebalance: epoch`` (the default) decides at each epoch's end. Sending the next
    epoch's first segment ahead under the carried allocation would train that whole epoch
    at the old shares (found when the simulator began sending ahead as Ray does): the
    driver must not cross an epoch whose end re-plans."""
    cluster = parse_cluster({
        "classes": [
            {"name": "fast", "count": 1, "a_ms": 2, "c_ms_per_sample": 0.1},
            {"name": "slow", "count": 1, "a_ms": 2, "c_ms_per_sample": 0.4},
        ],
    })
    spec = _spec(epochs=3, rebalance={"mode": "epoch"})
    r = simulate(spec, cluster, dataset_size=64 * 8)
    assert r.snapshot.state == JobState.SUCCEEDED, r.snapshot.reason

    def shares(h):
        return {w.node.split("-")[0]: w.batch for w in h.workers}

    # Epoch 0 measures at equal shares; epoch 1 already trains at the rebalanced ones.
    assert r.history[1].workers and shares(r.history[1]) != shares(r.history[0]), [
        shares(h) for h in r.history]


def test_a_simulated_node_that_cannot_host_a_worker_is_not_eligible_as_on_ray():
    """Nodes are listed as Ray's runtime lists them: only those that can host one of the
    job's workers (its ``worker_cpus``, a GPU when it needs one). A job that no node can
    host waits, then fails naming what it asks for, instead of training where Ray would
    not place it."""
    cluster = _cluster(classes=[{"name": "small", "count": 2, "a_ms": 2,
                                 "c_ms_per_sample": 0.2, "cpus": 2}])
    r = simulate(_spec(worker_cpus=4, workers=2, worker_wait_timeout_s=5, start_timeout_s=5),
                 cluster, dataset_size=64 * 4)
    assert r.snapshot.state == JobState.FAILED
    assert not r.history
    assert "worker_cpus=4" in (r.snapshot.reason or ""), r.snapshot.reason
    # Nodes that can host it: the same job trains.
    big = _cluster(classes=[{"name": "big", "count": 2, "a_ms": 2, "c_ms_per_sample": 0.2,
                             "cpus": 4}])
    ok = simulate(_spec(worker_cpus=4, workers=2), big, dataset_size=64 * 4)
    assert ok.snapshot.state == JobState.SUCCEEDED, ok.snapshot.reason


def test_a_simulated_node_counts_the_workers_it_hosts_against_its_room_as_on_ray():
    """A node's ``free``/``room`` follow from the workers it hosts against what one asks for
    (``worker_cpus``), as Ray's unreserved resources do: a 1-CPU node hosting a worker has
    no room for another (a replacement must not start beside it), a 2-CPU node with one
    1-CPU worker has room for one more."""
    cluster = SimulatedCluster(_cluster(classes=[
        {"name": "one", "count": 1, "a_ms": 2, "c_ms_per_sample": 0.2, "cpus": 1},
        {"name": "two", "count": 1, "a_ms": 2, "c_ms_per_sample": 0.2, "cpus": 2},
    ]))
    rt = SimRuntime(_spec(workers=2), cluster, clock=SimClock(0.0),
                    data=DataInfo("sim", 64 * 8, 16))
    one, two = (n.node_id for n in cluster.nodes)
    before = {n.node_id: (n.free, n.slots) for n in rt.nodes()}
    assert before == {one: (True, 1), two: (True, 2)}
    rt.spawn(Spawn("w0", 0, one, 1.0, 0.0))
    rt.spawn(Spawn("w1", 1, two, 1.0, 0.0))
    after = {n.node_id: (n.free, n.slots) for n in rt.nodes()}
    assert after == {one: (False, 0), two: (True, 1)}
    rt.kill("w0")  # its CPU is the node's again
    assert {n.node_id: n.slots for n in rt.nodes()}[one] == 1

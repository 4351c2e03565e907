"""The cluster policy (scheduler/core/cluster/): properties over random clusters, each
policy's intent on small examples, and the throughput model's bootstrap."""

from __future__ import annotations

import dataclasses

import pytest
from dynabatch.scheduler.core.cluster.decision import decide
from dynabatch.scheduler.core.cluster.throughput import ThroughputModel, bootstrap
from dynabatch.scheduler.core.cluster.values import ClusterJob, ClusterKnobs, ClusterNode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TYPES = ("fast", "mid", "slow")
POLICIES = ("fifo", "fair", "goodput", "single_type")
M = ThroughputModel.of


# --- random clusters -----------------------------------------------------------------------


@st.composite
def _nodes(draw):
    n = draw(st.integers(1, 10))
    return [
        ClusterNode(f"n{i}", draw(st.sampled_from(TYPES)), draw(st.integers(0, 4)))
        for i in range(n)
    ]


@st.composite
def _job(draw, job_id: str):
    lo = draw(st.integers(1, 4))
    hi = draw(st.integers(lo, lo + 4))
    rates = {t: draw(st.floats(0.5, 20.0)) for t in TYPES}
    model = M(
        rates, rates, draw(st.sampled_from([0.0, 0.05, 0.5])), draw(st.sampled_from([32.0, 256.0]))
    )
    return ClusterJob(
        job_id,
        lo,
        hi,
        model,
        priority=draw(st.integers(0, 2)),
        submit_s=float(draw(st.integers(0, 5))),
    )


@st.composite
def _jobs(draw, prefix="j", max_size=7):
    n = draw(st.integers(1, max_size))
    return [draw(_job(f"{prefix}{i}")) for i in range(n)]


def order_key(job: ClusterJob) -> tuple:
    """Who is considered first: higher priority, then running, then earlier."""
    return (-job.priority, 0 if job.allocation else 1, job.submit_s, job.job_id)


def _knobs(policy: str, hold_s: float = 120.0) -> ClusterKnobs:
    return ClusterKnobs(policy=policy, hold_s=hold_s)


def _moves(decision) -> tuple[str, ...]:
    """The jobs whose nodes the decision changes (started, resized, moved or preempted)."""
    return tuple(p.job_id for p in decision.plans if p.changed)


def _feed_back(jobs, decision, now):
    """The jobs as they stand once ``decision`` is applied at ``now``."""
    out = []
    for job in jobs:
        plan = decision.plan(job.job_id)
        out.append(
            dataclasses.replace(
                job, allocation=plan.slots, last_resize_s=now if plan.changed else job.last_resize_s
            )
        )
    return out


def _check(nodes, jobs, decision, knobs):
    cap = {n.node_id: n.capacity for n in nodes}
    used: dict[str, int] = {}
    by_id = {j.job_id: j for j in jobs}
    assert sorted(p.job_id for p in decision.plans) == sorted(by_id)
    for plan in decision.plans:
        job = by_id[plan.job_id]
        for node_id, n in plan.slots:
            assert node_id in cap and n > 0
            used[node_id] = used.get(node_id, 0) + n
        if plan.queued:
            # A queued job holds nothing and says why.
            assert plan.slots == ()
            assert plan.reason.startswith(
                f"queued: position {plan.position} of {len(decision.queue)} ("
            )
            assert decision.queue[plan.position - 1] == plan.job_id
        else:
            assert job.min_workers <= plan.workers <= job.max_workers, plan
            assert plan.reason
            if knobs.policy == "single_type" and plan.changed:
                assert len(plan.by_type) == 1
    # Never over capacity.
    assert all(n <= cap[k] for k, n in used.items()), (used, cap)
    # The queue runs from higher to lower priority.
    prios = [by_id[j].priority for j in decision.queue]
    assert prios == sorted(prios, reverse=True)
    if knobs.policy in ("fair", "goodput"):
        # A queued job would not fit even without every lower-priority or later job that
        # is not held: only the held and those ahead of it keep it out.
        total = sum(cap.values())
        held = sum(p.workers for p in decision.plans if "(held for " in p.reason)
        for q in decision.queue:
            ahead = sum(
                by_id[p.job_id].min_workers
                for p in decision.plans
                if not p.queued
                and "(held for " not in p.reason
                and order_key(by_id[p.job_id]) < order_key(by_id[q])
            )
            assert total - held - ahead < by_id[q].min_workers, (q, decision)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=_nodes(),
    jobs=_jobs(),
    later=_jobs(prefix="k", max_size=3),
    policy=st.sampled_from(POLICIES),
    hold=st.sampled_from([0.0, 120.0]),
    drop=st.integers(0, 3),
    lose=st.integers(0, 2),
)
def test_decisions_keep_every_invariant_over_two_rounds(
    nodes, jobs, later, policy, hold, drop, lose
):
    knobs = _knobs(policy, hold)
    first = decide(nodes, jobs, 0.0, knobs)
    _check(nodes, jobs, first, knobs)
    # The same inputs give the same decision.
    assert decide(nodes, jobs, 0.0, knobs) == first
    # Fed back with nothing changed: no moves (no flapping), twice over.
    fed = _feed_back(jobs, first, 0.0)
    again = decide(nodes, fed, 0.0, knobs)
    _check(nodes, fed, again, knobs)
    assert _moves(again) == (), again
    assert _moves(decide(nodes, _feed_back(fed, again, 0.0), 0.0, knobs)) == ()
    # Then some jobs finish, others arrive, a node is lost: still valid, and a job within
    # its hold time whose nodes all remain keeps exactly its nodes.
    kept_nodes = nodes[lose:] or nodes
    present = {n.node_id for n in kept_nodes}
    second_jobs = fed[drop:] + later
    now = 60.0
    second = decide(kept_nodes, second_jobs, now, knobs)
    _check(kept_nodes, second_jobs, second, knobs)
    for job in second_jobs:
        if (
            job.allocation
            and job.last_resize_s is not None
            and now - job.last_resize_s < hold
            and all(k in present for k, _ in job.allocation)
        ):
            assert second.plan(job.job_id).slots == job.allocation, (job, second)


@settings(max_examples=40, deadline=None)
@given(nodes=_nodes(), jobs=_jobs(), policy=st.sampled_from(POLICIES))
def test_a_higher_priority_job_is_never_queued_behind_a_lower_one(nodes, jobs, policy):
    decision = decide(nodes, jobs, 0.0, _knobs(policy))
    by_id = {j.job_id: j for j in jobs}
    for i, a in enumerate(decision.queue):
        for b in decision.queue[i + 1 :]:
            assert by_id[a].priority >= by_id[b].priority


# --- each policy's intent ----------------------------------------------------------------


def _types(decision, job_id):
    return dict(decision.plan(job_id).by_type)


def test_fair_gives_two_equal_jobs_equal_normalised_throughput_on_mixed_types():
    # 3 fast (2 samples/s) + 2 slow (1): 8 in all, so 4 each, one of them on both types.
    nodes = [
        *(ClusterNode(f"f{i}", "fast", 1) for i in range(3)),
        *(ClusterNode(f"s{i}", "slow", 1) for i in range(2)),
    ]
    model = M({"fast": 2.0, "slow": 1.0}, ("fast", "slow"))
    jobs = [ClusterJob("a", 1, 5, model), ClusterJob("b", 1, 5, model, submit_s=1.0)]
    d = decide(nodes, jobs, 0.0, _knobs("fair"))
    assert d.plan("a").normalised == pytest.approx(d.plan("b").normalised) == 0.4
    assert sorted([_types(d, "a"), _types(d, "b")], key=len) == [
        {"fast": 2},
        {"fast": 1, "slow": 2},
    ]
    # fifo gives the first job all it asks for and the second what is left.
    f = decide(nodes, jobs, 0.0, _knobs("fifo"))
    assert _types(f, "a") == {"fast": 3, "slow": 2}
    assert f.plan("b").queued


def test_goodput_gives_the_fast_type_loving_job_the_fast_nodes():
    nodes = [
        ClusterNode("h0", "H100", 1),
        ClusterNode("h1", "H100", 1),
        ClusterNode("c0", "CPU", 1),
        ClusterNode("c1", "CPU", 1),
    ]
    loves = M({"H100": 10.0, "CPU": 1.0}, ("H100", "CPU"))
    indifferent = M({"H100": 2.0, "CPU": 1.0}, ("H100", "CPU"))
    # The indifferent job came first: fifo would give it the fast nodes.
    jobs = [
        ClusterJob("indifferent", 1, 2, indifferent),
        ClusterJob("loves", 1, 2, loves, submit_s=1.0),
    ]
    d = decide(nodes, jobs, 0.0, _knobs("goodput"))
    assert _types(d, "loves") == {"H100": 2}
    assert _types(d, "indifferent") == {"CPU": 2}
    assert _types(decide(nodes, jobs, 0.0, _knobs("fifo")), "indifferent") == {"H100": 2}


def test_goodput_lets_one_job_span_node_types_where_single_type_cannot():
    nodes = [ClusterNode("h0", "H100", 2), ClusterNode("c0", "CPU", 2)]
    jobs = [ClusterJob("a", 1, 4, M({"H100": 4.0, "CPU": 1.0}, ("H100", "CPU")))]
    assert _types(decide(nodes, jobs, 0.0, _knobs("goodput")), "a") == {"H100": 2, "CPU": 2}
    assert _types(decide(nodes, jobs, 0.0, _knobs("single_type")), "a") == {"H100": 2}


@pytest.mark.parametrize("policy", ["fair", "goodput"])
def test_a_higher_priority_arrival_preempts_down_to_the_others_min_workers(policy):
    nodes = [ClusterNode(f"n{i}", "cpu", 1) for i in range(8)]
    model = M({"cpu": 1.0}, ("cpu",))
    a = ClusterJob(
        "a", 2, 4, model, allocation=tuple((f"n{i}", 1) for i in range(4)), last_resize_s=-1000.0
    )
    b = ClusterJob(
        "b",
        2,
        4,
        model,
        submit_s=1.0,
        allocation=tuple((f"n{i}", 1) for i in range(4, 8)),
        last_resize_s=-1000.0,
    )
    c = ClusterJob("c", 4, 8, model, priority=1, submit_s=5.0)
    d = decide(nodes, [a, b, c], 0.0, _knobs(policy))
    assert (d.plan("a").workers, d.plan("b").workers, d.plan("c").workers) == (2, 2, 4)
    assert "shrinks from 4 to 2" in d.plan("a").reason
    assert "higher-priority job c" in d.plan("a").reason
    # Within their hold time the running jobs do not move: c waits, and says why.
    held = [dataclasses.replace(j, last_resize_s=-10.0) for j in (a, b)]
    w = decide(nodes, [*held, c], 0.0, _knobs(policy))
    assert _moves(w) == ()
    assert w.queue == ("c",)
    assert w.plan("c").reason.startswith("queued: position 1 of 1 (min_workers 4 not free")
    assert "held for 110 s more" in w.plan("a").reason


@pytest.mark.parametrize("policy", ["goodput", "single_type"])
@pytest.mark.parametrize("swap", [False, True])
def test_an_allocation_as_good_as_any_other_is_kept(policy, swap):
    # Two equal jobs, each on one type: the swapped allocation is just as good, so
    # whichever they hold, nothing moves (a solver's tie-break must not cause a resize).
    nodes = [ClusterNode("f0", "fast", 2), ClusterNode("s0", "slow", 2)]
    model = M({"fast": 2.0, "slow": 1.0}, ("fast", "slow"), 0.1, 8.0)
    first, second = (("s0", 2),), (("f0", 2),)
    if swap:
        first, second = second, first
    jobs = [
        ClusterJob("a", 2, 2, model, allocation=first, last_resize_s=-1e3),
        ClusterJob("b", 2, 2, model, allocation=second, last_resize_s=-1e3),
    ]
    assert _moves(decide(nodes, jobs, 0.0, _knobs(policy))) == ()


@pytest.mark.parametrize("policy", ["fair", "goodput"])
def test_a_higher_priority_arrival_displaces_a_job_whose_minimum_no_longer_fits(policy):
    nodes = [ClusterNode(f"n{i}", "cpu", 1) for i in range(4)]
    model = M({"cpu": 1.0}, ("cpu",))
    low = ClusterJob(
        "low", 3, 4, model, allocation=tuple((f"n{i}", 1) for i in range(4)), last_resize_s=-1e3
    )
    high = ClusterJob("high", 2, 2, model, priority=2, submit_s=5.0)
    d = decide(nodes, [low, high], 0.0, _knobs(policy))
    assert d.plan("high").workers == 2
    assert d.queue == ("low",) and d.plan("low").changed
    assert d.plan("low").reason.startswith(
        "queued: position 1 of 1 (preempted by higher-priority jobs; min_workers 3 not free"
    )
    # An equal priority does not displace a running job: the newcomer waits.
    e = decide(nodes, [low, dataclasses.replace(high, priority=0)], 0.0, _knobs(policy))
    assert e.queue == ("high",) and _moves(e) == ()


@pytest.mark.parametrize("policy", POLICIES)
def test_gangs_are_granted_whole_or_not_at_all(policy):
    # The deadlock: two jobs of 2 workers on 2 slots each got one and waited.
    nodes = [ClusterNode("n0", "cpu", 1), ClusterNode("n1", "cpu", 1)]
    model = M({"cpu": 1.0}, ("cpu",))
    jobs = [ClusterJob("a", 2, 2, model), ClusterJob("b", 2, 2, model)]
    d = decide(nodes, jobs, 0.0, _knobs(policy))
    assert d.plan("a").workers == 2
    assert d.plan("b").slots == ()
    assert d.queue == ("b",)


def test_fifo_keeps_running_jobs_and_nobody_passes_the_head():
    nodes = [ClusterNode(f"n{i}", "cpu", 1) for i in range(4)]
    model = M({"cpu": 1.0}, ("cpu",))
    run = ClusterJob(
        "run", 1, 4, model, allocation=(("n0", 1), ("n1", 1), ("n2", 1)), last_resize_s=-1000.0
    )
    big = ClusterJob("big", 2, 2, model, submit_s=1.0)
    small = ClusterJob("small", 1, 1, model, submit_s=2.0)
    d = decide(nodes, [run, big, small], 0.0, _knobs("fifo"))
    assert d.plan("run").slots == run.allocation and not d.plan("run").changed
    assert d.queue == ("big", "small")
    assert d.plan("big").reason == (
        "queued: position 1 of 2 (min_workers 2 not free: 1 of 4 "
        "slots on its node types are not held or kept for jobs "
        "ahead)"
    )
    assert (
        d.plan("small").reason == "queued: position 2 of 2 (waits for job big at the head "
        "of the queue)"
    )
    # goodput lets the small job pass (big's gang cannot fit beside run's minimum).
    g = decide(nodes, [dataclasses.replace(run, min_workers=3), big, small], 0.0, _knobs("goodput"))
    assert g.queue == ("big",) and g.plan("small").workers == 1


def test_a_job_that_can_never_fit_says_so():
    nodes = [ClusterNode("n0", "cpu", 2)]
    d = decide(nodes, [ClusterJob("a", 3, 3, M({"cpu": 1.0}))], 0.0, _knobs("goodput"))
    assert d.plan("a").reason == (
        "queued: position 1 of 1 (min_workers 3 exceeds the 2 worker slots of its node types)"
    )


def test_a_lost_node_overrides_the_hold_and_its_job_is_placed_again():
    nodes = [ClusterNode(f"n{i}", "cpu", 1) for i in range(4)]
    model = M({"cpu": 1.0}, ("cpu",))
    job = ClusterJob("a", 2, 2, model, allocation=(("gone", 1), ("n0", 1)), last_resize_s=0.0)
    d = decide(nodes, [job], 10.0, _knobs("goodput"))
    assert d.plan("a").workers == 2 and ("n0", 1) in d.plan("a").slots
    assert d.plan("a").changed


def test_resizes_stick_to_the_nodes_a_job_holds():
    nodes = [ClusterNode(f"n{i}", "cpu", 2) for i in range(4)]
    model = M({"cpu": 1.0}, ("cpu",))
    a = ClusterJob("a", 1, 8, model, allocation=(("n1", 2), ("n2", 1)), last_resize_s=-1e3)
    d = decide(nodes, [a], 0.0, _knobs("goodput"))
    slots = dict(d.plan("a").slots)
    assert d.plan("a").workers == 8 and slots["n1"] == 2 and slots["n2"] == 2
    # A shrink keeps the node where it has the most workers.
    b = ClusterJob("b", 2, 8, model, priority=1, submit_s=1.0)
    a2 = dataclasses.replace(a, min_workers=1, max_workers=3)
    s = decide(
        nodes[:2],
        [a2, dataclasses.replace(b, min_workers=3, max_workers=3)],
        0.0,
        _knobs("goodput"),
    )
    assert s.plan("a").slots == (("n1", 1),)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ClusterKnobs(policy="best"), "policy: 'best' is not one of fifo, fair"),
        (lambda: ClusterJob("a", 0, 1, M({})), "job a: min_workers 0 is below 1"),
        (lambda: ClusterJob("a", 3, 2, M({})), "job a: max_workers 2 is below min_workers 3"),
        (lambda: ClusterNode("n", "cpu", -1), "node n: capacity -1 is below 0"),
        (lambda: M({"cpu": -1.0}), "rate of node type 'cpu': -1.0 is not >= 0"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        make()


# --- the throughput model ------------------------------------------------------------------


def test_bootstrap_estimates_an_unmeasured_type_from_other_jobs_ratios():
    a = M({"H100": 100.0, "CPU": 10.0}, ("H100", "CPU"))
    b = M({"H100": 40.0}, ("H100",))
    out = bootstrap({"a": a, "b": b}, ["H100", "V100", "CPU"], hints={"V100": 0.3, "H100": 1.0})
    assert out["b"].rate("CPU") == pytest.approx(4.0)  # a's 1 : 0.1, not the hints
    assert out["b"].rate("V100") == pytest.approx(12.0)  # nobody measured V100: the hints
    assert out["b"].measured == {"H100"}
    assert out["a"].rate("V100") == pytest.approx(30.0)
    # Once b has run on CPU, its own figure replaces the estimate.
    b2 = M({"H100": 40.0, "CPU": 8.0}, ("H100", "CPU"))
    assert bootstrap({"a": a, "b": b2}, ["H100", "CPU"])["b"].rate("CPU") == 8.0
    # A job with no telemetry at all starts from the hints.
    fresh = bootstrap({"c": M({})}, ["H100", "V100"], hints={"H100": 1.0, "V100": 0.3})
    assert fresh["c"].rate("V100") == pytest.approx(0.3)


def test_a_held_jobs_reason_says_how_long_it_is_held_on_a_real_clock():
    """The scheduler's clock is epoch seconds: the reason gives the time left, not an
    absolute instant printed as ``t=1.79579e+09``."""
    now = 1_795_793_500.0
    nodes = [ClusterNode("n0", "cpu", 1), ClusterNode("n1", "cpu", 1)]
    a = ClusterJob(
        "a", 1, 2, M({"cpu": 1.0}, ("cpu",)), allocation=(("n0", 1),), last_resize_s=now - 10.0
    )
    reason = decide(nodes, [a], now, _knobs("goodput")).plan("a").reason
    assert reason.endswith("(held for 110 s more)"), reason


@pytest.mark.parametrize("policy", ["goodput", "fair"])
def test_a_job_asking_more_workers_than_the_cluster_has_still_grows_into_free_slots(policy):
    """A job's normalised throughput is over what the cluster could give it (its eligible
    slots), not over its ``max_workers`` alone: a ``workers: auto`` job may take up to its
    global batch, and normalised by that many workers every allocation looked alike, so the
    resize penalty kept it on 1 worker beside 3 free slots (found on the compose stack)."""
    nodes = [ClusterNode("f", "fast", 2), ClusterNode("s", "slow", 2)]
    model = M({"fast": 650.0, "slow": 650.0}, {"slow"}, 0.01, 512.0)
    job = ClusterJob("b", 1, 512, model, allocation=(("s", 1),), last_resize_s=0.0)
    (plan,) = decide(nodes, [job], 1000.0, ClusterKnobs(policy=policy)).plans
    assert sum(n for _, n in plan.slots) == 4, plan.reason
    assert plan.normalised == pytest.approx(1.0)

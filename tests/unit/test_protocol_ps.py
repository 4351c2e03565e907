"""The parameter-server machines: protocol, async ledger, Ji policy and the core, driven by
random event schedules (pushes in any order, refusals, learners lost and joining)."""

from __future__ import annotations

import pytest
from dynabatch.scheduler.core.ps.async_ledger import AsyncLedger
from dynabatch.scheduler.core.ps.batch_policy import JiConfig, PerfAwareBatches, ji_batches
from dynabatch.scheduler.core.ps.machine import EpochEnd, Finished, Idle, PSCore, Work
from dynabatch.scheduler.core.ps.rudra import Apply, PSConfig, PSProtocol, Pulled, Refuse, Wait
from hypothesis import given, settings
from hypothesis import strategies as st

configs = st.builds(
    PSConfig,
    mode=st.sampled_from(["async", "softsync", "hardsync"]),
    n=st.integers(1, 4),
    lr_staleness=st.sampled_from(["none", "per_gradient", "average"]),
    max_staleness=st.one_of(st.none(), st.integers(0, 4)),
    on_stale=st.sampled_from(["refuse", "wait"]),
)


def _joined(machine, workers):
    """``machine`` (a PSCore or a PSProtocol) with ``workers`` joined."""
    for w in workers:
        machine.join(w)
    return machine


def _run(core: PSCore, data, workers: list[str], faults: bool, max_events: int = 3000):
    """Drive ``core`` with random interleavings until it finishes; returns every event."""
    events, inflight, names = [], {}, iter(f"j{i}" for i in range(100))
    for _ in range(max_events):
        if core.finished:
            break
        members = sorted(core.protocol.members)
        choice = data.draw(st.integers(0, 9))
        if faults and choice == 0 and len(members) > 1:
            w = data.draw(st.sampled_from(members))
            events += core.leave(w)
            inflight.pop(w, None)
            continue
        if faults and choice == 1 and len(members) < 6:
            core.join(next(names))
            continue
        idle = [w for w in members if w not in inflight]
        if inflight and (choice >= 6 or not idle):
            w = data.draw(st.sampled_from(sorted(inflight)))
            work = inflight.pop(w)
            events += core.push(w, work.ticket, work.version, compute_s=0.01 * (1 + len(w)))
            continue
        progressed = False
        for w in ([data.draw(st.sampled_from(idle))] if idle else []):
            res, ev = core.request(w)
            events += ev
            if isinstance(res, Work):
                inflight[w] = res
                progressed = True
        if not progressed and inflight:
            # An idle answer changes nothing: let a gradient in (asking again cannot help).
            w = data.draw(st.sampled_from(sorted(inflight)))
            work = inflight.pop(w)
            events += core.push(w, work.ticket, work.version, compute_s=0.01 * (1 + len(w)))
        elif not progressed:
            # Everybody idle: ask each once (a flush or a new epoch may be due).
            for w in idle:
                res, ev = core.request(w)
                events += ev
                if isinstance(res, Work):
                    inflight[w] = res
    return events


@settings(max_examples=150, deadline=None)
@given(cfg=configs, n_workers=st.integers(1, 5), n=st.integers(1, 60), b=st.integers(1, 9),
       faults=st.booleans(), data=st.data())
def test_every_sample_applied_exactly_once_and_staleness_bounded(cfg, n_workers, n, b, faults,
                                                                 data):
    if cfg.mode == "softsync" and cfg.n > n_workers:
        cfg = PSConfig("softsync", n_workers, cfg.lr_staleness, cfg.max_staleness, cfg.on_stale)
    workers = [f"w{i}" for i in range(n_workers)]
    core = _joined(PSCore(cfg, dataset_size=n, epochs=2, seed=0, batches=PerfAwareBatches(b)),
                   workers)
    events = _run(core, data, workers, faults)
    assert core.finished, "the job must always finish: no deadlock under any schedule"
    ends = [e for e in events if isinstance(e, EpochEnd)]
    assert [e.epoch for e in ends] == [0, 1]
    for e in ends:
        assert e.verification.verified, e.verification.reason
        assert e.verification.samples_trained == n
    applies = [e for e in events if isinstance(e, Apply)]
    assert [a.version for a in applies] == list(range(1, len(applies) + 1))
    for a in applies:
        for g in a.gradients:
            if cfg.max_staleness is not None:
                assert g.staleness <= cfg.max_staleness
            if cfg.mode == "hardsync":
                assert g.staleness == 0
    refused = [e for e in events if isinstance(e, Refuse)]
    assert core.protocol.refused == len(refused)
    if cfg.max_staleness is None:
        assert not refused


@settings(max_examples=100, deadline=None)
@given(lam=st.integers(1, 16), n=st.integers(1, 16), pushes=st.integers(1, 200),
       data=st.data())
def test_softsync_applies_exactly_every_floor_lambda_over_n(lam, n, pushes, data):
    n = min(n, lam)
    p = _joined(PSProtocol(PSConfig("softsync", n)), [f"w{i}" for i in range(lam)])
    c = lam // n
    version = {}
    for w in sorted(p.members):
        version[w] = p.pull(w).version
    applies = 0
    for k in range(1, pushes + 1):
        w = data.draw(st.sampled_from(sorted(version)))
        out = p.push(w, k, version.pop(w), samples=3)
        got = [d for d in out if isinstance(d, Apply)]
        assert len(got) == (1 if k % c == 0 else 0)
        for a in got:
            assert len(a.gradients) == c
            assert abs(sum(g.weight for g in a.gradients) - 1.0) < 1e-9
        applies += len(got)
        version[w] = p.pull(w).version
    assert applies == pushes // c == p.version


def test_staleness_rules():
    def weights(rule):
        p = _joined(PSProtocol(PSConfig("async", lr_staleness=rule)), ["a", "b", "c"])
        v = {w: p.pull(w).version for w in "abc"}
        out = []
        for i, w in enumerate("abc"):
            (a,) = p.push(w, i, v[w], samples=4)
            out.append((a.gradients[0].staleness, a.gradients[0].weight))
        return out
    assert weights("none") == [(0, 1.0), (1, 1.0), (2, 1.0)]
    assert weights("per_gradient") == [(0, 1.0), (1, 1.0), (2, 0.5)]
    # ⟨τ⟩ over the gradients applied so far: 0, 0.5, 1 → factors 1, 1, 1; then 1.0.
    assert weights("average") == [(0, 1.0), (1, 1.0), (2, 1.0)]


def test_hardsync_learners_wait_and_weights_follow_samples():
    p = _joined(PSProtocol(PSConfig("hardsync")), ["a", "b"])
    va, vb = p.pull("a").version, p.pull("b").version
    assert p.push("a", 1, va, samples=1) == []
    assert p.pull("a") == Wait("a")
    (a,) = p.push("b", 2, vb, samples=3)
    assert [g.weight for g in a.gradients] == [0.25, 0.75]
    assert p.pull("a") == Pulled("a", 1)


def test_bounded_refuse_and_wait_are_counted():
    p = _joined(PSProtocol(PSConfig("async", max_staleness=0)), ["a", "b"])
    va, vb = p.pull("a").version, p.pull("b").version
    p.push("a", 1, va, 1)
    (r,) = p.push("b", 2, vb, 1)
    assert isinstance(r, Refuse) and r.staleness == 1 and p.refused == 1
    w = _joined(PSProtocol(PSConfig("async", max_staleness=1, on_stale="wait")), ["a", "b", "c"])
    v = {x: w.pull(x).version for x in "abc"}
    assert len(w.push("a", 1, v["a"], 1)) == 1  # version 1; b and c have τ = 1 so far
    assert w.push("a", 2, w.pull("a").version, 1) == []  # would make b, c τ = 2: deferred
    assert w.deferred >= 1 and w.pull("a") == Wait("a")
    assert w.push("b", 3, v["b"], 1) == []  # c still computes on version 0
    # Now only queued gradients block: waiting cannot help, so c's is refused.
    out = w.push("c", 4, v["c"], 1)
    assert [type(d).__name__ for d in out] == ["Refuse", "Apply", "Apply"]
    assert [g.staleness for d in out[1:] for g in d.gradients] == [1, 1]
    assert w.refused == 1


def test_ledger_requeue_and_verify():
    led = AsyncLedger()
    led.begin_epoch(0, 10)
    a, b = led.take("x", 4), led.take("y", 4)
    led.requeue(a.id)
    c = led.take("z", 6)
    assert c.ranges == ((0, 4), (8, 10))
    for ch in (b, c):
        led.applied(ch.id)
    assert led.complete and led.verify().verified and led.verify().retried_samples == 4
    led.applied(c.id)
    assert not led.verify().verified


def test_ji_batches_follow_speed():
    assert ji_batches(32, {"a": 1, "b": 1, "c": 2, "d": 4}) == {"a": 4, "b": 4, "c": 8, "d": 16}
    assert ji_batches(32, {"a": 1, "b": 99}, b_min=2, b_max=20) == {"a": 2, "b": 20}
    pol = PerfAwareBatches(8, JiConfig(b0=8, every_pushes=2, scale_lr=True))
    pol.observe("a", 8, 1.0)
    pol.observe("b", 8, 0.25)
    assert pol.batch("a") == 3 and pol.batch("b") == 13
    assert pol.lr_scale(13) == 13 / 8 and PerfAwareBatches(8).lr_scale(13) == 1.0
    assert PerfAwareBatches(8).batch("a") == 8


def test_ji_lr_scale_is_the_gradients_own_samples_not_the_replanned_batch():
    """A 16-sample gradient whose push triggers a re-plan is weighted 16/b0, not by the new
    batch the re-plan gives its learner."""
    ji = JiConfig(b0=16, b_min=4, b_max=64, every_pushes=2, scale_lr=True)
    core = _joined(PSCore(PSConfig("async"), dataset_size=1000, epochs=1, seed=0,
                  batches=PerfAwareBatches(16, ji)), ["slow", "fast"])
    ws, _ = core.request("slow")
    wf, _ = core.request("fast")
    assert ws.chunk.samples == wf.chunk.samples == 16
    (a,) = core.push("fast", wf.ticket, wf.version, compute_s=0.01)
    assert a.gradients[0].weight == 1.0
    # The second push re-plans: "fast" is 8x faster, so "slow" gets a smaller batch now.
    (a,) = core.push("slow", ws.ticket, ws.version, compute_s=0.08)
    assert core.batches.batch("slow") < 16 < core.batches.batch("fast")
    assert a.gradients[0].weight == 1.0  # 16 samples / b0 16, whatever was planned since
    ws, _ = core.request("slow")
    (a,) = core.push("slow", ws.ticket, ws.version, compute_s=0.08)
    assert a.gradients[0].weight == ws.chunk.samples / 16


speeds = st.dictionaries(st.sampled_from([f"w{i}" for i in range(8)]),
                         st.floats(0.01, 1e4, allow_nan=False), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(speeds=speeds, total=st.integers(1, 2000), b_min=st.integers(1, 16),
       extra=st.one_of(st.none(), st.integers(0, 500)))
def test_ji_batches_within_bounds_and_proportional_to_speed(speeds, total, b_min, extra):
    b_max = None if extra is None else b_min + extra
    got = ji_batches(total, speeds, b_min, b_max)
    assert set(got) == set(speeds)
    s = sum(speeds.values())
    for w, b in got.items():
        assert b >= b_min and (b_max is None or b <= b_max)
        ideal = total * speeds[w] / s
        if b_min < ideal and (b_max is None or ideal < b_max):
            # Not clipped: b_i = round(B·v_i/Σv), i.e. proportional to v_i up to rounding.
            assert abs(b - ideal) <= 0.5 + 1e-9


@settings(max_examples=100, deadline=None)
@given(k=st.integers(1, 9), b0=st.integers(1, 32),
       pushes=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 64),
                                 st.floats(1e-4, 10.0)), max_size=60))
def test_ji_replans_exactly_every_k_pushes_within_bounds(k, b0, pushes):
    cfg = JiConfig(b0=b0, b_min=max(1, b0 // 4), b_max=4 * b0, every_pushes=k)
    pol = PerfAwareBatches(b0, cfg)
    members = ["a", "b", "c", "d"]
    for i, (w, samples, t) in enumerate(pushes, start=1):
        replanned = pol.observe(w, samples, t, members)
        assert replanned == (i % k == 0)
        for m in members:
            assert cfg.b_min <= pol.batch(m) <= cfg.b_max
        if replanned:
            # b_i ∝ v_i before clipping (learners without a speed get the mean speed).
            known = [pol.speeds[m] for m in members if m in pol.speeds]
            mean = sum(known) / len(known)
            v = {m: pol.speeds.get(m, mean) for m in members}
            assert {m: pol.batch(m) for m in members} == ji_batches(
                len(members) * b0, v, cfg.b_min, cfg.b_max)


def test_core_finishes_and_reports_idle_reasons():
    core = _joined(PSCore(PSConfig("hardsync"), dataset_size=5, epochs=1, seed=0,
                  batches=PerfAwareBatches(2)), ["a", "b"])
    wa, _ = core.request("a")
    wb, _ = core.request("b")
    assert core.push("a", wa.ticket, wa.version, 0.1) == []
    assert core.request("a")[0] == Idle("a", "wait")
    core.push("b", wb.ticket, wb.version, 0.1)
    wa, _ = core.request("a")
    assert core.request("b")[0] == Idle("b", "epoch_end")
    ev = core.push("a", wa.ticket, wa.version, 0.1)
    assert isinstance(ev[-1], EpochEnd) and ev[-1].verification.verified
    assert core.request("a")[0] == Finished("a")


def test_epochs_overlap_in_async_but_not_in_hardsync():
    """Async: once epoch 0 is handed out, a free learner takes epoch 1 while epoch 0's last
    gradient is in flight (no barrier, so no burst of learners all pulling one version).
    Hardsync keeps the barrier: an update never mixes two epochs."""
    core = _joined(PSCore(PSConfig("async"), dataset_size=8, epochs=3, seed=0,
                  batches=PerfAwareBatches(4)), ["a", "b", "c"])
    wa, _ = core.request("a")
    wb, _ = core.request("b")
    wc, _ = core.request("c")
    assert (wa.epoch, wb.epoch, wc.epoch) == (0, 0, 1)
    ev = core.push("c", wc.ticket, wc.version, 0.1)
    assert not any(isinstance(e, EpochEnd) for e in ev)
    wc, _ = core.request("c")
    assert wc.epoch == 1 and wc.chunk.ranges == ((4, 8),)  # epoch 1's second chunk
    ev = core.push("a", wa.ticket, wa.version, 0.1) + core.push("b", wb.ticket, wb.version, 0.1)
    ends = [e for e in ev if isinstance(e, EpochEnd)]
    assert [e.epoch for e in ends] == [0] and ends[0].verification.verified
    ev = core.push("c", wc.ticket, wc.version, 0.1)
    assert [e.epoch for e in ev if isinstance(e, EpochEnd)] == [1]  # in order

    hard = _joined(PSCore(PSConfig("hardsync"), dataset_size=6, epochs=2, seed=0,
                  batches=PerfAwareBatches(4)), ["a", "b"])
    wa, _ = hard.request("a")
    wb, _ = hard.request("b")
    assert (wa.chunk.samples, wb.chunk.samples) == (4, 2)
    hard.push("a", wa.ticket, wa.version, 0.1)
    (apply, end) = hard.push("b", wb.ticket, wb.version, 0.1)
    assert isinstance(apply, Apply) and isinstance(end, EpochEnd) and end.epoch == 0


def test_a_learner_whose_node_goes_is_lost_not_failed(monkeypatch):
    """Ray raises an IO error on a worker's connection to its raylet (its node removed
    mid-call) as a plain ``OSError: Broken pipe``. It failed a job whose learner's node went
    (CI, test_ps_job_survives_a_lost_learner_exactly_once): the driver took it for the
    learner's own error. The learner raises it on as a transport error: lost, replaced."""
    from types import SimpleNamespace

    import ray
    from dynabatch.actors.learner import Learner
    from dynabatch.scheduler.runtime.ray_ps import own_error
    from ray.exceptions import RayTaskError

    def broken_pipe(refs, timeout=None):
        raise OSError("Broken pipe")

    monkeypatch.setattr(ray, "get", broken_pipe)
    call = SimpleNamespace(remote=lambda *a, **k: "ref")
    learner = SimpleNamespace(worker_id="w0", computer=SimpleNamespace(size=10))
    server = SimpleNamespace(request=call, push=call)
    with pytest.raises(Exception) as raised:
        Learner.run(learner, server, call_timeout_s=1.0)
    assert own_error(RayTaskError("Learner.run", "traceback", raised.value)) is None
    assert "Broken pipe" in str(raised.value)

    # An OSError the server's own code raised reaches the learner as a Ray task error
    # (an instance of its cause's type too): it is not the transport's, and goes on as it is.
    server_error = RayTaskError("ParameterServer.request", "tb", OSError("disk full"))
    server_error = server_error.as_instanceof_cause()
    assert isinstance(server_error, OSError)

    def server_raised(refs, timeout=None):
        raise server_error

    monkeypatch.setattr(ray, "get", server_raised)
    with pytest.raises(Exception) as raised:
        Learner.run(learner, server, call_timeout_s=1.0)
    assert raised.value is server_error


def test_driver_classifies_learner_errors_and_checks_the_data():
    from dynabatch.actors.spec import JobSpec
    from dynabatch.actors.workloads import WorkloadError
    from dynabatch.scheduler.ps.driver import dataset_problem
    from dynabatch.scheduler.runtime.ray_ps import own_error as _own_error
    from ray.exceptions import ActorDiedError, RayTaskError

    def task_error(cause):
        return RayTaskError("Learner.run", "traceback", cause)

    assert _own_error(task_error(WorkloadError("loss: outputs have the wrong shape"))) == (
        "loss: outputs have the wrong shape")
    assert _own_error(task_error(RuntimeError("mat1 and mat2\nshapes"))) == (
        "RuntimeError: mat1 and mat2")
    assert _own_error(task_error(ActorDiedError())) is None  # the server died: lost
    assert _own_error(ActorDiedError()) is None  # the learner's node or process died

    class DS:
        targets = "values"
    spec = JobSpec.model_validate({"workers": 2, "protocol": {"name": "ps"},
                                   "dataset": {"name": "pkg.mod:load"}})
    assert dataset_problem(spec, DS()).startswith("dataset.name: protocol ps trains "
                                                  "classification")
    DS.targets = "classes"
    assert dataset_problem(spec, DS()) is None

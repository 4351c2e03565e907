"""The schedule machines (pure): stage-wise batch and learning rate, ISGD's control chart,
the goodput estimator; their spec validation; and the coordinator driving them on the fake
runtime (stage boundaries, ISGD repeats, checkpoint resume keeps the schedule's position)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from dynabatch.actors.contracts import IsgdRule, StepTelemetry
from dynabatch.actors.spec import JobSpec, SpecError, parse_spec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.regime.goodput import (
    NoiseEstimate,
    StepTimeModel,
    choose_batch,
    efficiency,
    fpc,
    gain,
    step_time_model,
)
from dynabatch.scheduler.core.regime.isgd import ControlChart, IsgdReportError, judge, plan_for
from dynabatch.scheduler.core.regime.regime import Regime
from dynabatch.scheduler.core.regime.schedule import LrRule, Schedule, Stage
from dynabatch.scheduler.core.sync.steptime import StepTimeStats, equal_finish
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes import Lineages, sim_runtime

stages_st = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4096)), min_size=1,
                     max_size=5)


def _schedule(stages, scaling="linear", warm=0.0, lr=None) -> Schedule:
    return Schedule(tuple(Stage(e, b) for e, b in stages),
                    lr or LrRule(0.1, total_epochs=sum(e for e, _ in stages)), scaling, warm)


# --- Schedule -------------------------------------------------------------------------------
@settings(deadline=None, max_examples=50)
@given(stages_st)
def test_stage_epochs_add_up_and_every_epoch_has_its_stage_batch(stages):
    s = _schedule(stages)
    assert s.epochs == sum(e for e, _ in stages)
    batches = [s.batch_at(e) for e in range(s.epochs)]
    assert batches == [b for e, b in stages for _ in range(e)]
    assert s.batch_at(s.epochs + 3) == stages[-1][1]  # past the end: the last stage


@settings(deadline=None, max_examples=50)
@given(stages_st, st.sampled_from(["linear", "sqrt", "none"]), st.integers(1, 50))
def test_lr_after_a_jump_follows_the_scaling_rule(stages, scaling, spe):
    s = _schedule(stages, scaling)
    b0 = stages[0][1]
    for k, start in enumerate(s.boundaries):
        ratio = stages[k][1] / b0
        want = 0.1 * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[scaling]
        assert s.lr_at(start, 0, spe) == pytest.approx(want)


@settings(deadline=None, max_examples=50)
@given(stages_st, st.floats(0.1, 4.0), st.integers(1, 30))
def test_batch_warmup_ramps_monotonically_from_the_previous_factor(stages, warm, spe):
    s = _schedule(stages, "linear", warm)
    b0 = stages[0][1]
    for k, start in enumerate(s.boundaries[1:], 1):
        prev, cur = stages[k - 1][1] / b0, stages[k][1] / b0
        lrs = [s.lr_at(e, i, spe) / 0.1 for e in range(start, start + stages[k][0])
               for i in range(spe)]
        lo, hi = min(prev, cur), max(prev, cur)
        assert all(lo - 1e-9 <= x <= hi + 1e-9 for x in lrs)
        diffs = [b - a for a, b in itertools.pairwise(lrs)]
        assert all(d >= -1e-12 for d in diffs) if cur >= prev else all(d <= 1e-12 for d in diffs)
        t_done = warm - 1e-9
        if stages[k][0] >= t_done + 1:  # the warm-up ends inside the stage: the target
            assert lrs[-1] == pytest.approx(cur)


@settings(deadline=None, max_examples=50)
@given(st.floats(0.5, 10.0), st.integers(1, 40), st.integers(5, 30))
def test_lr_warmup_is_monotone_and_reaches_the_base(warm, spe, epochs):
    rule = LrRule(0.2, "constant", warmup_epochs=warm, total_epochs=epochs)
    s = Schedule.fixed(64, epochs, rule)
    lrs = [s.lr_at(e, i, spe) for e in range(epochs) for i in range(spe)]
    assert all(b >= a for a, b in itertools.pairwise(lrs))
    assert lrs[0] > 0
    if epochs > warm:
        assert lrs[-1] == pytest.approx(0.2)


def test_multistep_and_cosine():
    ms = Schedule.fixed(32, 10, LrRule(1.0, "multistep", (3, 6), 0.5, total_epochs=10))
    assert [ms.lr_at(e, 0, 4) for e in (0, 2, 3, 5, 6, 9)] == [1, 1, 0.5, 0.5, 0.25, 0.25]
    cos = Schedule.fixed(32, 10, LrRule(1.0, "cosine", min_factor=0.1, total_epochs=10))
    lrs = [cos.lr_at(e, i, 4) for e in range(10) for i in range(4)]
    assert all(b <= a for a, b in itertools.pairwise(lrs))
    assert lrs[-1] == pytest.approx(0.1)


# --- ISGD control chart --------------------------------------------------------------------
@settings(deadline=None, max_examples=50)
@given(st.lists(st.floats(0.0, 10.0), min_size=0, max_size=60), st.integers(2, 20),
       st.floats(0.5, 4.0))
def test_control_chart_limit_is_mean_plus_sigma_std_of_the_window(losses, window, sigma):
    c = ControlChart(window, sigma)
    for x in losses:
        c = c.push(x)
    assert len(c.losses) == min(len(losses), window)
    if len(losses) < window:
        assert c.limit is None and plan_for(c, 5, 0.1, 3).rule() is None
        return
    last = losses[-window:]
    mean = sum(last) / window
    std = math.sqrt(sum((x - mean) ** 2 for x in last) / window)
    assert c.limit == pytest.approx(mean + sigma * std)
    assert plan_for(c, 0, 0.1, 3).rule() is None  # monitoring starts after the first epoch
    assert plan_for(c, 1, 0.1, 3).rule() == IsgdRule(c.limit, 0.1, 3)


@settings(deadline=None, max_examples=50)
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=80), st.integers(2, 12),
       st.integers(0, 40))
def test_the_workers_chart_is_the_coordinators_step_for_step(losses, window, cut):
    # A segment's plan carries the chart; the worker pushes every step's loss itself. Any
    # cut into segments gives the same rules as one chart over the whole run.
    whole = ControlChart(window, 3.0)
    rules_whole = []
    for x in losses:
        rules_whole.append(plan_for(whole, 1, 0.1, 5).rule())
        whole = whole.push(x)
    chart, rules_seg = ControlChart(window, 3.0), []
    for seg in (losses[:cut], losses[cut:]):
        plan = plan_for(chart, 1, 0.1, 5)  # the coordinator stamps the segment
        for x in seg:
            rules_seg.append(plan.rule())
            plan = plan.after(x)
        for x in seg:  # the coordinator replays the committed steps
            chart = chart.push(x)
    assert rules_seg == rules_whole
    assert chart == whole


def test_a_window_of_an_epoch_follows_the_steps_per_epoch():
    c = ControlChart(4, 3.0, (1.0, 2.0, 3.0, 4.0))
    assert c.resized(4) is c
    assert c.resized(2).losses == (3.0, 4.0) and c.resized(2).window == 2
    assert c.resized(8).losses == c.losses and c.resized(8).limit is None
    spec = _spec(isgd={"enabled": True, "window": "epoch"})
    coord, _ = _coord(spec)
    assert coord.run().state == JobState.SUCCEEDED
    assert coord.regime.chart.window == N // 50  # 20 batches per epoch


def test_control_chart_rejects_a_window_below_two():
    with pytest.raises(ValueError, match="window"):
        ControlChart(1, 3.0)


@settings(deadline=None, max_examples=50)
@given(st.floats(0.0, 5.0), st.lists(st.floats(0.0, 5.0), min_size=0, max_size=30),
       st.floats(0.0, 3.0), st.integers(1, 10))
def test_isgd_never_runs_more_than_max_extra_iterations(psi0, losses, limit, max_extra):
    torch = pytest.importorskip("torch")
    from dynabatch.actors.optim import isgd_extras

    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    opt = torch.optim.SGD([w], lr=0.1)
    seen = iter(losses)
    calls = []

    def loss_and_grad() -> float:
        psi = next(seen, 0.0)  # past the list: below any limit
        calls.append(psi)
        w.grad = torch.ones(3)
        return psi

    done = isgd_extras(IsgdRule(limit, 0.1, max_extra), psi0, [w], opt, loss_and_grad)
    assert 0 <= done <= max_extra
    # Every pass is an extra iteration (none uncounted): one pass per conservative update.
    assert len(calls) == done
    # The batch kept training exactly while its loss (judged, then after each update) was
    # above the limit: a batch judged above it gets at least one extra iteration.
    checked = [psi0, *calls]
    assert all(x > limit for x in checked[:done])
    assert done == max_extra or checked[done] <= limit
    assert (done >= 1) == (psi0 > limit)


def test_isgd_step_is_the_conservative_subproblem_gradient():
    torch = pytest.importorskip("torch")
    from dynabatch.actors.optim import isgd_extras

    w = torch.nn.Parameter(torch.zeros(4))
    w.grad = torch.full((4,), 2.0)  # the batch's own pass, judged at loss 3
    opt = torch.optim.SGD([w], lr=1.0)
    state = {"n": 0}

    def loss_and_grad() -> float:
        state["n"] += 1
        w.grad = torch.full((4,), 2.0)
        return 3.0  # always above the limit 1.0
    done = isgd_extras(IsgdRule(1.0, 0.4, 2), 3.0, [w], opt, loss_and_grad)
    # step 1: g = (3-1)·2 + (0.4/4)·(0 - 0) = 4 → w = -4
    # step 2: g = (3-1)·2 + (0.4/4)·(-4 - 0) = 3.6 → w = -7.6
    assert done == 2 and torch.allclose(w.detach(), torch.full((4,), -7.6))
    # Two passes, both counted; p.grad holds the last pass's gradient for the normal step.
    assert state["n"] == 2 and torch.equal(w.grad, torch.full((4,), 2.0))


# --- goodput ----------------------------------------------------------------------------
@settings(deadline=None, max_examples=50)
@given(st.floats(0.01, 10.0), st.floats(0.0, 1000.0),
       st.lists(st.integers(1, 512), min_size=2, max_size=8, unique=True))
def test_noise_estimate_recovers_gradient_and_trace_from_unequal_batches(g2, tr, batches):
    # Expected |g_b|² = |∇L|² + tr(Σ)/b: the regression is exact on expected values.
    est = NoiseEstimate().observe([(b, g2 + tr / b) for b in batches]).close()
    assert est.grad_sq == pytest.approx(g2, rel=1e-6, abs=1e-9)
    assert est.trace == pytest.approx(tr, rel=1e-6, abs=1e-6)
    assert est.noise_scale == pytest.approx(tr / g2, rel=1e-5, abs=1e-6)


@settings(deadline=None, max_examples=50)
@given(st.floats(0.01, 10.0), st.floats(0.0, 1000.0), st.integers(600, 5000),
       st.lists(st.lists(st.integers(1, 512), min_size=2, max_size=5), min_size=1,
                max_size=20))
def test_noise_is_pooled_over_the_epoch_with_the_finite_population(g2, tr, n, steps):
    # Sampling without replacement from N: E|g_b|² = |∇L|² + tr(Σ)·(1/b − 1/N)·N/(N − 1).
    est = NoiseEstimate()
    for batches in steps:
        est = est.observe([(b, g2 + tr * fpc(b, n)) for b in batches], population=n)
    if all(len(set(bs)) < 2 for bs in steps):  # no step with unequal batches: no slope
        assert est.close().noise_scale is None
        return
    assert est.noise_scale is None  # nothing until the epoch is closed
    est = est.close()
    assert est.grad_sq == pytest.approx(g2, rel=1e-5, abs=1e-8)
    assert est.trace == pytest.approx(tr, rel=1e-4, abs=1e-4)
    assert est.n == 0  # the next epoch starts over
    assert fpc(n, n) == 0.0 and fpc(1, n) == pytest.approx(1.0)
    # The full batch has no sampling noise left: it beats half of the data by far.
    assert efficiency(n, 32, 1e9, n) > efficiency(n // 2, 32, 1e9, n)


def test_noise_fit_is_not_fooled_by_a_gradient_that_grows_over_the_epoch():
    # |∇L|² grows tenfold over the epoch while tr(Σ) stays; the last (short) step has the
    # smallest shares. A line through all points at once would mistake the growth for
    # noise; the within-step fit does not.
    est = NoiseEstimate()
    steps = [(1.0 + 0.5 * s, (16, 16, 16, 48)) for s in range(12)] + [(7.0, (8, 8, 8, 24))]
    for g2, batches in steps:
        est = est.observe([(b, g2 + 40.0 * fpc(b, 600)) for b in batches], population=600)
    grad_sq, trace = est.fit()
    assert trace == pytest.approx(40.0)
    assert grad_sq == pytest.approx(sum(4 * g for g, _ in steps) / (4 * len(steps)))


def test_noise_estimate_needs_two_batch_sizes_and_keeps_a_usable_one():
    assert NoiseEstimate().observe([(8, 1.0), (8, 2.0)]).close().epochs == 0
    good = NoiseEstimate().observe([(8, 1.0 + 80 / 8), (16, 1.0 + 80 / 16)]).close()
    assert good.noise_scale == pytest.approx(80.0)
    # An epoch whose intercept comes out negative (noise swamped it) keeps the last one.
    bad = good.observe([(8, 20.0), (16, 5.0)]).close()
    assert bad.noise_scale == pytest.approx(80.0) and bad.epochs == 1


@settings(deadline=None, max_examples=50)
@given(st.floats(1.0, 1e5), st.integers(1, 256), st.integers(1, 4096))
def test_efficiency_and_adascale_gain(noise, base, batch):
    e = efficiency(batch, base, noise)
    assert (0 < e <= 1) if batch >= base else e >= 1
    assert gain(base, base, noise) == pytest.approx(1.0)
    assert gain(batch, base, noise) == pytest.approx(batch / base * e)
    r = gain(batch, base, noise)
    assert min(1.0, batch / base) - 1e-9 <= r <= max(1.0, batch / base) + 1e-9


def test_goodput_prefers_large_batches_when_the_noise_is_large():
    timing = StepTimeModel((0.02, 0.02, 0.02), (1e-3, 2e-3, 4e-3), 0.01)
    small, _ = choose_batch(16, 2048, 16, 1.0, timing)
    large, _ = choose_batch(16, 2048, 16, 5000.0, timing)
    assert small < large
    assert choose_batch(16, 2048, 16, None, timing) == (16, 0.0)
    assert choose_batch(16, 2048, 16, 5000.0, timing, population=600)[0] <= 600


workers_st = st.lists(st.tuples(st.floats(0.0, 0.05), st.floats(1e-5, 1e-2)), min_size=1,
                      max_size=8)


@settings(deadline=None, max_examples=100)
@given(workers_st, st.floats(0.0, 0.05), st.lists(st.floats(1.0, 4096.0), min_size=2,
                                                   max_size=6))
def test_step_time_model_is_the_equal_finish_time_and_throughput_never_falls(
        workers, overhead, batches):
    a = tuple(x for x, _ in workers)
    c = tuple(y for _, y in workers)
    m = StepTimeModel(a, c, overhead)
    for batch in batches:
        t = equal_finish(np.array(a), np.array(c), batch, np.zeros(len(a)),
                         np.full(len(a), 2 * batch))[1]
        assert m.throughput(batch) == pytest.approx(batch / (t + overhead))
    tps = [m.throughput(b) for b in sorted(batches)]
    assert all(y >= x * (1 - 1e-9) for x, y in itertools.pairwise(tps))


def test_step_time_fit_is_optimistic_until_batch_sizes_vary():
    one = StepTimeStats()
    for _ in range(10):
        one = one.add(20.0, 0.004)  # one batch size: a and c cannot be told apart
    m = step_time_model({"w": one}, overhead=0.0)
    assert m.a == pytest.approx((0.002,)) and m.c == pytest.approx((0.002 / 20,))
    two = one
    for _ in range(10):
        two = two.add(60.0, 0.008)  # t = 0.002 + 0.0001·b
    m = step_time_model({"w": two}, overhead=0.001)
    assert m.a == pytest.approx((0.002,)) and m.c == pytest.approx((0.0001,))
    assert step_time_model({"w": StepTimeStats()}, 0.0) is None


def test_goodput_model_predicts_the_gain_of_large_batches_on_affine_workers():
    # The audit's case: a fixed per-step cost on every worker. A rate model (samples per
    # compute-second at B=32) predicted almost no gain at B=512; the equal-finish model
    # predicts what the workers deliver.
    a, c = [0.003] * 3, [1e-4, 2e-4, 4e-4]
    stats = {}
    for i in range(3):
        s = StepTimeStats()
        for b in (8, 10, 14, 30, 40, 56):  # two epochs' shares, at B = 32 and B = 128
            s = s.add(b, a[i] + c[i] * b)
        stats[f"w{i}"] = s
    m = step_time_model(stats, overhead=0.0005)
    true = StepTimeModel(tuple(a), tuple(c), 0.0005)
    for batch in (32, 128, 512):
        assert m.throughput(batch) == pytest.approx(true.throughput(batch), rel=1e-6)
    assert m.throughput(512) > 2.5 * m.throughput(32)
    # bench/sched_common.py's cluster: (512 + 52.5)/17,500 s + 0.5 ms: 15.6 samples/ms at
    # B = 512, what the balanced cluster delivers (the rate model said 5.5).
    assert m.throughput(512) / 1000 == pytest.approx(15.63, rel=1e-3)


# --- spec --------------------------------------------------------------------------------
def _err(**kw) -> str:
    with pytest.raises(SpecError) as ei:
        parse_spec({"workers": 2, **kw})
    assert "\n" not in str(ei.value)
    return str(ei.value)


def test_spec_stages_and_their_errors():
    s = parse_spec({"workers": 2, "epochs": 5, "schedule": {
        "stages": [{"epochs": 2, "global_batch": 32}, {"epochs": 3, "global_batch": 256}],
        "lr_scaling": "sqrt", "warmup_epochs": 1}})
    assert s.schedule.mode == "stages" and s.global_batch == 32 and s.batch_range == (32, 256)
    msg = _err(epochs=6, schedule={"stages": [{"epochs": 2, "global_batch": 32}]})
    assert msg.startswith("schedule.stages:") and "add up to 2" in msg
    msg = _err(epochs=2, workers=8, schedule={"stages": [{"epochs": 1, "global_batch": 8},
                                                          {"epochs": 1, "global_batch": 4}]})
    assert "schedule.stages.1.global_batch" in msg and "smaller than workers" in msg
    assert "schedule.stages.0.global_batch" in _err(
        epochs=1, max_batch=16, schedule={"stages": [{"epochs": 1, "global_batch": 64}]})
    assert _err(schedule={"mode": "adaptive"}).startswith("schedule.mode:")
    assert _err(optimizer={"schedule": {"name": "exp"}}).startswith("optimizer.schedule.name:")
    assert _err(isgd={"enabled": True, "window": 1}).startswith("isgd.window:")
    assert _err(optimizer={"name": "adam", "nesterov": True}).startswith("optimizer:")
    assert "global_batch" in _err(global_batch=64, epochs=1,
                                  schedule={"stages": [{"epochs": 1, "global_batch": 32}]})
    assert _err(schedule={"mode": "goodput"}).startswith("schedule.max_global_batch:")
    assert _err(epochs=3, optimizer={"schedule": {"name": "multistep", "milestones": [3]}}
                ).startswith("optimizer.schedule.milestones:")
    assert parse_spec({"optimizer": {"name": "adamw", "weight_decay": 0.01}}).optimizer.name \
        == "adamw"
    assert parse_spec({"workers": 2, "isgd": {"enabled": True, "window": "epoch"}}
                      ).isgd.window == "epoch"
    assert _err(isgd={"enabled": True, "window": "batch"}).startswith("isgd.window:")
    assert parse_spec({"dataset": {"shuffle": "once"}}).dataset.shuffle == "once"
    assert _err(dataset={"shuffle": "never"}).startswith("dataset.shuffle:")
    g = {"mode": "goodput", "max_global_batch": 256}
    assert parse_spec({"workers": 2, "global_batch": 32,
                       "schedule": {**g, "min_global_batch": 256}}).batch_range == (256, 256)
    assert _err(global_batch=32, schedule={**g, "min_global_batch": 512}).startswith(
        "schedule.min_global_batch:")
    assert _err(schedule={"mode": "fixed", "min_global_batch": 8}).startswith("schedule:")


def test_a_stage_above_the_share_cap_names_the_field_and_what_to_change():
    two = {"epochs": 2, "schedule": {"stages": [{"epochs": 1, "global_batch": 32},
                                                 {"epochs": 1, "global_batch": 256}]}}
    # max_batch caps every worker's share: 2 x 64 cannot hold 256, whatever the memory cap.
    msg = _err(max_batch=64, **two)
    assert msg.startswith("schedule.stages.1.global_batch:") and "at least 128" in msg
    msg = _err(max_batch=64, micro_batch=16, **two)
    assert msg.startswith("schedule.stages.1.global_batch:")
    assert "micro_batch (16) already bounds" in msg
    # micro_batch bounds memory only: without a share cap any stage fits (it accumulates).
    s = parse_spec({"workers": 2, "micro_batch": 16, **two})
    assert s.batch_range == (32, 256)
    assert "schedule.max_global_batch" in _err(
        max_batch=64, global_batch=32, schedule={"mode": "goodput", "max_global_batch": 512})


# --- the coordinator driving them ------------------------------------------------------------
N = 1000


def _spec(**kw) -> JobSpec:
    base = dict(workers=3, global_batch=50, epochs=4, policy="dbs", collective_timeout_s=2,
                worker_wait_timeout_s=5, start_timeout_s=5, optimizer={"lr": 0.1})
    base.update(kw)
    return JobSpec.model_validate(base)


def _coord(spec: JobSpec, gradients: Lineages | None = None) -> tuple[Coordinator, SimRuntime]:
    rt = sim_runtime(spec, n_train=N, speeds={0: 1000, 1: 500, 2: 250},
                     gradients=gradients or Lineages())
    return Coordinator("job", spec, runtime=rt, clock=rt.clock), rt


STAGED = {"stages": [{"epochs": 2, "global_batch": 50}, {"epochs": 2, "global_batch": 200}],
          "lr_scaling": "linear", "warmup_epochs": 1}


def test_stage_boundary_replans_the_new_batch_and_scales_the_lr():
    coord, rt = _coord(_spec(schedule=STAGED))
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    hist = coord.history()
    assert [r.global_batch for r in hist] == [50, 50, 200, 200]
    assert [r.steps for r in hist] == [20, 20, 5, 5]
    for r in hist:  # every epoch still trains every sample exactly once
        assert r.verified and r.samples_trained == N
        assert sum(w.batch for w in r.workers) == r.global_batch
    steps = [sp for plans in rt.record.plans for sp in next(iter(plans.values())).steps]
    sizes = {(sp.size, round(sp.lr, 6)) for sp in steps}
    # Stage 1 at LR 0.1; stage 2 ramps from 0.1 to 0.4 over one epoch, then holds 0.4.
    assert (50, 0.1) in sizes and (200, 0.4) in sizes
    ramp = [sp.lr for plans in rt.record.plans for sp in next(iter(plans.values())).steps
            if sp.size == 200]
    assert ramp == sorted(ramp) and 0.1 < ramp[0] < 0.4
    assert hist[-1].lr == pytest.approx(0.4)


@pytest.mark.parametrize("max_extra, extra", [(5, 3), (3, 3), (1, 1)])
def test_isgd_flags_outlier_batches_and_every_worker_repeats_them(max_extra, extra):
    def loss_of(epoch, step):  # flat losses with one spike per epoch
        return 5.0 if step == 4 else 1.0 + 0.01 * (step % 3)

    spec = _spec(isgd={"enabled": True, "window": 5, "sigma": 2.0, "max_extra": max_extra})
    coord, rt = _coord(spec, Lineages(loss_of=loss_of, isgd_decay=0.5))
    assert coord.run().state == JobState.SUCCEEDED
    hist = coord.history()
    assert hist[0].isgd_flagged == 0  # monitoring starts after the first epoch
    for r in hist[1:]:
        # The spike 5.0 is judged above the limit (~1.03) and keeps training: after each
        # update it halves, 2.5, 1.25 (still above) and 0.625: 3 extra iterations, or
        # max_extra. Each is one more pass over the batch's 50 samples.
        assert r.isgd_flagged == 1
        assert r.isgd_extra_iterations == extra
        assert r.grad_evals == N + extra * 50
        assert r.verified and r.samples_trained == N  # repeats are not new samples
    for plans in rt.record.plans:  # every worker got the same chart
        assert len({p.isgd for p in plans.values()}) == 1
    # The workers keep the chart up to date themselves: a segment is not cut to one step.
    assert max(len(next(iter(p.values())).steps) for p in rt.record.plans) > 1


def _report(worker: str, loss: float, flagged: bool, extra: int) -> StepTelemetry:
    return StepTelemetry(worker=worker, epoch=1, step=0, batch=25, samples=25, compute_s=0.01,
                         wait_s=0.0, loss_sum=loss * 25, step_size=50, flagged=flagged,
                         extra_iters=extra, isgd_loss=loss)


def test_the_coordinator_checks_the_workers_isgd_decisions_against_its_chart():
    rule = IsgdRule(limit=1.0, epsilon=0.1, max_extra=3)
    assert judge(rule, [_report("a", 2.0, True, 2), _report("b", 2.0, True, 2)]) == (
        2.0, True, 2)
    assert judge(rule, [_report("a", 0.5, False, 0)]) == (0.5, False, 0)
    assert judge(None, [_report("a", 9.0, False, 0)]) == (9.0, False, 0)
    bad = [
        [_report("a", 2.0, False, 0)],  # above the limit but not flagged
        [_report("a", 0.5, True, 1)],  # flagged below it
        [_report("a", 2.0, True, 0)],  # flagged with no extra iteration
        [_report("a", 2.0, True, 4)],  # more than max_extra
        [_report("a", 0.5, False, 1)],  # extra iterations on a normal batch
        [_report("a", 2.0, True, 1), _report("b", 2.5, True, 1)],  # different losses
        [_report("a", 2.0, True, 1), _report("b", 2.0, False, 0)],  # different flags
    ]
    for reports in bad:
        with pytest.raises(IsgdReportError, match="epoch 1 step 0"):
            judge(rule, reports)
    # The regime replays its chart from the reports and refuses a wrong decision.
    reg = Regime(_spec(isgd={"enabled": True, "window": 2}))
    reg.chart = ControlChart(2, 3.0, (1.0, 1.0))
    with pytest.raises(IsgdReportError):
        reg.observe([_report("a", 1.5, False, 0)])
    reg.observe([_report("a", 1.5, True, 2)])
    assert reg.chart.losses == (1.0, 1.5) and reg._ep.extra_iterations == 2


def test_checkpoint_resume_keeps_the_schedule_position(tmp_path):
    spec = _spec(schedule=STAGED, checkpoint={"dir": str(tmp_path)},
                 isgd={"enabled": True, "window": 4})
    coord, _rt = _coord(spec)
    while coord.epoch < 3:  # into the second stage, then the coordinator is gone
        assert coord.step()
    from dynabatch.scheduler.checkpoint import load_checkpoint

    saved = load_checkpoint(str(tmp_path), "job")["schedule"]
    assert saved["epoch"] == 3 and saved["global_batch"] == 200
    assert len(saved["regime"]["chart"]) == 4
    coord2, rt2 = _coord(spec)
    assert coord2.regime.chart.losses == tuple(saved["regime"]["chart"])
    assert coord2.run().state == JobState.SUCCEEDED
    assert [r.global_batch for r in coord2.history()] == [50, 50, 200, 200]
    first = next(iter(rt2.record.plans[0].values()))
    assert first.epoch == 3 and first.steps[0].size == 200
    assert first.steps[0].lr == pytest.approx(0.4)


def test_mid_epoch_resume_continues_the_schedule_where_it_stopped(tmp_path):
    spec = _spec(schedule=STAGED, checkpoint={"dir": str(tmp_path)},
                 rebalance={"mode": "steps", "every_steps": 5},
                 isgd={"enabled": True, "window": 4})
    coord, _rt = _coord(spec)
    while (coord.epoch, coord.step_in_epoch) < (1, 10):
        assert coord.step()
    coord.cancel("stop mid-epoch")
    coord.step()
    assert coord.snapshot().state == JobState.CANCELLED
    from dynabatch.scheduler.checkpoint import load_checkpoint

    ckpt = load_checkpoint(str(tmp_path), "job")
    saved = ckpt["schedule"]
    assert (saved["epoch"], saved["step"]) == (1, 10) and saved["global_batch"] == 50
    assert saved["regime"]["epoch_counts"][3] == 10  # the open epoch's steps so far
    coord2, rt2 = _coord(spec)
    assert coord2.regime.chart == coord.regime.chart
    assert coord2.run().state == JobState.SUCCEEDED
    first = next(iter(rt2.record.plans[0].values()))
    assert (first.epoch, first.steps[0].step, first.steps[0].size) == (1, 10, 50)
    assert first.steps[0].lr == pytest.approx(0.1)
    hist = coord2.history()
    assert [r.global_batch for r in hist] == [50, 50, 200, 200]
    # The resumed epoch counts what was trained before the stop and after it.
    assert hist[1].verified and hist[1].samples_trained == N and hist[1].grad_evals == N


class _NoisyLineages(Lineages):
    """Replicas whose gradient norms, on the steps that measure the noise, are at their
    expected values for |∇L|² = 1 and tr(Σ) = 400 (B_noise = 400), with the
    finite-population correction."""

    def step(self, seed, epoch, dataset_size, shares, rule=None, caps=None, *, workers=()):
        out = super().step(seed, epoch, dataset_size, shares, rule, caps, workers=workers)
        if not shares[0].noise:
            return out
        return replace(out, local_sqnorms=[1.0 + 400.0 * fpc(sp.own_size, N) for sp in shares],
                       global_sqnorm=1.0 + 400.0 * fpc(shares[0].size, N))


def test_goodput_state_survives_a_resume(tmp_path):
    spec = _spec(global_batch=30, epochs=5, checkpoint={"dir": str(tmp_path)},
                 schedule={"mode": "goodput", "max_global_batch": 480})

    def make():
        return _coord(spec, _NoisyLineages())

    coord, _ = make()
    while coord.epoch < 3:
        assert coord.step()
    hist = coord.history()
    assert all(r.noise_scale == pytest.approx(400.0, rel=1e-6) for r in hist)
    # Large noise and a fixed cost per step: goodput moves up from B_0 = 30.
    assert hist[0].global_batch == 30 and hist[-1].goodput_batch > 30
    from dynabatch.scheduler.checkpoint import load_checkpoint

    saved = load_checkpoint(str(tmp_path), "job")["schedule"]
    assert saved["epoch"] == 3 and saved["global_batch"] == hist[-1].goodput_batch
    coord2, rt2 = make()
    assert coord2.regime.noise == coord.regime.noise
    assert coord2.regime.goodput_batch == coord.regime.goodput_batch
    assert coord2.run().state == JobState.SUCCEEDED
    first = next(iter(rt2.record.plans[0].values()))
    b = hist[-1].goodput_batch
    assert first.epoch == 3 and first.steps[0].size == b
    # The resumed epoch's learning rate is AdaScale's gain at that batch, from the
    # restored estimate (not the 1.0 of a job that has measured nothing).
    assert first.steps[0].lr == pytest.approx(0.1 * gain(b, 30, 400.0, N), rel=1e-6)
    assert [r.epoch for r in coord2.history()] == [0, 1, 2, 3, 4]


# --- the simulator's real-gradient mode drives the same machines ------------------------------
def test_simulator_trains_stages_isgd_and_goodput_with_real_gradients():
    pytest.importorskip("torch")
    from dynabatch.scheduler.sim.cluster_spec import parse_cluster
    from dynabatch.scheduler.sim.simulator import simulate

    cluster = parse_cluster({"classes": [
        {"name": "fast", "count": 2, "a_ms": 2, "c_ms_per_sample": 0.05},
        {"name": "slow", "count": 1, "a_ms": 2, "c_ms_per_sample": 0.15}]})
    base = {"dataset": {"name": "digits", "limit": 600}, "model": {"name": "mlp", "hidden": 16},
            "workers": 3, "epochs": 3, "policy": "dbs"}
    spec = parse_spec({**base, "schedule": {"stages": [{"epochs": 1, "global_batch": 30},
                                                        {"epochs": 2, "global_batch": 120}]},
                       "isgd": {"enabled": True, "window": 4, "sigma": 0.5}})
    res = simulate(spec, cluster, real_gradients=True)
    assert res.snapshot.state == JobState.SUCCEEDED, res.snapshot.reason
    hist = res.history
    assert [r.global_batch for r in hist] == [30, 120, 120]
    assert all(r.verified for r in hist)
    assert sum(r.isgd_flagged for r in hist) > 0  # σ = 0.5 flags some batches
    for r in hist:
        # Every flagged batch kept training (at least one extra iteration), at most 5.
        assert r.isgd_flagged <= r.isgd_extra_iterations <= 5 * r.isgd_flagged
        assert r.grad_evals >= r.samples_trained + r.isgd_extra_iterations
    spec = parse_spec({**base, "global_batch": 30, "epochs": 2,
                       "schedule": {"mode": "goodput", "max_global_batch": 300}})
    hist = simulate(spec, cluster, real_gradients=True).history
    assert all(r.noise_scale is not None and r.noise_scale > 0 for r in hist)
    assert all(30 <= r.goodput_batch <= 300 for r in hist)
    assert [r.global_batch for r in hist[1:]] == [r.goodput_batch for r in hist[:-1]]


def test_the_simulated_clock_charges_every_isgd_pass():
    pytest.importorskip("torch")
    from dynabatch.scheduler.sim.cluster_spec import parse_cluster
    from dynabatch.scheduler.sim.cost_model import SimulatedCluster
    from dynabatch.scheduler.sim.simulator import simulate

    # Two equal nodes, no jitter: every step of 50 samples takes the same time.
    cluster = parse_cluster({"classes": [{"name": "n", "count": 2, "a_ms": 2,
                                          "c_ms_per_sample": 0.1}], "noise_sigma": 0.0,
                             "allreduce": {"alpha_ms": 1.0, "beta_ms_per_mb": 2.0}})
    base = {"dataset": {"name": "digits", "limit": 600}, "model": {"name": "mlp", "hidden": 16},
            "workers": 2, "epochs": 2, "global_batch": 50, "policy": "static",
            "optimizer": {"lr": 0.1, "momentum": 0.9}}
    sgd = simulate(parse_spec(base), cluster, real_gradients=True)
    isgd = simulate(parse_spec({**base, "isgd": {"enabled": True, "window": 4, "sigma": 0.5}}),
                    cluster, real_gradients=True)
    extras = sum(r.isgd_extra_iterations for r in isgd.history)
    assert sum(r.isgd_flagged for r in isgd.history) > 0 and extras > 0
    steps = sum(r.steps for r in isgd.history)
    assert steps == 24
    # Every pass over the batch is a gradient per sample: the steps' own and the extras'.
    assert sum(r.grad_evals for r in isgd.history) == 600 * 2 + extras * 50
    model = SimulatedCluster(cluster)
    nbytes = sgd.runtime.gradients.model_bytes
    step_s = 0.002 + 0.0001 * 25 + model.allreduce_s(2, 50, nbytes)
    # The batch loss rides in the gradient's all-reduce (no collective of its own); each
    # extra iteration is a whole pass (compute and all-reduce): nothing ran that the clock
    # did not charge, and a step that flags nothing costs what an SGD step costs.
    want = extras * step_s
    assert isgd.sim_seconds - sgd.sim_seconds == pytest.approx(want, rel=1e-9)
    # What the policy plans with stays each step's own compute, as on Ray.
    assert isgd.history[-1].workers[0].compute_s == pytest.approx(
        sgd.history[-1].workers[0].compute_s)


# --- dynabatch tune ------------------------------------------------------------------------
def test_tune_spends_at_most_its_budget_and_writes_a_loadable_config(tmp_path):
    pytest.importorskip("torch")
    import yaml
    from dynabatch.actors.spec import load_spec
    from dynabatch.api.cli import _register, app
    from typer.testing import CliRunner

    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({
        "dataset": {"name": "digits", "limit": 200}, "model": {"name": "mlp", "hidden": 8},
        "workers": 2, "epochs": 2, "optimizer": {"lr": 0.05},
        "schedule": {"stages": [{"epochs": 1, "global_batch": 16},
                                {"epochs": 1, "global_batch": 16}]}}))
    _register()
    out, rep = tmp_path / "tuned.yaml", tmp_path / "report.json"
    res = CliRunner().invoke(app, ["tune", str(cfg), "--budget", "3", "--max-batch", "64",
                                   "--probe-epochs", "1", "--out", str(out), "--report",
                                   str(rep), "--quiet", "--seeds", "2", "--warmups", "0,1"])
    assert res.exit_code == 0, res.output
    import json

    report = json.loads(rep.read_text())
    assert 2 <= len(report["probes"]) <= 3 and report["probes_run"] == len(report["probes"])
    assert report["probes"][0]["role"] == "baseline"
    # Two seeds per probe, each judged on the validation split.
    assert all(len(p["accuracy_per_seed"]) == 2 for p in report["probes"])
    assert report["simulations"] == 2 * len(report["probes"])
    assert report["settings"]["holdout"] == 0.2 and report["settings"]["seeds"] == [0, 1]
    tuned = load_spec(out)
    assert [s.epochs for s in tuned.schedule.stages] == [1, 1]
    kept = [p for p in report["probes"] if p["kept"]]
    want = kept[0]["global_batch"] if kept else 16
    assert tuned.schedule.stages[1].global_batch == want
    # A config without stages, or bad warm-ups: one line, exit 2.
    res = CliRunner().invoke(app, ["tune", str(cfg), "--quiet", "--warmups", "1,x"])
    assert res.exit_code == 2 and "--warmups" in res.output
    # The user's text as it is: rich markup once swallowed "[bold]" and "[x]" from it.
    res = CliRunner().invoke(app, ["tune", str(cfg), "--quiet", "--warmups", "1,[bold]x[x]"])
    assert res.exit_code == 2 and "got '1,[bold]x[x]'" in res.output, res.output
    cfg.write_text(yaml.safe_dump({"workers": 2}))
    res = CliRunner().invoke(app, ["tune", str(cfg), "--quiet"])
    assert res.exit_code == 2 and "schedule.stages" in res.output


def test_tune_judges_against_the_small_batch_baseline_on_a_validation_split(monkeypatch):
    pytest.importorskip("torch")
    from dynabatch.api.cli import tuning as tune_mod
    from dynabatch.scheduler.sim.cluster_spec import parse_cluster
    from dynabatch.scheduler.sim.gradients import GradientEngine

    spec = parse_spec({"dataset": {"name": "digits", "limit": 300},
                       "model": {"name": "mlp", "hidden": 8}, "workers": 2, "epochs": 4,
                       "optimizer": {"lr": 0.05},
                       "schedule": {"stages": [{"epochs": 1, "global_batch": 16},
                                               {"epochs": 1, "global_batch": 16},
                                               {"epochs": 2, "global_batch": 16}]}})
    eng = GradientEngine(spec, holdout=0.25)
    assert (eng.n_train, eng.n_test) == (225, 75)  # the validation split is training data
    seen = []
    real = tune_mod._run_until

    def spy(job, cluster, epochs, holdout):
        seen.append((job.seed, [(s.global_batch, s.lr_factor) for s in job.schedule.stages],
                     epochs, holdout))
        res = real(job, cluster, epochs, holdout)
        assert len(res.history) == epochs  # stopped after its window
        return res

    monkeypatch.setattr(tune_mod, "_run_until", spy)
    cluster = parse_cluster({"classes": [{"name": "n", "count": 2, "a_ms": 2,
                                          "c_ms_per_sample": 0.1}]})

    def run(tolerance: float, budget: int):
        seen.clear()
        progress = []
        res = tune_mod.tune(spec, cluster, max_batch=64, tolerance=tolerance, probe_epochs=1,
                            warmups=(0, 1), seeds=2, holdout=0.25, budget=budget,
                            on_probe=lambda p, done, total: progress.append((done, total)))
        # The progress bar: sized to what can run, within the budget, exact at the end.
        assert progress[-1][0] == progress[-1][1] == len(res.probes)
        assert all(done <= total <= budget for done, total in progress)
        assert all(b[1] <= a[1] for a, b in itertools.pairwise(progress))
        return res

    # A tolerance no probe can miss: stage 1 keeps its first candidate, the largest batch
    # with the linear factor and the shortest warm-up; stage 2 has nothing larger to try.
    res = run(tolerance=1.0, budget=10)
    # The baseline trains B_0 in every stage up to the last window (epoch 3) and is read at
    # the end of each stage's window; every probe is two seeds on the validation split.
    assert seen[0][1] == [(16, None)] and seen[0][2] == 3 and seen[0][3] == 0.25
    assert [x[0] for x in seen] == [0, 1, 0, 1] and sorted(res.baseline) == [1, 2]
    assert [(p.role, p.stage, p.global_batch, p.lr_factor, p.warmup_epochs, p.kept)
            for p in res.probes] == [("baseline", 0, 16, 1.0, 0.0, False),
                                     ("candidate", 1, 64, 4.0, 0.0, True)]
    assert seen[2][1] == [(16, 1.0), (64, 4.0)] and seen[2][2] == 2
    assert [(st.global_batch, st.lr_factor) for st in res.spec.schedule.stages] == [
        (16, 1.0), (64, 4.0), (64, 4.0)]
    # A tolerance no probe can meet: candidates in order (B 64 then 32; linear then sqrt;
    # warm-up 0 then 1) until the budget is spent; the stages keep B_0.
    res = run(tolerance=-1.0, budget=4)
    assert res.budget_exhausted and len(res.probes) == 4
    assert [(p.global_batch, p.lr_factor, p.warmup_epochs) for p in res.probes[1:]] == [
        (64, 4.0, 0.0), (64, 4.0, 1.0), (64, 2.0, 0.0)]
    assert [st.global_batch for st in res.spec.schedule.stages] == [16, 16, 16]


def test_schedule_metrics_come_from_the_snapshot():
    from dynabatch.api.metrics import schedule_families
    from dynabatch.scheduler.telemetry import JobSnapshot
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    snap = JobSnapshot(job_id="j1", name="n", state=JobState.RUNNING, global_batch=256,
                       lr=0.4, noise_scale=123.0, goodput_batch=512, isgd_flagged_total=3,
                       isgd_extra_iterations_total=7)

    class _C:
        def collect(self):
            yield from schedule_families([snap])

    reg = CollectorRegistry()
    reg.register(_C())
    got = {s.name: (s.labels, s.value) for f in text_string_to_metric_families(
        generate_latest(reg).decode()) for s in f.samples}
    assert got["dynabatch_job_global_batch"] == ({"job_id": "j1"}, 256)
    assert got["dynabatch_job_learning_rate"][1] == 0.4
    assert got["dynabatch_job_gradient_noise_scale"][1] == 123.0
    assert got["dynabatch_job_goodput_batch"][1] == 512
    assert got["dynabatch_job_isgd_flagged_batches_total"][1] == 3
    assert got["dynabatch_job_isgd_extra_iterations_total"][1] == 7


def test_snapshot_shows_the_schedule_in_force():
    coord, _ = _coord(_spec(schedule=STAGED))
    while coord.epoch < 2:
        assert coord.step()
    coord.step()
    snap = coord.snapshot()
    assert snap.global_batch == 200 and 0.1 < snap.lr <= 0.4

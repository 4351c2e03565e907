"""The schedule machines (pure): stage-wise batch and learning rate, ISGD's control chart,
the goodput estimator; their spec validation; and the coordinator driving them on the fake
runtime (stage boundaries, ISGD repeats, checkpoint resume keeps the schedule's position)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.contracts import IsgdRule
from actors.spec import JobSpec, SpecError, parse_spec
from scheduler.coordinator import Coordinator
from scheduler.goodput import NoiseEstimate, StepTimeModel, choose_batch, efficiency, gain
from scheduler.isgd import ControlChart
from scheduler.schedule import LrRule, Schedule, Stage, scale_factor
from scheduler.state import JobState
from tests.fakes import FakeRuntime

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
    with pytest.raises(ValueError, match="unknown LR schedule"):
        LrRule(1.0, "exponential")
    with pytest.raises(ValueError, match="unknown lr_scaling"):
        scale_factor("cubic", 2.0)


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
        assert c.limit is None and c.rule(5, 0.1, 3) is None
        return
    last = losses[-window:]
    mean = sum(last) / window
    std = math.sqrt(sum((x - mean) ** 2 for x in last) / window)
    assert c.limit == pytest.approx(mean + sigma * std)
    assert c.rule(0, 0.1, 3) is None  # monitoring starts after the first epoch
    assert c.rule(1, 0.1, 3) == IsgdRule(c.limit, 0.1, 3)


def test_control_chart_rejects_a_window_below_two():
    with pytest.raises(ValueError, match="window"):
        ControlChart(1, 3.0)


@settings(deadline=None, max_examples=50)
@given(st.lists(st.floats(0.0, 5.0), min_size=0, max_size=30), st.floats(0.0, 3.0),
       st.integers(1, 10))
def test_isgd_never_runs_more_than_max_extra_iterations(losses, limit, max_extra):
    torch = pytest.importorskip("torch")
    from actors.optim import isgd_extras

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    seen = iter(losses)
    calls = []

    def loss_and_grad() -> float:
        psi = next(seen, 0.0)  # past the list: below any limit
        calls.append(psi)
        w.grad = torch.ones(3)
        return psi

    done = isgd_extras(IsgdRule(limit, 0.1, max_extra), [w], opt, loss_and_grad)
    assert 0 <= done <= max_extra
    # It stepped exactly while the loss stayed above the limit.
    assert all(x > limit for x in calls[:done])
    assert done == max_extra or calls[done] <= limit


def test_isgd_step_is_the_conservative_subproblem_gradient():
    torch = pytest.importorskip("torch")
    from actors.optim import isgd_extras

    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=1.0)
    state = {"n": 0}

    def loss_and_grad() -> float:
        state["n"] += 1
        w.grad = torch.full((4,), 2.0)
        return 3.0  # always above the limit 1.0
    done = isgd_extras(IsgdRule(1.0, 0.4, 2), [w], opt, loss_and_grad)
    # step 1: g = (3-1)·2 + (0.4/4)·(0 - 0) = 4 → w = -4
    # step 2: g = (3-1)·2 + (0.4/4)·(-4 - 0) = 3.6 → w = -7.6
    assert done == 2 and torch.allclose(w.detach(), torch.full((4,), -7.6))


# --- goodput ----------------------------------------------------------------------------
@settings(deadline=None, max_examples=50)
@given(st.floats(0.01, 10.0), st.floats(0.0, 1000.0),
       st.lists(st.integers(1, 512), min_size=2, max_size=8, unique=True))
def test_noise_estimate_recovers_gradient_and_trace_from_unequal_batches(g2, tr, batches):
    # Expected |g_b|² = |∇L|² + tr(Σ)/b: the regression is exact on expected values.
    est = NoiseEstimate().observe([(b, g2 + tr / b) for b in batches])
    assert est.grad_sq == pytest.approx(g2, rel=1e-6, abs=1e-9)
    assert est.trace == pytest.approx(tr, rel=1e-6, abs=1e-6)
    assert est.noise_scale == pytest.approx(tr / g2, rel=1e-5, abs=1e-6)


def test_noise_estimate_needs_two_batch_sizes():
    assert NoiseEstimate().observe([(8, 1.0), (8, 2.0)]).samples == 0


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
    timing = StepTimeModel(overhead=0.05, rate=1000.0)  # per-step overhead: large B pays
    small, _ = choose_batch(16, 2048, 16, 1.0, timing)
    large, _ = choose_batch(16, 2048, 16, 5000.0, timing)
    assert small < large
    assert choose_batch(16, 2048, 16, None, timing) == (16, 0.0)


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


# --- the coordinator driving them ------------------------------------------------------------
N = 1000


def _spec(**kw) -> JobSpec:
    base = dict(workers=3, global_batch=50, epochs=4, policy="dbs", collective_timeout_s=2,
                worker_wait_timeout_s=5, start_timeout_s=5, optimizer={"lr": 0.1})
    base.update(kw)
    return JobSpec.model_validate(base)


def _coord(spec: JobSpec, **kw) -> tuple[Coordinator, FakeRuntime]:
    rt = FakeRuntime(spec, n_train=N, speeds={0: 1000, 1: 500, 2: 250}, **kw)
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
    steps = [sp for plans in rt.plans for sp in next(iter(plans.values())).steps]
    sizes = {(sp.size, round(sp.lr, 6)) for sp in steps}
    # Stage 1 at LR 0.1; stage 2 ramps from 0.1 to 0.4 over one epoch, then holds 0.4.
    assert (50, 0.1) in sizes and (200, 0.4) in sizes
    ramp = [sp.lr for plans in rt.plans for sp in next(iter(plans.values())).steps
            if sp.size == 200]
    assert ramp == sorted(ramp) and 0.1 < ramp[0] < 0.4
    assert hist[-1].lr == pytest.approx(0.4)


@pytest.mark.parametrize("max_extra, extra", [(3, 2), (1, 1)])
def test_isgd_flags_outlier_batches_and_every_worker_repeats_them(max_extra, extra):
    def loss_of(epoch, step):  # flat losses with one spike per epoch
        return 5.0 if step == 4 else 1.0 + 0.01 * (step % 3)

    spec = _spec(isgd={"enabled": True, "window": 5, "sigma": 2.0, "max_extra": max_extra})
    coord, rt = _coord(spec, loss_of=loss_of, isgd_decay=0.5)
    assert coord.run().state == JobState.SUCCEEDED
    hist = coord.history()
    assert hist[0].isgd_flagged == 0  # monitoring starts after the first epoch
    for r in hist[1:]:
        # The spike 5.0 halves to 2.5, 1.25 (above the limit ~1.03) and 0.625: 2 extra
        # iterations, or max_extra.
        assert r.isgd_flagged == 1
        assert r.isgd_extra_iterations == extra
        assert r.grad_evals == N + extra * 50
        assert r.verified and r.samples_trained == N  # repeats are not new samples
    for plans in rt.plans:  # every worker got the same rule
        rules = {tuple(sp.isgd for sp in p.steps) for p in plans.values()}
        assert len(rules) == 1


def test_checkpoint_resume_keeps_the_schedule_position(tmp_path):
    spec = _spec(schedule=STAGED, checkpoint={"dir": str(tmp_path)},
                 isgd={"enabled": True, "window": 4})
    coord, _rt = _coord(spec)
    while coord.epoch < 3:  # into the second stage, then the coordinator is gone
        assert coord.step()
    from scheduler.checkpoint import load_checkpoint

    saved = load_checkpoint(str(tmp_path), "job")["schedule"]
    assert saved["epoch"] == 3 and saved["global_batch"] == 200
    assert len(saved["regime"]["chart"]) == 4
    coord2, rt2 = _coord(spec)
    assert coord2.regime.chart.losses == tuple(saved["regime"]["chart"])
    assert coord2.run().state == JobState.SUCCEEDED
    assert [r.global_batch for r in coord2.history()] == [50, 50, 200, 200]
    first = next(iter(rt2.plans[0].values()))
    assert first.epoch == 3 and first.steps[0].size == 200
    assert first.steps[0].lr == pytest.approx(0.4)


# --- the simulator's real-gradient mode drives the same machines ------------------------------
def test_simulator_trains_stages_isgd_and_goodput_with_real_gradients():
    pytest.importorskip("torch")
    from scheduler.cluster_model import parse_cluster
    from scheduler.simulator import simulate

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
        assert r.isgd_extra_iterations <= 5 * r.isgd_flagged
        assert r.grad_evals >= r.samples_trained + r.isgd_extra_iterations
    spec = parse_spec({**base, "global_batch": 30, "epochs": 2,
                       "schedule": {"mode": "goodput", "max_global_batch": 300}})
    hist = simulate(spec, cluster, real_gradients=True).history
    assert all(r.noise_scale is not None and r.noise_scale > 0 for r in hist)
    assert all(30 <= r.goodput_batch <= 300 for r in hist)
    assert [r.global_batch for r in hist[1:]] == [r.goodput_batch for r in hist[:-1]]


# --- dynabatch tune ------------------------------------------------------------------------
def test_tune_spends_at_most_its_budget_and_writes_a_loadable_config(tmp_path):
    pytest.importorskip("torch")
    import yaml
    from typer.testing import CliRunner

    from actors.spec import load_spec
    from service.cli import _register, app

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
                                   str(rep), "--quiet"])
    assert res.exit_code == 0, res.output
    import json

    report = json.loads(rep.read_text())
    assert 2 <= len(report["probes"]) <= 3
    assert report["probes"][0]["role"] == "baseline"
    tuned = load_spec(out)
    assert [s.epochs for s in tuned.schedule.stages] == [1, 1]
    kept = [p for p in report["probes"] if p["kept"]]
    want = kept[0]["global_batch"] if kept else 16
    assert tuned.schedule.stages[1].global_batch == want
    # A config without stages: one line, exit 2.
    cfg.write_text(yaml.safe_dump({"workers": 2}))
    res = CliRunner().invoke(app, ["tune", str(cfg), "--quiet"])
    assert res.exit_code == 2 and "schedule.stages" in res.output


def test_schedule_metrics_come_from_the_snapshot():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from api.schedule_metrics import schedule_families
    from scheduler.telemetry import JobSnapshot

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

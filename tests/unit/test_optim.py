"""The worker applies what the plan says (one process, a one-rank gloo group): the step's
learning rate, ISGD's chart and extra iterations on a flagged batch (also over micro-batches);
the optimizers of the spec."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dynabatch.actors.contracts import ControlChart, IsgdPlan, SegmentPlan, StepPlan
from dynabatch.actors.optim import build_optimizer
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.worker import Worker


def _spec(**kw) -> JobSpec:
    base = dict(dataset={"name": "synthetic"}, model={"name": "mlp", "hidden": 8}, workers=1,
                global_batch=16, collective_timeout_s=5)
    base.update(kw)
    return JobSpec.model_validate(base)


def _make(**kw) -> Worker:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    w = Worker("w0", 0, _spec(optimizer={"lr": 0.1, "momentum": 0.9, "nesterov": True}, **kw),
               x, y, (4,), 3)
    rv = w.group.open_store(1, 1, "gloo", host="127.0.0.1")
    w.join(rv, 0)
    return w


@pytest.fixture
def worker():
    w = _make()
    yield w
    w.leave()


def _limit(x: float, max_extra: int = 3) -> IsgdPlan:
    """An ISGD plan whose control limit is ``x`` (a full window of equal losses)."""
    return IsgdPlan(ControlChart(2, 1.0, (x, x)), epsilon=0.1, max_extra=max_extra)


def _plan(isgd: IsgdPlan | None = None, steps: int = 1, **kw):
    return SegmentPlan(0, 0, 40, tuple(StepPlan(i, 0, 16, 0, 16, **kw) for i in range(steps)),
                       isgd=isgd)


def test_the_plan_sets_the_learning_rate(worker):
    worker.run_segment(_plan(lr=0.0125))
    assert [g["lr"] for g in worker.optimizer.param_groups] == [0.0125]
    assert worker.optimizer.param_groups[0]["nesterov"]


def test_a_flagged_batch_gets_at_most_max_extra_iterations(worker):
    # A limit below any loss: flagged, and every extra iteration stays above it.
    res = worker.run_segment(_plan(isgd=_limit(-1.0)))
    s = res.steps[0]
    assert res.error is None and s.flagged and s.extra_iters == 3
    assert s.isgd_loss == pytest.approx(s.loss_sum / 16)  # the batch's loss, judged
    assert s.coverage == ((1, 16),)  # the repeats train no new sample
    # A limit above any loss: not flagged, no extra iteration.
    s = worker.run_segment(_plan(isgd=_limit(1e9))).steps[0]
    assert not s.flagged and s.extra_iters == 0


def test_the_worker_keeps_the_chart_through_a_long_segment(worker):
    # One segment of 6 steps on the same batch: its loss falls step by step, and each step
    # is judged against the chart of the steps before it, which the worker keeps itself.
    plan = _plan(isgd=IsgdPlan(ControlChart(2, 0.1), 0.1, 2), steps=6, lr=0.05)
    res = worker.run_segment(plan)
    assert res.error is None and len(res.steps) == 6
    replay = plan.isgd
    for s in res.steps:  # as the coordinator replays it
        rule = replay.rule()
        assert s.flagged == (rule is not None and rule.flagged(s.isgd_loss))
        assert (s.extra_iters > 0) == s.flagged
        replay = replay.after(s.isgd_loss)
    assert not res.steps[0].flagged and not res.steps[1].flagged  # the window fills first


def test_isgd_over_micro_batches_trains_as_one_batch():
    # A share of 16 in micro-batches of 4, flagged: the same updates as in one piece.
    whole, micro = _make(), _make(micro_batch=4)
    try:
        for w in (whole, micro):
            res = w.run_segment(_plan(isgd=_limit(-1.0, max_extra=2), lr=0.05))
            assert res.error is None and res.steps[0].extra_iters == 2
        assert micro.run_segment(_plan()).steps[0].micro_batches == 4
        assert whole.run_segment(_plan()).steps[0].micro_batches == 1
        for a, b in zip(whole.model.parameters(), micro.model.parameters(), strict=True):
            assert torch.allclose(a, b, atol=1e-5)
    finally:
        whole.leave()
        micro.leave()


def test_the_extra_iterations_lower_the_batch_loss(worker):
    # The conservative sub-problem descends the batch's loss while it is above the limit.
    before = worker.run_segment(_plan(lr=0.0)).steps[0].loss_sum
    worker.run_segment(_plan(lr=0.05, isgd=_limit(0.0, max_extra=5)))
    after = worker.run_segment(_plan(lr=0.0)).steps[0].loss_sum
    assert after < before


def test_goodput_norms_are_reported(worker):
    s = worker.run_segment(_plan(noise=True)).steps[0]
    # One worker: its local mean gradient is the global one.
    assert s.local_sqnorm == pytest.approx(s.global_sqnorm, rel=1e-5) and s.global_sqnorm > 0


@pytest.mark.parametrize("name, cls", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam),
                                       ("adamw", torch.optim.AdamW)])
def test_optimizers_of_the_spec(name, cls):
    spec = _spec(optimizer={"name": name, "lr": 0.01, "weight_decay": 0.01})
    opt = build_optimizer(spec, [torch.nn.Parameter(torch.zeros(2))])
    assert type(opt) is cls and opt.param_groups[0]["weight_decay"] == 0.01


# --- optimizers by name and by import path, LR schedulers (issue 33, item 3) -------------


def test_a_torch_optim_class_by_name_takes_the_spec_fields_and_its_options():
    w = _make_with(optimizer={"name": "RMSprop", "lr": 0.1, "momentum": 0.5,
                              "options": {"alpha": 0.95, "centered": True}})
    try:
        opt = w.optimizer
        assert type(opt) is torch.optim.RMSprop
        g = opt.param_groups[0]
        assert (g["alpha"], g["centered"], g["momentum"]) == (0.95, True, 0.5)
        assert w.run_segment(_plan(lr=0.0125)).error is None
        assert g["lr"] == 0.0125  # the plan's rate, every step
    finally:
        w.leave()


def test_an_import_path_optimizer_is_made_from_the_params_and_options():
    w = _make_with(optimizer={"name": "tests.unit.optim_plugins:make",
                              "options": {"decay": 0.9}})
    try:
        assert type(w.optimizer) is torch.optim.RMSprop
        assert w.optimizer.param_groups[0]["alpha"] == 0.9
        assert w.run_segment(_plan(lr=0.02)).error is None
        assert w.optimizer.param_groups[0]["lr"] == 0.02
    finally:
        w.leave()


@pytest.mark.parametrize("optimizer, message", [
    ({"name": "RMSprop", "options": {"betas": [0.9, 0.9]}},
     "optimizer.options.betas: RMSprop has no option 'betas'"),
    ({"name": "Adagrad", "momentum": 0.9}, "optimizer.momentum: Adagrad takes no momentum"),
    ({"name": "RMSprop", "options": {"lr": 0.1}}, "optimizer.options.lr: set optimizer.lr"),
    ({"name": "Rmsprop"}, "optimizer.name: torch.optim has no optimizer 'Rmsprop' (it has: "),
    ({"name": "LBFGS"}, "optimizer.name: LBFGS cannot be used here"),
    ({"name": "RMSprop", "options": {"alpha": -1}}, "optimizer.options: RMSprop refused"),
    ({"lr_scheduler": {"name": "StepLR", "options": {"step": 2}}},
     "optimizer.lr_scheduler.options.step: StepLR has no option 'step'"),
    ({"lr_scheduler": {"name": "ReduceLROnPlateau"}},
     "optimizer.lr_scheduler.name: ReduceLROnPlateau cannot be used here"),
    ({"lr_scheduler": {"name": "Cosine"}},
     "optimizer.lr_scheduler.name: torch.optim.lr_scheduler has no scheduler 'Cosine'"),
])
def test_bad_optimizers_and_schedulers_are_one_line_naming_the_field(optimizer, message):
    from dynabatch.service.submit_policy import check_builtin_options

    problems = check_builtin_options(_spec(optimizer=optimizer))
    assert len(problems) == 1
    line = ": ".join(problems[0])
    assert line.startswith(message) and "\n" not in line, line


def test_a_user_optimizer_that_returns_something_else_names_the_field():
    from dynabatch.actors.workloads import WorkloadError

    spec = _spec(optimizer={"name": "tests.unit.optim_plugins:not_an_optimizer"})
    with pytest.raises(WorkloadError, match=r"^optimizer\.name: .* returned a list, not a "):
        build_optimizer(spec, [torch.nn.Parameter(torch.zeros(2))])


def test_an_import_path_optimizer_is_confined_like_other_user_code():
    from dynabatch.service.submit_policy import check_user_code

    spec = _spec(optimizer={"name": "evil.mod:make"})
    assert [f for f, _ in check_user_code(spec, ())] == ["optimizer.name"]
    assert check_user_code(spec, ("evil",)) == []


def test_the_lr_scheduler_is_stepped_per_epoch_into_the_plan():
    from dynabatch.scheduler.core.regime.regime import Regime
    from dynabatch.scheduler.sync.coordinator import _lr_scheduler_factors

    spec = _spec(epochs=4, optimizer={"lr": 0.2, "lr_scheduler": {
        "name": "StepLR", "options": {"step_size": 2, "gamma": 0.5}}})
    factors, error = _lr_scheduler_factors(spec)
    assert error is None and factors == (1.0, 1.0, 0.5, 0.5)
    sched = Regime(spec, factors).schedule
    # Every step of an epoch at the epoch's rate; the same table for every worker.
    assert [sched.lr_at(e, s, 3) for e in range(4) for s in (0, 2)] == pytest.approx(
        [0.2, 0.2, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1])
    cos = _spec(epochs=3, optimizer={"lr": 0.1, "lr_scheduler": {
        "name": "CosineAnnealingLR", "options": {"T_max": 2}}})
    assert _lr_scheduler_factors(cos)[0] == pytest.approx((1.0, 0.5, 0.0), abs=1e-12)


def test_an_lr_scheduler_with_a_schedule_names_both_fields():
    from dynabatch.actors.spec import SpecError, parse_spec

    with pytest.raises(SpecError) as err:
        parse_spec({"epochs": 4, "optimizer": {"lr_scheduler": {"name": "StepLR", "options": {
            "step_size": 1}}, "schedule": {"name": "cosine"}}})
    assert "optimizer.lr_scheduler: optimizer.lr_scheduler and optimizer.schedule" in str(
        err.value)


def _make_with(**kw) -> Worker:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    w = Worker("w0", 0, _spec(**kw), x, y, (4,), 3)
    w.join(w.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    return w

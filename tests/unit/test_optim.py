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

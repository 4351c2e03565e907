"""The worker applies what the plan says (one process, a one-rank gloo group): the step's
learning rate, and ISGD's extra iterations on a flagged batch; the optimizers of the spec."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.contracts import IsgdRule, SegmentPlan, StepPlan
from actors.optim import build_optimizer
from actors.spec import JobSpec
from actors.worker import Worker


def _spec(**kw) -> JobSpec:
    base = dict(dataset={"name": "synthetic"}, model={"name": "mlp", "hidden": 8}, workers=1,
                global_batch=16, collective_timeout_s=5)
    base.update(kw)
    return JobSpec.model_validate(base)


@pytest.fixture
def worker():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    w = Worker("w0", 0, _spec(optimizer={"lr": 0.1, "momentum": 0.9, "nesterov": True}), x, y,
               (4,), 3)
    rv = w.group.open_store(1, 1, "gloo", host="127.0.0.1")
    w.join(rv, 0)
    yield w
    w.leave()


def _plan(**kw):
    return SegmentPlan(0, 0, 40, (StepPlan(0, 0, 16, 0, 16, **kw),))


def test_the_plan_sets_the_learning_rate(worker):
    worker.run_segment(_plan(lr=0.0125))
    assert [g["lr"] for g in worker.optimizer.param_groups] == [0.0125]
    assert worker.optimizer.param_groups[0]["nesterov"]


def test_a_flagged_batch_gets_at_most_max_extra_iterations(worker):
    # A limit below any loss: flagged, and every extra iteration stays above it.
    res = worker.run_segment(_plan(isgd=IsgdRule(limit=-1.0, epsilon=0.1, max_extra=3)))
    s = res.steps[0]
    assert res.error is None and s.flagged and s.extra_iters == 3
    assert s.coverage == ((1, 16),)  # the repeats train no new sample
    # A limit above any loss: not flagged, no extra iteration.
    s = worker.run_segment(_plan(isgd=IsgdRule(limit=1e9, epsilon=0.1, max_extra=3))).steps[0]
    assert not s.flagged and s.extra_iters == 0


def test_the_extra_iterations_lower_the_batch_loss(worker):
    # The conservative sub-problem descends the batch's loss while it is above the limit.
    before = worker.run_segment(_plan(lr=0.0)).steps[0].loss_sum
    worker.run_segment(_plan(lr=0.05, isgd=IsgdRule(limit=0.0, epsilon=0.1, max_extra=5)))
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

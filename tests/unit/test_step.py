"""The one step math (actors/step.py): the worker and the simulator's real-gradient mode
compute a share's gradient through the same code, and get the same gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dynabatch.actors.contracts import SegmentPlan, StepPlan, epoch_order
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.step import PhaseLog, StepMath, cover, held, share_sqnorm
from dynabatch.actors.worker import Worker
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.scheduler.sim.gradients import GradientEngine

EPOCH, SEED = 0, 0


def _spec(**kw) -> JobSpec:
    return JobSpec.model_validate(dict(
        dataset={"name": "digits", "limit": 96}, model={"name": "mlp", "hidden": 16},
        workers=1, global_batch=32, optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        collective_timeout_s=5, seed=SEED, **kw))


def _spy(monkeypatch) -> list[int]:
    """Counts the shares StepMath computes (both paths must go through it)."""
    calls: list[int] = []
    real = StepMath.share

    def share(self, gather, lo, hi, step_size, cap=None, **kw):
        calls.append(hi - lo)
        return real(self, gather, lo, hi, step_size, cap, **kw)

    monkeypatch.setattr(StepMath, "share", share)
    return calls


@pytest.mark.parametrize("micro_batch", [None, 5])
def test_worker_and_simulator_give_the_same_gradient_for_the_same_share(monkeypatch,
                                                                         micro_batch):
    spec = _spec(micro_batch=micro_batch, allreduce="bucketed", bucket_kb=1)
    ds = load_dataset(spec.dataset, seed=spec.seed)
    n = len(ds.y_train)
    # A share of 13 of the step's 32 samples, not at the step's start: b_i/B weighting.
    sp = StepPlan(step=1, start=32, size=32, own_start=40, own_size=13, noise=True)

    calls = _spy(monkeypatch)
    w = Worker("w0", 0, spec, ds.x_train, ds.y_train, tuple(ds.input_shape), ds.num_classes)
    calls.clear()  # the warm-up's
    w.join(w.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    try:
        res = w.run_segment(SegmentPlan(EPOCH, SEED, n, (sp,)))
    finally:
        w.leave()
    assert res.error is None, res.error
    (tel,) = res.steps
    # One rank: the all-reduced buffer is this share's (b_i/B)·g_i.
    worker_grads = [p.grad.detach().clone() for p in w.params]
    assert calls == [13] and tel.micro_batches == (3 if micro_batch else 1)
    assert tel.coverage == ((0, 8), (1, 13), (0, 11))

    calls.clear()
    eng = GradientEngine(spec)
    out = eng.step(SEED, EPOCH, n, [sp])
    assert calls == [13]  # the same StepMath.share, one micro-batch per share

    for g, p in zip(worker_grads, eng.params, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-6)
    assert out.losses[0] == pytest.approx(tel.loss_sum, rel=1e-6)
    assert out.local_sqnorms[0] == pytest.approx(tel.local_sqnorm, rel=1e-5)
    # Same gradient, same optimizer, same seeded weights: the same update.
    for a, b in zip(w.params, eng.params, strict=True):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=1e-6)


def test_simulated_shares_sum_to_the_one_process_gradient_with_micro_batches():
    spec = _spec()
    eng = GradientEngine(spec)
    n = eng.n_train
    shares = [StepPlan(0, 0, 32, 0, 9), StepPlan(0, 0, 32, 9, 0), StepPlan(0, 0, 32, 9, 23)]
    init = [p.detach().clone() for p in eng.params]
    eng.step(SEED, EPOCH, n, shares, caps=[4, None, 6])
    got = [p.grad.clone() for p in eng.params]

    ref = GradientEngine(spec)
    for p, p0 in zip(ref.params, init, strict=True):
        assert torch.equal(p.detach(), p0)
    order = epoch_order(SEED, EPOCH, n, spec.dataset.shuffle)
    ids = torch.from_numpy(order[:32].astype(np.int64))
    ref.objective.loss_sum(ref.model(ref.x[ids]), ref.y[ids]).div(32).backward()
    for g, p in zip(got, ref.params, strict=True):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=1e-6)


def test_share_weighting_coverage_and_phase_marks():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())

    class Sum:
        @staticmethod
        def loss_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out, y, reduction="none").sum()

    math = StepMath(model, Sum(), params)
    x, y = torch.randn(10, 3), torch.randint(0, 2, (10,))
    clock = iter(range(100))
    log = PhaseLog(lambda: float(next(clock)))
    armed: list[int] = []
    share = math.share(held(x, y), 2, 9, 20, cap=3, arm=lambda: armed.append(len(log.records)),
                       log=log)
    assert share.micro_batches == 3 and armed == [2]  # armed before the last backward only
    assert len(log.records) == 3 and log.breakdown(lambda m: m) == (3.0, 3.0, 3.0)
    want = torch.autograd.grad(Sum.loss_sum(model(x[2:9]), y[2:9]) / 20, params)
    for p, g in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-7)
    with torch.no_grad():
        assert float(share.loss) == pytest.approx(float(Sum.loss_sum(model(x[2:9]), y[2:9])))
    cov = torch.zeros(8)
    cover(cov, StepPlan(0, 10, 8, 13, 4))
    assert cov.tolist() == [0, 0, 0, 1, 1, 1, 1, 0]
    assert share_sqnorm(2.0, 20, 5) == 32.0 and share_sqnorm(2.0, 20, 0) is None

"""``optimizer.clip_grad_norm`` clips the global gradient (issue 33, item 3).

Under the weighted all-reduce every worker holds the global batch's mean gradient after the
reduce, so the norm is the global one, the same in every worker, and every worker applies the
same scale. Checked here against one process that computes the global batch's gradient and
clips it with ``torch.nn.utils.clip_grad_norm_``: three gloo processes with unequal shares
end the step with the same weights (to 1e-6). fp16 clips the unscaled gradient.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch
from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.step import StepMath
from dynabatch.actors.worker import Worker

from tests.gloo import run_members

B = 24  # the step's global batch
SHARES = (5, 12, 7)  # unequal shares of the three members
N = 48
LR = 0.5
CLIP = 0.01  # far below the gradient's norm: clipping is active
TIMEOUT_S = 10


def _spec(**optimizer) -> JobSpec:
    return JobSpec.model_validate(
        dict(
            dataset={"name": "synthetic"},
            model={"name": "mlp", "hidden": 16},
            workers=len(SHARES),
            global_batch=B,
            collective_timeout_s=TIMEOUT_S,
            optimizer={"name": "sgd", "lr": LR, **optimizer},
        )
    )


def _worker(rank: int, **optimizer) -> Worker:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=N)
    return Worker(f"w{rank}", rank, _spec(**optimizer), x, y, (6,), 3)


def _segment(start: int, size: int, lr: float) -> SegmentPlan:
    return SegmentPlan(0, 0, N, (StepPlan(0, 0, B, start, size, lr=lr),))


def _weights(w: Worker) -> np.ndarray:
    return torch.cat([p.detach().flatten() for p in w.params]).numpy().copy()


def _member(rank: int, rv, out: mp.Queue) -> None:
    """One member (a child process): one clipped step of its share; its weights to ``out``."""
    try:
        w = _worker(rank, clip_grad_norm=CLIP)
        w.join(rv, rank)
        res = w.run_segment(_segment(sum(SHARES[:rank]), SHARES[rank], LR))
        w.leave()
        out.put((rank, res.error, _weights(w)))
    except Exception as err:  # reported, so the parent fails with it instead of waiting
        out.put((rank, f"{type(err).__name__}: {err}", None))


def _group() -> dict[int, tuple]:
    return run_members(_member, len(SHARES), timeout_s=TIMEOUT_S)


def _reference() -> tuple[np.ndarray, float]:
    """One process on the whole batch: its gradient (a step at lr 0 leaves the weights),
    clipped by torch, then SGD's step; and the gradient's norm before clipping."""
    w = _worker(0)
    w.join(w.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    try:
        res = w.run_segment(_segment(0, B, 0.0))
    finally:
        w.leave()
    assert res.error is None, res.error
    norm = float(torch.nn.utils.clip_grad_norm_(w.params, CLIP))
    with torch.no_grad():
        for p in w.params:
            p.sub_(LR * p.grad)
    return _weights(w), norm


def test_unequal_shares_clip_the_global_gradient_as_one_process_does():
    got = _group()
    assert sorted(got) == [0, 1, 2], f"members that answered: {sorted(got)}"
    errors = {r: e for r, (e, _w) in got.items() if e}
    assert not errors, errors
    ref, norm = _reference()
    assert norm > 10 * CLIP, "the step must be one where clipping is active"
    for rank, (_e, weights) in got.items():
        np.testing.assert_allclose(weights, ref, rtol=0, atol=1e-6, err_msg=f"rank {rank}")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_update_clips_the_unscaled_gradient(precision):
    # The gradient as the all-reduce leaves it: scale times the global one under fp16.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    params = list(model.parameters())
    ref = [p.detach().clone() for p in params]
    grads = [torch.randn_like(p) for p in params]
    math = StepMath(model, None, params, precision, clip_grad_norm=CLIP)
    scale = math.scaler.scale if math.scaler is not None else 1.0
    for p, g in zip(params, grads, strict=True):
        p.grad = g * scale
    up = math.update(torch.optim.SGD(params, lr=LR), LR, None, None, lambda: 0.0)
    assert not up.overflow
    ref_params = [torch.nn.Parameter(r) for r in ref]
    for p, g in zip(ref_params, grads, strict=True):
        p.grad = g.clone()
    assert float(torch.nn.utils.clip_grad_norm_(ref_params, CLIP)) > CLIP
    for p, r in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p.detach(), r.detach() - LR * r.grad, rtol=0, atol=1e-7)

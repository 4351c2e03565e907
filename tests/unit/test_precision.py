"""Precision (issue 30, item 5): the spec's ``precision``, autocast in the step, and fp16's
loss scale whose found-inf decision every worker of a group takes alike.

bf16 runs on CPU autocast; fp16 too (CPU autocast has float16), which is enough for the
loss scale's arithmetic and its agreement across workers. The agreement is tested in a
two-process gloo group: one member's gradient is made infinite; every member must skip the
step (its weights unchanged) and halve its scale. A worker deciding on its own gradient
would step with the other's infinity: its weights would not stay finite.
"""

from __future__ import annotations

import multiprocessing as mp
import warnings

import numpy as np
import pytest
import torch
from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.actors.precision import LossScaler
from dynabatch.actors.spec import JobSpec, SpecError, parse_spec
from dynabatch.actors.worker import Worker

from tests.gloo import run_members_in_groups

B = 16  # the step's global batch
SHARES = (6, 10)  # the two members' shares
N = 32
TIMEOUT_S = 10


def _spec(**kw) -> JobSpec:
    base = dict(
        dataset={"name": "synthetic"},
        model={"name": "mlp", "hidden": 32},
        workers=len(SHARES),
        global_batch=B,
        optimizer={"name": "sgd", "lr": 0.1},
        collective_timeout_s=TIMEOUT_S,
    )
    base.update(kw)
    return JobSpec.model_validate(base)


def _worker(ordinal: int, **kw) -> Worker:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=N)
    return Worker(f"w{ordinal}", ordinal, _spec(**kw), x, y, (8,), 3)


def _segment(start: int, size: int) -> SegmentPlan:
    return SegmentPlan(0, 0, N, (StepPlan(0, 0, B, start, size),))


def _alone(start: int, size: int, **kw) -> tuple[Worker, np.ndarray]:
    """One step of a share in a one-rank group: its own (b_i/B)-weighted gradient."""
    w = _worker(0, **kw)
    w.join(w.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    try:
        res = w.run_segment(_segment(start, size))
    finally:
        w.leave()
    assert res.error is None, res.error
    return w, w.reducer.flat[: w.reducer.n_params].numpy().copy()


# --- the spec -----------------------------------------------------------------------------


def test_precision_is_a_strict_field_with_a_default():
    assert _spec().precision == "fp32"
    assert _spec(precision="bf16").precision == "bf16"
    with pytest.raises(SpecError) as err:
        parse_spec({"precision": "fp8"})
    text = str(err.value)
    assert text.startswith("precision: ") and "\n" not in text, text


def test_fp16_with_isgd_is_refused_on_one_line():
    with pytest.raises(SpecError) as err:
        parse_spec({"precision": "fp16", "isgd": {"enabled": True}})
    text = str(err.value)
    assert text.startswith("precision: ") and "isgd" in text and "\n" not in text, text


def test_tf32_on_the_cpu_warns_that_it_is_ignored():
    with pytest.warns(UserWarning, match="precision tf32 is ignored on the CPU"):
        parse_spec({"precision": "tf32", "device": "cpu"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_spec({"precision": "bf16", "device": "cpu"})


# --- the step -----------------------------------------------------------------------------


def test_a_bf16_step_matches_fp32_loosely():
    _, ref = _alone(0, B)
    _, got = _alone(0, B, precision="bf16")
    assert got.dtype == np.float32  # the gradient buffer stays fp32
    assert not np.array_equal(got, ref)  # autocast did run
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-2 * np.abs(ref).max())


def test_an_fp16_step_is_unscaled_before_the_update():
    w32, _ = _alone(0, B)
    w16, _ = _alone(0, B, precision="fp16")
    assert w16.math.scaler.scale == 2.0**16 and w16.math.scaler.good_steps == 1
    for a, b in zip(w16.params, w32.params, strict=True):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-2)
    assert w16.state()["loss_scale"] == {"scale": 2.0**16, "good_steps": 1}


def test_the_loss_scale_halves_on_overflow_and_grows_after_an_interval():
    s = LossScaler(scale=8.0, growth_interval=2)
    assert s.overflowed([torch.tensor([1.0, float("inf")])])
    assert s.overflowed([torch.tensor([float("nan")])])
    assert not s.overflowed([torch.tensor([1.0, 2.0])])
    s.update(True)
    assert s.scale == 4.0
    s.update(False)
    s.update(False)
    assert (s.scale, s.good_steps) == (8.0, 0)


# --- the group ----------------------------------------------------------------------------


# The group's configurations, each as (worker options, the rank whose gradient is made
# infinite): bf16's all-reduce, and fp16 with an overflow on one member.
PLANS = (({"precision": "bf16"}, None), ({"precision": "fp16"}, 1))


def _member(rank: int, rv, more: tuple, out: mp.Queue) -> None:
    """One member (a child process): one step of its share under each of :data:`PLANS`,
    each in its own group (``rv``, then ``more``). Reports, per plan, its all-reduced
    gradient, whether it overflowed, its scale and whether its weights stayed as they were
    (or the first error)."""
    reports = []
    try:
        for group, (kw, poisoned) in zip((rv, *more), PLANS, strict=True):
            w = _worker(rank, **kw)
            before = [p.detach().clone() for p in w.params]
            if rank == poisoned:
                w.params[0].register_hook(lambda g: g + float("inf"))
            w.join(group, rank)
            res = w.run_segment(_segment(sum(SHARES[:rank]), SHARES[rank]))
            w.leave()
            grad = w.reducer.flat[: w.reducer.n_params].numpy().copy()
            same = all(torch.equal(a, b) for a, b in zip(before, w.params, strict=True))
            scale = w.math.scaler.scale if w.math.scaler is not None else None
            overflow = res.steps[0].overflow if res.steps else None
            reports.append((res.error, grad, overflow, scale, same))
        out.put((rank, reports))
    except Exception as err:  # reported, so the parent fails with it instead of waiting
        out.put((rank, [*reports, (f"{type(err).__name__}: {err}", None, None, None, None)]))


@pytest.fixture(scope="module")
def groups() -> list[dict[int, tuple]]:
    """Per plan of :data:`PLANS`, each rank's report; one set of member processes runs them
    all (see :func:`tests.gloo.run_members_in_groups`)."""
    got = run_members_in_groups(_member, len(SHARES), len(PLANS), timeout_s=TIMEOUT_S)
    assert sorted(got) == list(range(len(SHARES))), f"members that answered: {sorted(got)}"
    errors = {r: e for r, (reports,) in got.items() for e, *_rest in reports if e}
    assert not errors, errors
    return [{r: reports[i] for r, (reports,) in got.items()} for i in range(len(PLANS))]


def test_bf16_all_reduce_is_the_sum_of_the_members_computed_gradients(groups):
    got = groups[0]
    # Each share's weighted gradient, computed alone as its member computed it.
    parts = [_alone(sum(SHARES[:r]), SHARES[r], precision="bf16")[1] for r in range(2)]
    for rank, (_e, grad, overflow, _s, _same) in got.items():
        assert overflow is False
        np.testing.assert_allclose(
            grad, parts[0] + parts[1], rtol=0, atol=1e-6, err_msg=f"rank {rank}"
        )


def test_fp16_found_inf_is_agreed_every_worker_skips_and_halves_its_scale(groups):
    got = groups[1]
    for rank, (_e, grad, overflow, scale, same) in got.items():
        assert not np.isfinite(grad).all(), f"rank {rank}: the infinity rode the all-reduce"
        assert overflow is True, f"rank {rank} did not see the overflow"
        assert scale == 2.0**15, f"rank {rank}: scale {scale}"
        assert same, f"rank {rank} updated its weights on an overflowed step"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "tf32"])
def test_only_tf32_lets_cuda_matmuls_and_convolutions_use_tf32(precision):
    """cuDNN's convolutions default to TF32 in PyTorch: ``fp32`` must turn that off, or an
    fp32 conv model trains in TF32 (seen on an H200: gradients 2e-4 off the CPU's). The
    flags are process-wide and settable without a GPU, so this runs everywhere."""
    from dynabatch.actors.precision import set_matmul_precision

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = True, True
        set_matmul_precision(precision, torch.device("cuda"))
        want = precision == "tf32"
        assert torch.backends.cuda.matmul.allow_tf32 is want
        assert torch.backends.cudnn.allow_tf32 is want
        # The CPU has no TF32: its flags are left as they were.
        torch.backends.cudnn.allow_tf32 = True
        set_matmul_precision(precision, torch.device("cpu"))
        assert torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

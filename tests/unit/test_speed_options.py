"""The spec's speed options (issue 30, item 5): ``channels_last`` and ``compile``.

Both change how a worker's forward runs, never what its step computes: a worker with them
must give the gradients of a worker without them (to float tolerance). compile must also
keep what the bucketed all-reduce relies on: one graph for every share size (a share
changes whenever the policy re-sizes, so a graph per size would recompile every re-plan)
and backward's post-accumulate-grad hooks launching every bucket of the group's plan.
Compiled with the tracing backend ``aot_eager`` (AOT autograd's forward and backward
graphs, as inductor gets them, without generating kernels), so the test is quick.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.actors.precision import SpeedOptions, channels_last_applies
from dynabatch.actors.spec import JobSpec, SpecError, parse_spec
from dynabatch.actors.worker import Worker, speed_options

from tests.fakes import reduced_steps

N = 64
B = 16
SIZES = (3, 5, 7, 11, 16)  # five share sizes, as five re-plans would give


def _spec(**kw) -> JobSpec:
    base = dict(
        dataset={"name": "synthetic"},
        model={"name": "mlp", "hidden": 32},
        workers=1,
        global_batch=B,
        optimizer={"name": "sgd", "lr": 0.1},
        collective_timeout_s=10,
    )
    base.update(kw)
    return JobSpec.model_validate(base)


def _worker(shape: tuple[int, ...], **kw) -> Worker:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, *shape)).astype(np.float32)
    y = rng.integers(0, 3, size=N)
    return Worker("w0", 0, _spec(**kw), x, y, shape, 3)


def _train(w: Worker, sizes: tuple[int, ...]) -> list[tuple[np.ndarray, int, int]]:
    """One step per size, alone in a one-rank group: after each, the reduced gradient
    (parameter by parameter, each in NCHW order), the collectives launched and how many of
    them went out from backward's hooks."""
    w.join(w.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    reduced = reduced_steps(w.reducer)
    out, start = [], 0
    try:
        for k, size in enumerate(sizes):
            res = w.run_segment(SegmentPlan(0, 0, N, (StepPlan(k, start, size, start, size),)))
            assert res.error is None, res.error
            red = reduced[-1]
            grad = torch.cat([p.grad.contiguous().reshape(-1) for p in w.params])
            out.append((grad.cpu().numpy().copy(), red.buckets, red.early))
            start += size
    finally:
        w.leave()
    return out


# --- the spec -----------------------------------------------------------------------------


def test_the_speed_fields_are_off_by_default_and_strict():
    spec = _spec()
    assert spec.channels_last is False and spec.compile is None
    c = _spec(compile={"mode": "max-autotune"}).compile
    assert (c.mode, c.dynamic, c.backend) == ("max-autotune", True, "inductor")
    with pytest.raises(SpecError, match=r"^compile\.mode: "):
        parse_spec({"compile": {"mode": "fastest"}})


def test_speed_fields_warn_that_the_ps_protocol_ignores_them():
    with pytest.warns(UserWarning, match="channels_last and compile ignored by protocol ps"):
        parse_spec({"channels_last": True, "compile": {}, "protocol": {"name": "ps"}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_spec({"channels_last": True, "compile": {}})


# --- channels_last ------------------------------------------------------------------------


def test_channels_last_applies_to_image_samples_only():
    assert channels_last_applies((3, 16, 16))
    assert not channels_last_applies((8,)) and not channels_last_applies((28, 28))
    assert speed_options(_spec(channels_last=True), (1, 28, 28)).channels_last
    with pytest.warns(UserWarning, match=r"channels_last is ignored: the samples' shape \(8,\)"):
        assert speed_options(_spec(channels_last=True), (8,)) == SpeedOptions()


def test_a_conv_model_trains_in_channels_last_with_the_default_gradients():
    shape = (3, 16, 16)
    ref = _train(_worker(shape, model={"name": "lenet"}), SIZES[:2])
    w = _worker(shape, model={"name": "lenet"}, channels_last=True)
    seen: list[bool] = []
    w.model.register_forward_pre_hook(
        lambda _m, a: seen.append(a[0].is_contiguous(memory_format=torch.channels_last))
    )
    convs = [p for p in w.params if p.dim() == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    with warnings.catch_warnings():  # the gradients keep the weights' layout
        warnings.filterwarnings("error", message=".*gradient layout contract")
        got = _train(w, SIZES[:2])
    assert all(p.grad.stride() == p.stride() for p in w.params)
    assert seen and all(seen)  # every batch reached the model in channels_last
    for (g, _, _), (r, _, _) in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


# --- compile ------------------------------------------------------------------------------


def test_compile_keeps_one_graph_over_share_sizes_and_every_bucket_leaves_from_a_hook():
    from torch._dynamo.utils import counters

    shape = (8,)
    # 1 KiB buckets: the MLP's gradients span several, so the plan has several calls.
    kw = dict(model={"name": "mlp", "hidden": 32}, bucket_kb=1)
    ref = _train(_worker(shape, **kw), SIZES)
    torch._dynamo.reset()
    counters.clear()
    w = _worker(shape, compile={"backend": "aot_eager"}, **kw)
    assert w.reducer.n_buckets > 1
    got = _train(w, SIZES)
    # The warm-up's batch and five share sizes, all above 1: one graph. (Unmarked, torch's
    # automatic dynamic shapes would compile a second one at the first new size.)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for (g, calls, early), (r, ref_calls, _) in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
        assert calls == ref_calls == w.reducer.n_buckets
        assert early == calls  # launched from backward's hooks, none left to finish()


def test_compile_without_dynamic_compiles_a_graph_per_share_size():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    w = _worker((8,), compile={"backend": "eager", "dynamic": False})
    _train(w, SIZES[:3])
    # The warm-up's 8 samples, then three new sizes: each its own graph.
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu_check.py)")
def test_on_a_gpu_a_compiled_channels_last_conv_worker_gives_the_cpu_gradients():
    """The CUDA side: inductor's kernels and cuDNN's channels_last convolutions, against the
    plain CPU worker (TF32 stays off: fp32 tolerance, loosened for the GPU's sums)."""
    from torch._dynamo.utils import counters

    shape = (3, 16, 16)
    ref = _train(_worker(shape, model={"name": "lenet"}), SIZES[:3])
    torch._dynamo.reset()
    counters.clear()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, *shape)).astype(np.float32)
    y = rng.integers(0, 3, size=N)
    spec = _spec(
        model={"name": "lenet"}, channels_last=True, compile={}, device="cuda", worker_gpus=1
    )
    w = Worker("w0", 0, spec, x, y, shape, 3, gpus=1.0)
    assert w.device.type == "cuda"
    got = _train(w, SIZES[:3])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for (g, _, _), (r, _, _) in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-5)

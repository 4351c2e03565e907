"""Structured samples (issue 33, items 1 and 7): dict and tuple inputs from a map-style
dataset, a user's ``dataset.collate`` that pads each share to its own longest, the model
called by name or by position, the worker training, evaluating and halving its micro-batch
on such batches, exact weighting under padding (a property test), and one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dynabatch.actors.batch import rows
from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.actors.data.loader import Loader
from dynabatch.actors.data.mapstyle import MapSource
from dynabatch.actors.data.open import DataRef, materialise, open_dataset
from dynabatch.actors.data.source import DataError, Subset
from dynabatch.actors.precision import SpeedOptions, call_model, prepare_input
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.step import StepMath, held
from dynabatch.actors.worker import Worker
from dynabatch.actors.workloads.objective import objective_for
from dynabatch.service.submit_policy import check_user_code
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit import structured_plugins as P

PLUG = "tests.unit.structured_plugins"


def _spec(dataset: dict, model: str, **kw) -> JobSpec:
    base = dict(
        dataset=dataset,
        model={"name": f"{PLUG}:{model}"},
        workers=1,
        global_batch=16,
        collective_timeout_s=5,
        seed=4,
    )
    base.update(kw)
    return JobSpec.model_validate(base)


# --- the batch and the model call ----------------------------------------------------------


@pytest.mark.parametrize("form", ["dict", "tuple"])
def test_dict_and_tuple_inputs_are_collated_and_the_model_takes_them(form):
    src = MapSource(P.tabular(form=form), "tab")
    assert src.meta.structured and src.meta.num_classes == 3
    x, y = src.read(np.array([5, 0, 7]))
    ds = P.tabular(form=form)
    num = torch.stack([torch.from_numpy(ds.num[i]) for i in (5, 0, 7)])
    cat = torch.tensor([int(ds.cat[i]) for i in (5, 0, 7)])
    if form == "dict":
        assert set(x) == {"num", "cat"}
        torch.testing.assert_close(x["num"], num)
        assert x["cat"].tolist() == cat.tolist()
    else:
        assert isinstance(x, tuple | list) and len(x) == 2
        torch.testing.assert_close(x[0], num)
    assert y.tolist() == [int(ds.y[i]) for i in (5, 0, 7)]
    model = P.TabularModel()
    torch.testing.assert_close(call_model(model, x), model(num, cat))
    # Rows of every tensor: what a micro-batch gets.
    part = rows(x, 1, 3)
    first = part["num"] if form == "dict" else part[0]
    torch.testing.assert_close(first, num[1:3])


def test_a_collate_pads_each_share_to_its_own_longest():
    src = MapSource(P.sequences(), "seq", collate=f"{PLUG}:pad")
    ids = np.array([3, 8, 11])
    x, y = src.read(ids)
    lengths = [len(P.sequences().seqs[i]) for i in ids]
    assert x["input_ids"].shape == (3, max(lengths))
    assert x["attention_mask"].sum(1).tolist() == lengths
    assert y.tolist() == [P.sequences()[int(i)][1] for i in ids]


def test_channels_last_applies_only_to_four_dimensional_inputs():
    x = {"image": torch.zeros(2, 3, 4, 4), "extra": torch.zeros(2, 5)}
    out = prepare_input(x, SpeedOptions(channels_last=True))
    assert out["image"].is_contiguous(memory_format=torch.channels_last)
    assert out["extra"].shape == (2, 5) and out["extra"].is_contiguous()


# --- the worker ------------------------------------------------------------------------


def _worker(spec: JobSpec, generation: int | None) -> Worker:
    """A worker of ``spec`` reading its samples by position, alone in group ``generation``
    (None: not joined yet)."""
    data = open_dataset(spec.dataset, spec.seed)
    w = Worker("w0", 0, spec, data.refs[0], None, data.input_shape, data.num_classes)
    if generation is not None:
        _join(w, generation)
    return w


def _join(w: Worker, generation: int) -> None:
    w.join(w.group.open_store(generation, 1, "gloo", host="127.0.0.1"), 0)


def _steps(n: int, size: int = 16) -> SegmentPlan:
    return SegmentPlan(
        0, 0, 64, tuple(StepPlan(s, s * size, size, s * size, size) for s in range(n))
    )


STRUCTURED = [
    ({"name": f"{PLUG}:tabular", "options": {"n": 80}}, "tabular_model"),
    (
        {"name": f"{PLUG}:sequences", "options": {"n": 80}, "collate": f"{PLUG}:pad"},
        "seq_classifier",
    ),
]


@pytest.mark.parametrize(("dataset", "model"), STRUCTURED)
def test_the_worker_trains_and_evaluates_structured_samples(dataset, model):
    spec = _spec(dataset, model, micro_batch=5)  # 16-sample shares in 4 micro-batches
    w = _worker(spec, 1)
    try:
        before = [p.detach().clone() for p in w.params]
        res = w.run_segment(_steps(3))
        assert res.error is None, res.error
        assert [(s.samples, s.micro_batches) for s in res.steps] == [(16, 4)] * 3
        assert any(not torch.equal(a, b) for a, b in zip(before, w.params, strict=True))
        test = DataRef(spec.dataset, spec.seed, "test")
        n_test = len(test.open())
        out = w.evaluate_shard(test, None, 0, n_test, batch=7)
        sums = out["sums"]
        assert sums["n"] == n_test and np.isfinite(sums["loss"]) and sums["loss"] > 0
        assert 0 <= sums["accuracy"] <= n_test
    finally:
        w.leave()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("dataset", "model"), STRUCTURED)
def test_a_gpu_worker_trains_and_evaluates_structured_samples_as_a_cpu_worker_does(dataset, model):
    """Dicts of tensors and padded sequences moved to the GPU per micro-batch: the same
    losses, weights and evaluation sums as on the CPU (fp32, TF32 off)."""
    specs = {
        dev: _spec(
            dataset,
            model,
            micro_batch=5,
            device=dev,
            precision="fp32",
            **({"worker_gpus": 1} if dev == "cuda" else {}),
        )
        for dev in ("cuda", "cpu")
    }
    # Both built before either trains (a loader's reader seeds torch's global RNG).
    data = open_dataset(specs["cpu"].dataset, specs["cpu"].seed)
    workers = {
        dev: Worker(
            "w0",
            0,
            spec,
            data.refs[0],
            None,
            data.input_shape,
            data.num_classes,
            gpus=1.0 if dev == "cuda" else 0.0,
        )
        for dev, spec in specs.items()
    }
    out = {}
    for g, (dev, w) in enumerate(workers.items(), start=1):
        w.join(w.group.open_store(g, 1, "nccl" if dev == "cuda" else "gloo", host="127.0.0.1"), 0)
        try:
            res = w.run_segment(_steps(3))
            assert res.error is None, res.error
            test = DataRef(specs[dev].dataset, specs[dev].seed, "test")
            sums = w.evaluate_shard(test, None, 0, len(test.open()), batch=7)["sums"]
            out[dev] = ([s.loss_sum for s in res.steps], w.state()["model"], sums)
        finally:
            w.leave()
    assert next(iter(workers["cuda"].params)).is_cuda
    gpu, cpu = out["cuda"], out["cpu"]
    assert gpu[0] == pytest.approx(cpu[0], rel=1e-4)
    for k, v in cpu[1].items():
        torch.testing.assert_close(gpu[1][k], v, atol=1e-5, rtol=1e-4)
    assert gpu[2]["n"] == cpu[2]["n"] and gpu[2]["accuracy"] == cpu[2]["accuracy"]
    assert gpu[2]["loss"] == pytest.approx(cpu[2]["loss"], rel=1e-4)


def test_out_of_memory_halving_slices_dict_batches():
    spec = _spec({"name": f"{PLUG}:tabular", "options": {"n": 80}}, "tabular_model")
    # Both built before either trains: a loader's reader seeds torch's global RNG (one
    # process holds both here), which must not reach the other's initial weights.
    ref, w = _worker(spec, None), _worker(spec, None)
    _join(ref, 1)
    ok = ref.run_segment(_steps(1))
    ref.leave()
    assert ok.error is None, ok.error
    _join(w, 2)

    def hook(_m, _args, kwargs):
        if kwargs["num"].shape[0] > 5:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate")

    w.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        res = w.run_segment(_steps(1))
        assert res.error_kind == "oom" and res.oom_batch == 16
        _join(w, 3)
        plan = _steps(1)
        res = w.run_segment(SegmentPlan(0, 0, 64, plan.steps, micro_cap=4))
        assert res.error is None, res.error
        assert res.steps[0].micro_batches == 4
        for a, b in zip(w.params, ref.params, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    finally:
        w.leave()


def test_reader_processes_send_samples_and_the_share_is_collated_whole():
    spec = _spec(
        {
            "name": f"{PLUG}:sequences",
            "options": {"n": 64, "longest": 30},
            "collate": f"{PLUG}:pad",
        },
        "seq_classifier",
    )
    ref = DataRef(spec.dataset, spec.seed, "train")
    src = ref.open()
    loader = Loader(src, torch.device("cpu"), spec.seed, threads=2, staging=True, opener=ref.open)
    try:
        assert loader._procs is not None and loader.pool is None
        order = np.arange(len(src))[::-1].copy()
        loader.set_order("k", order, 0)
        loader.plan([(0, 12)])
        x1, y1 = loader.gather(0, 6)
        x2, _ = loader.gather(6, 12)
        whole, labels = src.read(order[:12])
        # Both micro-batches are rows of one batch padded to the whole share's longest.
        assert x1["input_ids"].shape[1] == x2["input_ids"].shape[1] == whole["input_ids"].shape[1]
        torch.testing.assert_close(
            torch.cat([x1["input_ids"], x2["input_ids"]]), whole["input_ids"]
        )
        assert y1.tolist() == labels[:6].tolist()
    finally:
        loader.close()


# --- exact weighting under padding -------------------------------------------------------


LM = P.Sequences(n=24, longest=10, task="lm", seed=5)
LM_SPEC = _spec(
    {"name": f"{PLUG}:sequences", "collate": f"{PLUG}:pad"},
    "tiny_lm",
    loss=f"{PLUG}:masked_token_loss",
)


def _math() -> tuple[StepMath, torch.nn.Module]:
    torch.manual_seed(0)
    model = P.TinyLM().double()
    params = list(model.parameters())
    return StepMath(model, objective_for(LM_SPEC, "tokens"), params), model


def _padded_gather(ids: list[int]):
    """The share's samples padded to the share's own longest (what its worker reads)."""
    x, y = P.pad([LM[i] for i in ids])
    return held(x, y)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(1, 24), min_size=1, max_size=6).map(lambda cuts: sorted(set(cuts) | {24})),
    st.integers(1, 8),
)
def test_weighted_shares_padded_differently_sum_to_the_global_gradient(cuts, cap):
    whole, model = _math()
    whole.share(_padded_gather(list(range(24))), 0, 24, 24)
    expected = [p.grad.clone() for p in model.parameters()]
    parts, model2 = _math()
    lo = 0
    for hi in cuts:  # each share padded to its own longest, micro-batched under ``cap``
        parts.share(_padded_gather(list(range(lo, hi))), 0, hi - lo, 24, cap)
        lo = hi
    for a, b in zip(model2.parameters(), expected, strict=True):
        torch.testing.assert_close(a.grad, b, atol=1e-12, rtol=1e-9)


# --- bad input ---------------------------------------------------------------------------


def _error(fn) -> str:
    with pytest.raises(DataError) as err:
        fn()
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_a_collate_that_raises_names_the_samples_and_the_first_line():
    src = MapSource(P.sequences(), "seq", collate=f"{PLUG}:broken_collate")
    msg = _error(lambda: src.read(np.array([5, 9, 2])))
    assert msg.startswith("dataset.collate:") and "samples 5, 9, 2" in msg
    assert "ValueError: cannot pad 3 samples" in msg and "second line" not in msg


def test_a_subset_names_the_datasets_own_indices():
    base = MapSource(P.sequences(), "seq", collate=f"{PLUG}:broken_collate")
    msg = _error(lambda: Subset(base, np.array([10, 20, 30])).read(np.array([2, 0])))
    assert "samples 30, 10" in msg


def test_dict_keys_that_differ_name_both_samples_and_both_key_sets():
    src = MapSource(P.tabular(odd_keys_at=6), "tab")
    msg = _error(lambda: src.read(np.array([4, 6])))
    assert msg == (
        "dataset.name: sample 6's input has keys ['category', 'num'], but "
        "sample 4's has keys ['cat', 'num']"
    )


def test_dict_keys_that_differ_are_a_user_error_that_is_not_retried():
    """The same samples differ on every node: the step's error is the job's own (its
    worker reports error_kind user and the job fails at once, scheduler/core/failures.py)."""
    from dynabatch.actors.errors import is_user_error

    src = MapSource(P.tabular(odd_keys_at=6), "tab")
    with pytest.raises(DataError) as err:
        src.read(np.array([4, 6]))
    assert is_user_error(err.value)


def test_a_sample_that_is_not_input_and_target_says_so():
    src = MapSource(P.sequences(bad_at=3), "seq", collate=f"{PLUG}:pad")
    msg = _error(lambda: src.read(np.array([1, 3])))
    assert msg == "sample 3: __getitem__ returned Tensor; expected (input, target)"


def test_variable_lengths_without_a_collate_say_to_set_one():
    msg = _error(lambda: MapSource(P.sequences(), "seq").read(np.array([0, 1])))
    assert "dataset.collate" in msg


def test_a_collate_must_return_inputs_and_targets_of_one_row_per_sample(monkeypatch):
    monkeypatch.setattr(
        P,
        "odd",
        lambda samples: ({"ids": torch.zeros(1, 3)}, torch.zeros(len(samples))),
        raising=False,
    )
    src = MapSource(P.sequences(), "seq", collate=f"{PLUG}:odd")
    msg = _error(lambda: src.read(np.array([0, 1])))
    assert "inputs['ids'] with 1 rows for 2 samples" in msg
    monkeypatch.setattr(P, "odd", lambda samples: [1, 2, 3])
    msg = _error(
        lambda: MapSource(P.sequences(), "seq", collate=f"{PLUG}:odd").read(np.array([0, 1]))
    )
    assert "returned a list" in msg and "expected (inputs, targets)" in msg


def test_a_collate_is_user_code_and_is_refused_where_user_code_is_not_allowed():
    spec = _spec({"name": f"{PLUG}:sequences", "collate": "other.mod:pad"}, "seq_classifier")
    problems = dict(check_user_code(spec, ["tests"]))
    assert (
        "dataset.collate" in problems
        and "'other.mod:pad' is not allowed" in problems["dataset.collate"]
    )
    assert "dataset.collate" not in dict(check_user_code(spec, ["tests", "other"]))


def test_a_collate_for_data_that_has_no_samples_to_collate_is_refused():
    for name in ("digits", "npy"):
        spec = _spec({"name": name, "path": "/nowhere", "collate": f"{PLUG}:pad"}, "x")
        msg = _error(lambda s=spec: open_dataset(s.dataset))
        assert msg.startswith("dataset.collate:")
    spec = _spec({"name": f"{PLUG}:tabular"}, "tabular_model")
    msg = _error(lambda: materialise(spec.dataset))
    assert msg.startswith("dataset.name:") and "protocol: sync" in msg


# --- Parquet lists of any length ----------------------------------------------------------


def _write_sequences(path, n: int = 100) -> P.Sequences:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ds = P.Sequences(n=n, longest=9, seed=7)
    labels = [ds[i][1] for i in range(n)]
    table = pa.table(
        {
            "ids": pa.array([s.tolist() for s in ds.seqs], pa.list_(pa.int64())),
            "label": pa.array(labels, pa.int64()),
        }
    )
    pq.write_table(table, str(path), row_group_size=16)
    return ds


def test_parquet_lists_of_any_length_are_read_by_position_and_padded_by_the_collate(tmp_path):
    ds = _write_sequences(tmp_path / "seq.parquet")
    spec = _spec(
        {
            "name": "parquet",
            "path": str(tmp_path / "seq.parquet"),
            "options": {"x": "ids", "y": "label"},
            "collate": f"{PLUG}:pad",
        },
        "seq_classifier",
    )
    data = open_dataset(spec.dataset, spec.seed)
    assert data.meta.structured and data.meta.targets == "classes"
    assert data.num_classes == 2
    ids = np.array([17, 3, 40])  # three row groups
    x, y = data.train.read(ids)
    lengths = [len(ds.seqs[i]) for i in ids]
    assert x["input_ids"].shape == (3, max(lengths)) and x["input_ids"].dtype == torch.int64
    assert x["attention_mask"].sum(1).tolist() == lengths
    for j, i in enumerate(ids):
        assert x["input_ids"][j, : lengths[j]].tolist() == ds.seqs[i].tolist()
    assert y.tolist() == [ds[int(i)][1] for i in ids]
    # And a worker trains on them.
    w = _worker(spec, 1)
    try:
        res = w.run_segment(_steps(2))
        assert res.error is None, res.error
    finally:
        w.leave()


def test_parquet_lists_of_any_length_without_a_collate_say_to_set_one(tmp_path):
    _write_sequences(tmp_path / "seq.parquet")
    spec = _spec(
        {
            "name": "parquet",
            "path": str(tmp_path / "seq.parquet"),
            "options": {"x": "ids", "y": "label"},
        },
        "seq_classifier",
    )
    msg = _error(lambda: open_dataset(spec.dataset, spec.seed))
    assert "values, but row 0 has" in msg and "dataset.collate" in msg

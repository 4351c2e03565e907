"""The workload protocol: per-sample losses and metrics, token and regression datasets.

The exactness property behind the weighted all-reduce, for every built-in loss: the shares'
``Σ_i ∇(Σ_{j∈b_i} ℓ_j / B)`` is the one-process gradient of the global batch's mean loss,
whatever the split."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from dynabatch.actors.spec import SpecError, parse_spec
from dynabatch.actors.workloads import WorkloadError, text
from dynabatch.actors.workloads.datasets import DatasetArrays, load_dataset
from dynabatch.actors.workloads.losses import LOSSES
from dynabatch.actors.workloads.models import build_model
from dynabatch.actors.workloads.objective import check_objective, objective_for, targets_kind
from dynabatch.service.submit_policy import SubmitPolicy, check_submission
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.charlm import unigram_perplexity
from tests.fakes import evaluate

P = "tests.unit.workload_plugins"


def _problem(loss: str, b: int = 12):
    g = torch.Generator().manual_seed(0)
    if loss == "next_token":
        model = torch.nn.Sequential(torch.nn.Embedding(7, 5), torch.nn.Linear(5, 7))
        return model, torch.randint(0, 7, (b, 6), generator=g), torch.randint(0, 7, (b, 6),
                                                                              generator=g)
    out = 2 if loss == "mse" else 4
    model = torch.nn.Linear(3, out)
    x = torch.randn(b, 3, generator=g)
    y = torch.randn(b, 2, generator=g) if loss == "mse" else torch.randint(0, 4, (b,),
                                                                            generator=g)
    return model, x, y


@settings(max_examples=25, deadline=None)
@given(loss=st.sampled_from(sorted(LOSSES)),
       cuts=st.lists(st.integers(0, 12), min_size=1, max_size=4))
def test_shares_sum_to_the_one_process_gradient(loss, cuts):
    torch.manual_seed(1)
    model, x, y = _problem(loss)
    fn = LOSSES[loss]
    b = len(y)
    bounds = [0, *sorted(cuts), b]
    total = [torch.zeros_like(p) for p in model.parameters()]
    for lo, hi in itertools.pairwise(bounds):
        if hi == lo:
            continue
        share = fn(model(x[lo:hi]), y[lo:hi]).sum() / b
        for acc, g in zip(total, torch.autograd.grad(share, list(model.parameters())),
                          strict=True):
            acc.add_(g)
    ref = torch.autograd.grad(fn(model(x), y).mean(), list(model.parameters()))
    for a, r in zip(total, ref, strict=True):
        assert torch.allclose(a, r, atol=1e-6)


def test_next_token_is_the_token_cross_entropy_and_perplexity_its_exp():
    logits = torch.randn(3, 5, 7)
    y = torch.randint(0, 7, (3, 5))
    per = LOSSES["next_token"](logits, y)
    assert per.shape == (3,)
    tok = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), y.reshape(-1))
    assert math.isclose(float(per.mean()), float(tok), rel_tol=1e-5)
    spec = parse_spec({"loss": "next_token", "metrics": ["perplexity", "accuracy"]})
    model = torch.nn.Identity()
    obj = objective_for(spec, "tokens")
    scores = evaluate(obj, model, logits.numpy(), y.numpy(), torch.device("cpu"), batch=2)
    assert math.isclose(scores["perplexity"], math.exp(float(tok)), rel_tol=1e-4)
    acc = float((logits.argmax(-1) == y).float().mean())
    assert math.isclose(scores["accuracy"], acc, rel_tol=1e-6)


def test_defaults_follow_the_targets():
    spec = parse_spec({})
    assert objective_for(spec, "classes").loss_name == "cross_entropy"
    lm = objective_for(spec, "tokens")
    assert lm.loss_name == "next_token" and [m.name for _, m in lm.metrics] == [
        "perplexity", "accuracy"]
    assert [m.name for _, m in objective_for(spec, "values").metrics] == ["mse"]


def test_a_loss_of_the_wrong_shape_names_the_field():
    spec = parse_spec({"loss": f"{P}:mean_loss"})
    model = torch.nn.Linear(3, 4)
    x = np.zeros((5, 3), np.float32)
    y = np.zeros(5, np.int64)
    with pytest.raises(WorkloadError) as e:
        check_objective(spec, model, x, y)
    msg = str(e.value)
    assert msg.startswith("loss: ") and "shape ()" in msg and "(2,)" in msg and "\n" not in msg


def test_a_metric_that_does_not_fit_names_its_index():
    spec = parse_spec({"dataset": {"name": f"{P}:regression_loader"}, "loss": f"{P}:abs_loss",
                       "metrics": ["mse", "perplexity"]})
    ds = load_dataset(spec.dataset)
    model = build_model(spec.model, ds.input_shape, ds.num_classes)
    with pytest.raises(WorkloadError, match=r"^metrics\.1: 'perplexity' failed"):
        check_objective(spec, model, ds.x_train, ds.y_train)
    ok = parse_spec({"loss": f"{P}:abs_loss", "metrics": ["mse"]})
    assert check_objective(ok, model, ds.x_train, ds.y_train).loss_name.endswith("abs_loss")


def test_user_metric_is_averaged_per_sample():
    spec = parse_spec({"metrics": ["accuracy", f"{P}:top2_metric"]})
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]])
    scores = evaluate(objective_for(spec, "classes"),
        torch.nn.Identity(), logits.numpy(), np.array([1, 1]), torch.device("cpu"))
    assert scores["accuracy"] == 0.0 and scores["top2_metric"] == 1.0  # its function's name


def test_metrics_are_scored_under_their_names_in_the_spec():
    spec = parse_spec({"metrics": [{"name": "top2", "fn": f"{P}:top2_metric"},
                                   {"name": "acc", "fn": "accuracy"}, "accuracy"]})
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]])
    obj = objective_for(spec, "classes")
    scores = evaluate(obj, torch.nn.Identity(), logits.numpy(), np.array([1, 1]),
                          torch.device("cpu"))
    assert scores == {"loss": pytest.approx(scores["loss"]), "top2": 1.0, "acc": 0.0,
                      "accuracy": 0.0}
    # Errors still say which function failed, at which position.
    assert [(f, m.fn) for f, m in obj.metrics] == [
        ("metrics.0", f"{P}:top2_metric"), ("metrics.1", "accuracy"), ("metrics.2", "accuracy")]


def test_unknown_metric_and_loss_are_field_errors():
    with pytest.raises(SpecError, match=r"^metrics\.0: unknown metric 'f2'"):
        parse_spec({"metrics": ["f2"]})
    with pytest.raises(SpecError, match=r"^loss: unknown loss 'hinge'"):
        parse_spec({"loss": "hinge"})


def test_loss_and_metric_import_paths_are_refused_over_rest_unless_allowed():
    spec = parse_spec({"loss": "evil.mod:fn", "metrics": ["accuracy", "evil.mod:m"]})
    fields = [f for f, _ in check_submission(spec, SubmitPolicy())]
    assert fields == ["loss", "metrics.1"]
    assert check_submission(spec, SubmitPolicy(user_code_modules=("evil",))) == []


def test_token_datasets_check_dtypes_and_ranges():
    with pytest.raises(WorkloadError, match="x_train must hold integer token ids"):
        load_dataset(parse_spec({"dataset": {"name": f"{P}:float_tokens_loader"}}).dataset)
    x = np.array([[0, 1], [2, 3]])
    with pytest.raises(WorkloadError, match=r"token id 3, outside 0\.\.2"):
        DatasetArrays("t", x, x, x, x, 3, targets="tokens")
    ds = DatasetArrays("t", x.astype(np.int32), x, x, x, 4, targets="tokens")
    assert ds.x_train.dtype == np.int64 and targets_kind(ds.y_train) == "tokens"


def test_pysource_is_deterministic_and_the_charlm_predicts_every_position():
    spec = parse_spec({"dataset": {"name": "pysource", "options": {"chars": 5000,
                                                                     "seq_len": 16}},
                       "model": {"name": "charlm", "hidden": 16, "options": {"heads": 2}}})
    a, b = load_dataset(spec.dataset), load_dataset(spec.dataset)
    assert np.array_equal(a.x_train, b.x_train) and a.x_train.shape[1] == 16
    assert np.array_equal(a.x_train[:, 1:], a.y_train[:, :-1])  # y is x shifted by one
    ids = text.encode("def f():\n\treturn 1")  # ids 1.. are the alphabet's characters
    assert "".join(text.ALPHABET[i - 1] for i in ids) == "def f():\n\treturn 1"
    model = build_model(spec.model, a.input_shape, a.num_classes)
    out = model(torch.from_numpy(a.x_train[:2]))
    assert out.shape == (2, 16, text.VOCAB)
    # Causal: changing the last input token leaves every earlier position's logits alone.
    x2 = torch.from_numpy(a.x_train[:1].copy())
    x2[0, -1] = (x2[0, -1] + 1) % text.VOCAB
    out2 = model(x2)
    assert torch.allclose(out[:1, :-1], out2[:, :-1], atol=1e-5)
    assert unigram_perplexity(a.y_train, a.y_test, text.VOCAB) > 1.0

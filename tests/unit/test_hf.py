"""Hugging Face models: ``model.name: hf`` built from its config (never downloaded), a
user's builder returning any transformers model, and the outputs adapter that hands the
loss a ``ModelOutput``'s logits (or what ``model.output`` picks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.actors.spec import JobSpec, SpecError, parse_spec
from dynabatch.actors.workloads import WorkloadError
from dynabatch.actors.workloads.models import build_model, check_model_options
from dynabatch.actors.workloads.objective import check_objective
from dynabatch.service.submit_policy import check_user_code

pytest.importorskip("transformers")
from transformers.utils import ModelOutput

from tests.fakes import evaluate

P = "tests.unit.hf_plugins"
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32}
BERT = {
    "model_type": "bert",
    "num_hidden_layers": 1,
    "hidden_size": 16,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "vocab_size": 40,
    "max_position_embeddings": 16,
}


def _model(config: dict | str | None = None, **options) -> dict:
    return {"name": "hf", "options": {"config": GPT2 if config is None else config, **options}}


def _tokens(n: int, t: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Windows of a fixed random cycle of token ids: y is x shifted by one, so the next
    token is predictable from the current one."""
    cycle = np.random.default_rng(0).permutation(vocab)  # one cycle: seed picks windows
    stream = np.tile(cycle, (n * (t + 1)) // vocab + 2)
    starts = np.random.default_rng(seed + 1).integers(0, vocab, n)
    x = np.stack([stream[s : s + t] for s in starts]).astype(np.int64)
    y = np.stack([stream[s + 1 : s + t + 1] for s in starts]).astype(np.int64)
    return x, y


def test_a_causal_lm_is_built_from_its_config_with_the_datasets_vocabulary():
    spec = parse_spec({"model": _model(), "loss": "next_token"})
    torch.manual_seed(0)
    model = build_model(spec.model, (16,), 50)
    cfg = model.config
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert (cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.use_cache) == (2, 32, 50, False)
    # GPT-2's default special ids (50256) lie outside a 50-token vocabulary: dropped.
    assert cfg.bos_token_id is None and cfg.eos_token_id is None
    torch.manual_seed(0)  # the weights come from torch's RNG: every worker builds the same
    again = build_model(spec.model, (16,), 50)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True)
    )
    x, y = _tokens(4, 16, 50)
    obj = check_objective(spec, model, x, y)
    out = model(torch.from_numpy(x))
    assert isinstance(out, ModelOutput) and out.logits.shape == (4, 16, 50)
    loss = obj.loss_sum(out, torch.from_numpy(y))  # the adapter hands next_token the logits
    assert loss.shape == () and torch.isfinite(loss)
    assert evaluate(obj, model, x, y, torch.device("cpu"))["perplexity"] > 1.0


def test_sequence_classification_gets_cross_entropy_on_its_logits():
    spec = parse_spec({"model": _model(BERT, task="sequence-classification")})
    model = build_model(spec.model, (8,), 3)
    assert type(model).__name__ == "BertForSequenceClassification"
    x = np.random.default_rng(0).integers(0, 40, (4, 8))
    y = np.array([0, 1, 2, 1])
    obj = check_objective(spec, model, x, y)
    assert obj.loss_name == "cross_entropy"
    assert obj.outputs(model(torch.from_numpy(x))).shape == (4, 3)


@pytest.mark.parametrize(
    ("model", "field", "says"),
    [
        (
            {"name": "hf", "options": {"pretrained": "gpt2"}},
            "model.options.pretrained",
            "hub id 'gpt2': nothing is downloaded (a job has no network at run time)",
        ),
        (
            _model("openai-community/gpt2"),
            "model.options.config",
            "'openai-community/gpt2' is a hub id: nothing is downloaded",
        ),
        (_model({"n_layer": 2}), "model.options.config.model_type", "must name the architecture"),
        (
            _model(task="translation"),
            "model.options.task",
            "must be causal-lm or sequence-classification",
        ),
        (_model(revision="main"), "model.options", "unknown option 'revision' for hf"),
        ({"name": "mlp", "output": "not a path"}, "model.output", "is not an import path"),
    ],
)
def test_hub_ids_and_bad_options_are_refused_by_the_spec_naming_the_field(model, field, says):
    with pytest.raises(SpecError) as err:
        parse_spec({"model": model})
    (problem,) = err.value.problems
    assert problem.startswith(f"{field}: ") and says in problem


@pytest.mark.parametrize(
    ("config", "num_classes", "message"),
    [
        (
            {**GPT2, "model_type": "gpt9"},
            50,
            r"^model\.options\.config\.model_type: unknown model type 'gpt9' for transformers \S+; "
            r"close: .*gpt2",
        ),
        (
            {**GPT2, "n_lyer": 2},
            50,
            r"^model\.options\.config\.n_lyer: not a field of GPT2Config \(model_type gpt2\)$",
        ),
        (
            {**GPT2, "vocab_size": 10},
            50,
            r"^model\.options\.config\.vocab_size: 10 is smaller than the dataset's vocabulary",
        ),
        (
            {**GPT2, "n_positions": 8},
            50,
            r"^model\.options\.config\.max_position_embeddings: 8 positions, but the "
            r"samples are 16",
        ),
        ({**GPT2, "n_embd": 30, "n_head": 4}, 50, r"^model\.options\.config: "),
        (
            {"model_type": "vit"},
            50,
            r"^model\.options\.task: transformers has no causal-lm model "
            r"for model_type 'vit'$",
        ),
    ],
)
def test_a_bad_config_is_one_line_naming_its_key(config, num_classes, message):
    spec = parse_spec({"model": _model(config)})
    with pytest.raises(WorkloadError, match=message) as err:
        build_model(spec.model, (16,), num_classes)
    assert "\n" not in str(err.value)


def test_the_config_keys_are_checked_before_anything_is_built():
    check_model_options(parse_spec({"model": _model()}).model)
    with pytest.raises(WorkloadError, match=r"^model\.options\.config\.n_lyer: "):
        check_model_options(parse_spec({"model": _model({**GPT2, "n_lyer": 2})}).model)
    # Aliases are fields too (GPT-2's hidden_size is n_embd).
    check_model_options(
        parse_spec({"model": _model({"model_type": "gpt2", "hidden_size": 32})}).model
    )


def test_a_user_builder_may_return_any_transformers_model_and_output_picks_the_tensor():
    x, y = _tokens(4, 8, 20)
    spec = parse_spec({"model": {"name": f"{P}:tiny_gpt2"}, "loss": "next_token"})
    model = build_model(spec.model, (8,), 20)
    obj = check_objective(spec, model, x, y)  # the ModelOutput's logits, by default
    assert obj.outputs(model(torch.from_numpy(x))).shape == (4, 8, 20)
    # model.output picks another tensor: the last position's logits, for a class loss.
    last = parse_spec(
        {
            "model": {"name": f"{P}:tiny_gpt2", "output": f"{P}:last_position"},
            "loss": "cross_entropy",
            "metrics": ["accuracy"],
        }
    )
    obj = check_objective(last, model, x, y[:, -1])
    assert obj.outputs(model(torch.from_numpy(x))).shape == (4, 20)


def test_an_output_that_is_not_a_tensor_is_one_line_naming_model_output():
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    y = np.array([0, 1, 2, 0])
    tuple_spec = {"model": {"name": f"{P}:tuple_net"}}
    model = build_model(parse_spec(tuple_spec).model, (5,), 3)
    with pytest.raises(
        WorkloadError,
        match=r"^model\.output: the model returned a tuple, not a tensor, and loss "
        r"'cross_entropy' needs one: name the tensor the loss gets with model\.output",
    ):
        check_objective(parse_spec(tuple_spec), model, x, y)
    # A user's loss (and metric) may take the tuple itself, as before the adapter existed.
    own = parse_spec({**tuple_spec, "loss": f"{P}:tuple_ce", "metrics": [f"{P}:tuple_ce"]})
    check_objective(own, model, x, y)
    ok = parse_spec({"model": {**tuple_spec["model"], "output": f"{P}:first"}})
    assert check_objective(ok, model, x, y).outputs(model(torch.from_numpy(x))).shape == (4, 3)
    for fn, message in [
        ("not_a_tensor", r"returned a list, not a tensor$"),
        ("raises", r"raised KeyError: 'pooler_output'$"),
        ("missing", r"has no attribute 'missing'"),
    ]:
        bad = parse_spec({"model": {**tuple_spec["model"], "output": f"{P}:{fn}"}})
        with pytest.raises(WorkloadError, match=r"^model\.output: .*" + message):
            check_objective(bad, model, x, y)


def test_model_output_is_confined_like_other_import_paths_and_not_for_ps():
    spec = parse_spec({"model": {"name": "mlp", "output": f"{P}:first"}})
    (problem,) = check_user_code(spec, ())
    assert problem[0] == "model.output" and f"{P}:first" in problem[1]
    assert check_user_code(spec, ["tests.unit"]) == []
    with pytest.raises(SpecError) as err:
        parse_spec({"model": _model(), "protocol": {"name": "ps"}, "workers": 2})
    assert any(
        p.startswith("model.name: protocol ps trains models that return a tensor")
        for p in err.value.problems
    )


def test_a_tiny_gpt2_trains_through_the_local_worker_and_its_loss_falls():
    """A 2-layer GPT-2 from config, trained by the worker (one rank, gloo) as a job's
    worker trains it: the held-out loss and perplexity fall."""
    from dynabatch.actors.worker import Worker

    vocab, t, n = 24, 12, 64
    spec = JobSpec.model_validate(
        dict(
            dataset={"name": "synthetic"},
            model=_model({**GPT2, "n_positions": t}),
            loss="next_token",
            metrics=["perplexity"],
            optimizer={"name": "adam", "lr": 0.01},
            workers=1,
            global_batch=16,
            collective_timeout_s=5,
        )
    )
    x, y = _tokens(n, t, vocab)
    xt, yt = _tokens(32, t, vocab, seed=5)
    w = Worker("w0", 0, spec, x, y, (t,), vocab)
    w.join(w.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    try:
        before = evaluate(w.objective, w.model, xt, yt, w.device)
        for epoch in range(6):
            steps = tuple(StepPlan(s, s * 16, 16, s * 16, 16) for s in range(n // 16))
            res = w.run_segment(SegmentPlan(epoch, 0, n, steps))
            assert res.error is None, res.error
        after = evaluate(w.objective, w.model, xt, yt, w.device)
    finally:
        w.leave()
    assert after["loss"] < 0.5 * before["loss"], (before, after)
    assert after["perplexity"] < before["perplexity"] / 2


def _classifier(vocab: int = 40):
    spec = parse_spec({"model": _model({**BERT, "vocab_size": vocab},
                                       task="sequence-classification")})
    torch.manual_seed(0)
    return spec, build_model(spec.model, (8,), 3)


TOO_LARGE = ("model.options.config.vocab_size: token id 57 in the batch's input_ids is at or "
             "above the model's vocab_size 40 (its ids are 0..39): set vocab_size to at least "
             "58, or use the tokenizer the model was made for")


def test_a_token_id_beyond_the_vocabulary_is_named_before_the_embedding_lookup():
    """The first step's (or the load-time check's) batch: the largest id, the vocab_size and
    the field, as one line, and a user error (not retried), not an IndexError."""
    from dynabatch.actors.errors import is_user_error

    spec, model = _classifier()
    x = np.random.default_rng(0).integers(0, 40, (4, 8))
    x[1, 3] = 57
    with pytest.raises(WorkloadError) as err:
        check_objective(spec, model, x, np.array([0, 1, 2, 1]))
    assert str(err.value) == TOO_LARGE and is_user_error(err.value)
    # A dict batch (input_ids, attention_mask) is checked the same way.
    ids = torch.from_numpy(x)
    with pytest.raises(WorkloadError, match="token id 57 in the batch's input_ids"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    with pytest.raises(WorkloadError, match="token id -1 in the batch's input_ids is negative"):
        model(torch.full((2, 8), -1))


def test_a_token_id_beyond_the_vocabulary_fails_the_workers_step_as_a_user_error():
    """The worker reports it as error_kind user, so the driver fails the job at once."""
    from dynabatch.actors.worker import Worker

    spec = JobSpec.model_validate(dict(
        dataset={"name": "synthetic"}, model=_model({**BERT}, task="sequence-classification"),
        workers=1, global_batch=8, collective_timeout_s=5))
    x = np.random.default_rng(0).integers(0, 40, (16, 8))
    x[11, 0] = 57
    y = np.arange(16) % 3
    w = Worker("w0", 0, spec, x, y, (8,), 3)
    w.join(w.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    try:
        steps = tuple(StepPlan(s, s * 8, 8, s * 8, 8) for s in range(2))
        res = w.run_segment(SegmentPlan(0, 0, 16, steps))
    finally:
        w.leave()
    assert res.error_kind == "user"
    assert "token id 57 in the batch's input_ids" in res.error and "vocab_size 40" in res.error


def test_a_job_whose_data_has_ids_beyond_the_vocabulary_fails_at_load_naming_them():
    """What the driver loads before any worker trains (the objective's check on the first
    samples): a WorkloadError naming the id, the vocab_size and the field, which fails the
    job with that line; it was ``internal error: IndexError: index out of range in self``."""
    from dynabatch.scheduler.runtime.ray_runtime import open_checked

    spec = parse_spec({"dataset": {"name": f"{P}:token_classes", "options": {"vocab": 60}},
                       "model": _model(BERT, task="sequence-classification"),
                       "global_batch": 16})
    with pytest.raises(WorkloadError) as err:
        open_checked(spec)
    assert str(err.value).startswith("model.options.config.vocab_size: token id 59 in the "
                                     "batch's input_ids is at or above the model's "
                                     "vocab_size 40")

"""``hf``: a Hugging Face ``transformers`` model built from its config, never downloaded.

``model: {name: hf, options: {config: {model_type: gpt2, n_layer: 2, ...}, task: causal-lm}}``
builds ``AutoModelForCausalLM.from_config(config)`` (``sequence-classification``:
``AutoModelForSequenceClassification``) from the config class of ``model_type``, as
``AutoConfig.for_model(model_type, **config)`` makes it. The weights are drawn
from torch's global RNG, like the other built-ins, so every worker seeded alike starts from
the same ones. A hub id is refused at spec validation
(:func:`dynabatch.actors.spec.sections.hf_option_problems`): a job has no network at run
time, and nothing is ever downloaded.

What the service fills in, unless the config sets it: ``vocab_size`` (causal-lm) or
``num_labels`` (sequence-classification) from the dataset's ``num_classes``; ``use_cache:
false`` (training has no use for the key/value cache the forward would return); special
token ids the config defaults to outside the vocabulary (GPT-2's 50256 for a small one) are
dropped. The model returns a ``ModelOutput``; the loss gets its ``logits``
(:func:`dynabatch.actors.workloads.objective.model_outputs`).

transformers is imported here only when an ``hf`` model is checked or built: it is an
optional extra (``pip install dynabatch[hf]``) and takes seconds to import.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from dynabatch.actors.spec import ModelSpec
from dynabatch.actors.spec.sections import HF_TASKS, hf_option_problems
from dynabatch.actors.workloads import WorkloadError
from dynabatch.actors.workloads.imports import one_line

# The Auto class of each task.
AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
}
# Special token ids that a config's defaults may put outside a small vocabulary.
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
FIELD = "model.options.config"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise WorkloadError(
            f"model.name: hf needs the transformers package (pip install 'dynabatch[hf]'): "
            f"{one_line(str(err))}"
        ) from err
    return transformers


def _task(spec: ModelSpec) -> str:
    return spec.options.get("task", HF_TASKS[0])


def _config_class(spec: ModelSpec) -> tuple[type, dict[str, Any]]:
    """The config class of ``model_type`` and the other config keys, each checked to be a
    field of that class; shape problems (a hub id among them) come first."""
    problems = hf_option_problems(spec.options)
    if problems:
        field, problem = problems[0]
        raise WorkloadError(f"{field}: {problem}")
    mapping = _transformers().CONFIG_MAPPING
    config = dict(spec.options["config"])
    model_type = config.pop("model_type")
    if model_type not in mapping:
        near = difflib.get_close_matches(model_type, list(mapping), n=4)
        hint = f"; close: {', '.join(near)}" if near else "; e.g. gpt2, bert, llama"
        raise WorkloadError(
            f"{FIELD}.model_type: unknown model type {model_type!r} for "
            f"transformers {_transformers().__version__}{hint}"
        )
    cls = mapping[model_type]
    known = _config_fields(cls)
    for key in config:
        if key not in known:
            raise WorkloadError(
                f"{FIELD}.{key}: not a field of {cls.__name__} (model_type {model_type})"
            )
    return cls, config


def _config_fields(cls: type) -> set[str]:
    """Every name a config class takes: its serialized fields, their aliases
    (``hidden_size`` for GPT-2's ``n_embd``) and its constructor's parameters."""
    names = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))
    for klass in cls.__mro__:
        try:
            params = inspect.signature(klass.__init__).parameters
        except (TypeError, ValueError):
            continue
        names |= {
            p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
    names |= {"num_labels", "attn_implementation"}
    return names - {"self", "kwargs"}


def check_hf_options(spec: ModelSpec) -> None:
    """``model.options`` of an ``hf`` model, without building it: the shape, the model type
    and every config key (WorkloadError naming ``model.options.config.<key>``)."""
    _config_class(spec)


def build_hf(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """The ``transformers`` model of ``spec.options`` for token sequences of
    ``input_shape`` (one dimension: the sequence length) and ``num_classes`` (the
    vocabulary for causal-lm, the labels for sequence-classification)."""
    cls, config = _config_class(spec)
    task = _task(spec)
    if len(input_shape) != 1:
        raise WorkloadError(
            f"model.name: hf needs token sequences (N, T), got samples of shape {input_shape}"
        )
    size_key = "vocab_size" if task == "causal-lm" else "num_labels"
    given = config.setdefault(size_key, num_classes)
    if task == "causal-lm" and isinstance(given, int) and given < num_classes:
        raise WorkloadError(
            f"{FIELD}.vocab_size: {given} is smaller than the dataset's "
            f"vocabulary ({num_classes} token ids)"
        )
    if task == "sequence-classification" and given != num_classes:
        raise WorkloadError(
            f"{FIELD}.num_labels: {given!r}, but the dataset has {num_classes} classes"
        )
    config.setdefault("use_cache", False)
    # Defaults outside the vocabulary are dropped before the config is made (it warns of
    # them, in every worker's log); ids the config sets are the user's.
    defaults = cls()
    vocab = config.get("vocab_size", getattr(defaults, "vocab_size", None))
    for key in SPECIAL_TOKENS:
        value = getattr(defaults, key, None)
        if (
            key not in config
            and isinstance(value, int)
            and isinstance(vocab, int)
            and not 0 <= value < vocab
        ):
            config[key] = None
    try:
        cfg = cls(**config)
    except Exception as err:
        raise WorkloadError(
            f"{FIELD}: {cls.__name__} refused it ({type(err).__name__}: {one_line(str(err))})"
        ) from err
    longest = getattr(cfg, "max_position_embeddings", None)
    if isinstance(longest, int) and input_shape[0] > longest:
        raise WorkloadError(
            f"{FIELD}.max_position_embeddings: {longest} positions, but the "
            f"samples are {input_shape[0]} tokens long"
        )
    auto = getattr(_transformers(), AUTO_CLASSES[task])
    if type(cfg) not in auto._model_mapping:
        raise WorkloadError(
            f"model.options.task: transformers has no {task} model for "
            f"model_type {cfg.model_type!r}"
        )
    try:
        return auto.from_config(cfg)
    except Exception as err:
        raise WorkloadError(
            f"{FIELD}: building the {cfg.model_type} model failed "
            f"({type(err).__name__}: {one_line(str(err))})"
        ) from err

"""``hf``: a Hugging Face ``transformers`` model built from its config, never downloaded
(a hub id is refused at spec validation: a job has no network at run time). What the
service fills in and the errors it gives: docs/spec.md ("Hugging Face models").

transformers is imported here only when an ``hf`` model is checked or built: it is an
optional extra (``pip install dynabatch[hf]``) and takes seconds to import.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

from dynabatch.actors.errors import UserError, one_line
from dynabatch.actors.spec import ModelSpec
from dynabatch.actors.spec.sections import HF_TASKS, hf_option_problems
from dynabatch.actors.workloads import WorkloadError
from dynabatch.actors.workloads.imports import describe

# The Auto class of each task.
AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
}
# Special token ids that a config's defaults may put outside a small vocabulary.
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
FIELD = "model.options.config"


class TokenIdError(WorkloadError, UserError):
    """A token id at or above the model's ``vocab_size`` (or below 0): an error in the
    job's data or model, the same on every node, so the job fails at once naming it."""


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
    _problems(spec)
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
    and every config key (WorkloadError naming ``model.options.config.<key>``), or the
    pretrained folder's kind."""
    if "pretrained" in spec.options:
        _problems(spec)
        pretrained_kind(spec.options["pretrained"])
    else:
        _config_class(spec)


def _problems(spec: ModelSpec) -> None:
    problems = hf_option_problems(spec.options)
    if problems:
        field, problem = problems[0]
        raise WorkloadError(f"{field}: {problem}")


PRETRAINED = "model.options.pretrained"


def pretrained_kind(folder: str) -> str:
    """``hf`` for a ``save_pretrained`` folder (``config.json``), ``dynabatch`` for a
    dynabatch model directory (``manifest.json``); a WorkloadError naming
    ``model.options.pretrained`` otherwise."""
    from pathlib import Path

    from dynabatch.actors.export import MANIFEST

    path = Path(folder)
    if not path.is_dir():
        raise WorkloadError(f"{PRETRAINED}: {folder} is not a directory")
    if (path / "config.json").is_file():
        return "hf"
    if (path / MANIFEST).is_file():
        return "dynabatch"
    raise WorkloadError(f"{PRETRAINED}: {folder} holds neither config.json (a save_pretrained "
                        f"folder) nor {MANIFEST} (a dynabatch model directory)")


def pretrained_config(folder: str) -> tuple[dict[str, Any], str | None]:
    """The transformers config of a pretrained folder, as a dict: its ``config.json``, or
    the one a dynabatch model directory's manifest recorded (``hf_config``, with its model
    class, ``hf_class``; None for a ``save_pretrained`` folder)."""
    import json
    from pathlib import Path

    from dynabatch.actors.export import MANIFEST

    kind = pretrained_kind(folder)
    name = "config.json" if kind == "hf" else MANIFEST
    try:
        data = json.loads((Path(folder) / name).read_text())
    except (OSError, ValueError) as err:
        raise WorkloadError(f"{PRETRAINED}: {folder}/{name}: cannot read it ({err})") from None
    config = data if kind == "hf" else data.get("hf_config")
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise WorkloadError(f"{PRETRAINED}: {folder}/{name}: holds no transformers config "
                            "with a model_type")
    return config, None if kind == "hf" else str(data.get("hf_class"))


def _from_pretrained(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """The pretrained folder's model for this job's task and data: a ``save_pretrained``
    folder through ``AutoModelFor<task>.from_pretrained`` (local files only), a dynabatch
    model directory through :func:`dynabatch.actors.export.load_model`. A
    sequence-classification head of another size is made anew for the dataset's classes."""
    folder = spec.options["pretrained"]
    task = _task(spec)
    transformers = _transformers()
    auto = getattr(transformers, AUTO_CLASSES[task])
    kind = pretrained_kind(folder)
    extra: dict[str, Any] = {"use_cache": False}
    if task == "sequence-classification":
        extra.update(num_labels=num_classes, ignore_mismatched_sizes=True)
    try:
        if kind == "hf":
            model = auto.from_pretrained(folder, local_files_only=True, **extra)
        else:
            from dynabatch.actors.export import load_model

            model = load_model(folder).train()
    except WorkloadError:
        raise
    except Exception as err:
        raise WorkloadError(f"{PRETRAINED}: {folder}: cannot load it "
                            f"({describe(err)})") from err
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise WorkloadError(f"{PRETRAINED}: {folder}: not a transformers model")
    _check_fits(cfg, task, input_shape, num_classes, lambda k, v: f"{PRETRAINED}: its "
                f"config's {k} {v}")
    cfg.use_cache = False
    return guard_token_ids(model, f"{PRETRAINED} (its config's vocab_size)")


def _check_fits(cfg: Any, task: str, input_shape: tuple[int, ...], num_classes: int,
                name: Callable[[str, object], str]) -> None:
    """A WorkloadError where the model's config does not fit the dataset: a vocabulary
    smaller than its token ids, other labels than its classes, fewer positions than a
    sample's tokens. ``name(key, value)`` names the config value at fault."""
    vocab = getattr(cfg, "vocab_size", None)
    longest = getattr(cfg, "max_position_embeddings", None)
    if task == "causal-lm" and isinstance(vocab, int) and vocab < num_classes:
        raise WorkloadError(f"{name('vocab_size', vocab)} is smaller than the dataset's "
                            f"vocabulary ({num_classes} token ids)")
    if task == "sequence-classification" and cfg.num_labels != num_classes:
        raise WorkloadError(f"{name('num_labels', cfg.num_labels)}, but the dataset has "
                            f"{num_classes} classes")
    if isinstance(longest, int) and input_shape[0] > longest:
        raise WorkloadError(f"{name('max_position_embeddings', longest)} positions, but the "
                            f"samples are {input_shape[0]} tokens long")


def build_hf(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """The ``transformers`` model of ``spec.options`` for token sequences of
    ``input_shape`` (one dimension: the sequence length) and ``num_classes`` (the
    vocabulary for causal-lm, the labels for sequence-classification)."""
    if len(input_shape) != 1:
        raise WorkloadError(
            f"model.name: hf needs token sequences (N, T), got samples of shape {input_shape}"
        )
    if "pretrained" in spec.options:
        _problems(spec)
        return _from_pretrained(spec, input_shape, num_classes)
    cls, config = _config_class(spec)
    task = _task(spec)
    size_key = "vocab_size" if task == "causal-lm" else "num_labels"
    config.setdefault(size_key, num_classes)
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
            f"{FIELD}: {cls.__name__} refused it ({describe(err)})"
        ) from err
    _check_fits(cfg, task, input_shape, num_classes, lambda k, v: f"{FIELD}.{k}: {v}")
    auto = getattr(_transformers(), AUTO_CLASSES[task])
    if type(cfg) not in auto._model_mapping:
        raise WorkloadError(
            f"model.options.task: transformers has no {task} model for "
            f"model_type {cfg.model_type!r}"
        )
    try:
        return guard_token_ids(auto.from_config(cfg), f"{FIELD}.vocab_size")
    except Exception as err:
        raise WorkloadError(
            f"{FIELD}: building the {cfg.model_type} model failed "
            f"({describe(err)})"
        ) from err


# --------------------------------------------------------------------- token id checks

def guard_token_ids(model: Any, field: str) -> Any:
    """Check every batch's ``input_ids`` before the model's embedding looks them up: an id
    outside the embedding is a :class:`TokenIdError` naming the largest (or a negative)
    id, the ``vocab_size`` and ``field``, not torch's ``IndexError: index out of range in
    self`` (on a GPU, a device-side assert that ends the process). A forward pre-hook, kept
    out of ``torch.compile``'s graph; on a GPU it costs one small synchronisation a
    forward. Ids that arrive as floats (a Parquet integer column read for class targets is
    float32, as any model input is) are cast to int64 when every value is a whole number
    (float32 holds each id below 2**24 exactly), else a :class:`TokenIdError` names the
    value. Returns ``model``."""
    import torch

    embedding = model.get_input_embeddings()
    vocab = getattr(embedding, "num_embeddings", None)
    if not isinstance(vocab, int):
        return model

    @torch.compiler.disable
    def check(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or not ids.numel():
            return None
        cast = ids.is_floating_point()
        if cast:
            wrong = ids[ids != ids.trunc()]
            if wrong.numel():
                raise TokenIdError(f"input_ids: the batch holds {float(wrong[0]):g}, not a "
                                   "token id (a whole number): an hf model's input is token "
                                   "ids")
            ids = ids.long()
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0:
            raise TokenIdError(f"{field}: token id {lo} in the batch's input_ids is negative "
                               f"(the model's ids are 0..{vocab - 1}): padding belongs in "
                               "attention_mask, not in input_ids")
        if hi >= vocab:
            raise TokenIdError(f"{field}: token id {hi} in the batch's input_ids is at or "
                               f"above the model's vocab_size {vocab} (its ids are "
                               f"0..{vocab - 1}): set vocab_size to at least {hi + 1}, or use "
                               "the tokenizer the model was made for")
        if not cast:
            return None
        if "input_ids" in kwargs:
            return args, {**kwargs, "input_ids": ids}
        return (ids, *args[1:]), kwargs

    model.register_forward_pre_hook(check, with_kwargs=True)
    return model


def check_tokenizer(spec: Any) -> None:
    """``dataset.tokenizer`` (a ``tokenizers`` tokenizer.json) against an ``hf`` model's
    ``vocab_size`` (its config's, or the pretrained folder's config.json): a tokenizer with
    more tokens than the model's embedding is one line naming the field. Nothing when the
    spec names no tokenizer."""
    path = spec.dataset.tokenizer
    if path is None:
        return
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise WorkloadError(f"dataset.tokenizer: needs the tokenizers package "
                            f"({one_line(str(err))})") from err
    try:
        size = Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    except Exception as err:
        raise WorkloadError(f"dataset.tokenizer: {path}: not a tokenizers tokenizer.json "
                            f"({describe(err)})") from err
    if spec.model.name != "hf":
        return
    options = spec.model.options
    if "pretrained" in options:
        vocab = pretrained_config(options["pretrained"])[0].get("vocab_size")
        source = f"{PRETRAINED}'s config.json"
    else:
        config = options.get("config") if isinstance(options.get("config"), dict) else {}
        vocab = config.get("vocab_size", spec.dataset.num_classes)
        source = f"{FIELD}.vocab_size"
    if isinstance(vocab, int) and size > vocab:
        raise WorkloadError(f"dataset.tokenizer: {path} has {size} tokens, more than the "
                            f"model's vocab_size {vocab} ({source})")


def hf_model_config(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int
                    ) -> tuple[dict[str, Any], str]:
    """The transformers config (a dict) and model class of the model :func:`build_hf`
    builds, without its weights: what an export records so that transformers alone
    rebuilds it."""
    import torch

    if "pretrained" not in spec.options:
        with torch.device("meta"):  # only the config is wanted: no weights are made
            built = build_hf(spec, input_shape, num_classes)
        return built.config.to_dict(), type(built).__name__
    folder = spec.options["pretrained"]
    if pretrained_kind(folder) == "dynabatch":
        config, hf_class = pretrained_config(folder)  # as its manifest recorded them
        return config, str(hf_class)
    transformers = _transformers()
    extra: dict[str, Any] = {"use_cache": False}
    if _task(spec) == "sequence-classification":
        extra["num_labels"] = num_classes
    cfg = transformers.AutoConfig.from_pretrained(folder, local_files_only=True, **extra)
    auto = getattr(transformers, AUTO_CLASSES[_task(spec)])
    return cfg.to_dict(), auto._model_mapping[type(cfg)].__name__

"""The sections of a job spec (``dataset:``, ``model:``, ``optimizer:``, ``schedule:``, ...)
and the grammar of the names a spec may use.

Each section validates its own fields; rules across sections are in
:mod:`dynabatch.actors.spec.validation`, the job itself in :mod:`dynabatch.actors.spec.schema`.
"""

from __future__ import annotations

import itertools
import re
import warnings
from contextvars import ContextVar
from typing import Annotated, Any, Literal

from dynabatch.actors.data.fs import URI_PATTERN
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    SerializerFunctionWrapHandler,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)


class SpecWarning(UserWarning):
    """A value the spec accepts but that has no effect, or only in some case (said in the
    message). Its own category, so that a front end can show these as its own lines (the
    CLI's ``warning: FILE: ...``, the REST reply's ``warnings``) and leave other warnings
    as Python shows them."""


# Where the SpecWarnings of the spec being validated go, in this thread or task: a list of
# their messages (``spec_warnings_caught``; a spec read back, warned about at its
# submission, is validated in one and its list dropped), or None: issued as Python warnings.
# A context variable, not a ``warnings`` filter: the service validates
# specs on several threads at once, and a process-wide filter set for one request changed
# what another thread's validation showed.
SPEC_WARNINGS_SINK: ContextVar[list[str] | None] = ContextVar(
    "dynabatch_spec_warnings", default=None)


def warn_spec(message: str, stacklevel: int = 2) -> None:
    """Issue a :class:`SpecWarning`: into the collecting front end's list when one is
    collecting (once per message), else as a Python warning ``stacklevel`` frames up."""
    sink = SPEC_WARNINGS_SINK.get()
    if sink is None:
        warnings.warn(message, SpecWarning, stacklevel=stacklevel + 1)
    elif message not in sink:
        sink.append(message)


# The grammar dynabatch.actors.workloads.imports resolves: dotted module names, then one attribute.
IMPORT_PATH_PATTERN = r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$"
MODULE_PATTERN = r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$"
BUILTIN_DATASETS = ("synthetic", "digits", "mnist", "cifar10", "pysource", "parquet", "npy",
                    "imagefolder")
BUILTIN_MODELS = ("mlp", "lenet", "resnet", "charlm", "hf")
# model.options.task for model.name hf (dynabatch.actors.workloads.hf builds them).
HF_TASKS = ("causal-lm", "sequence-classification")
BUILTIN_LOSSES = ("cross_entropy", "mse", "next_token")
BUILTIN_METRICS = ("accuracy", "mse", "perplexity", "f1", "precision", "recall",
                   "confusion_matrix", "auroc", "mae", "rmse", "r2")
# metrics.<i>.average: how f1, precision, recall (and auroc: macro, weighted) average classes.
AVERAGES = ("macro", "micro", "weighted")
AVERAGED_METRICS = {"f1": AVERAGES, "precision": AVERAGES, "recall": AVERAGES,
                    "auroc": ("macro", "weighted")}
# Metrics a built-in loss calls for when the spec names none.
DEFAULT_METRICS = {
    "cross_entropy": ("accuracy",),
    "next_token": ("perplexity", "accuracy"),
    "mse": ("mse",),
}
BUILTIN_OPTIMIZERS = ("sgd", "adam", "adamw")
# A torch class by name (torch.optim's optimizers and lr_scheduler's schedulers).
CLASS_NAME_PATTERN = r"^[A-Z][A-Za-z0-9_]{0,63}$"
# A metric's name: a Prometheus label value, a key of the epoch records' test_metrics and a
# Python identifier (so it reads the same in every table). Not the evaluation sums' own keys.
METRIC_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
RESERVED_METRIC_NAMES = ("n", "loss")

# Integer fields are StrictInt: "7" or true is an error naming the field, never a silent
# conversion (YAML and JSON configs give real integers). Float fields stay lax: `lr: 1` must
# work, and PyYAML reads `lr: 1e-3` (no dot) as the string "1e-3".


def known_name(kind: str, value: str, builtins: tuple[str, ...]) -> str:
    """``value`` when it is one of the ``builtins`` or an import path ``"pkg.mod:function"``;
    otherwise a ValueError naming both choices (``kind`` is dataset, model, loss, metric)."""
    if value in builtins or re.match(IMPORT_PATH_PATTERN, value):
        return value
    raise ValueError(
        f"unknown {kind} {value!r}: use {', '.join(builtins)} or 'pkg.mod:function'"
    )


def _known(kind: str, builtins: tuple[str, ...]) -> AfterValidator:
    """A field's check that it names one of ``builtins`` or an import path (:func:`known_name`)."""
    return AfterValidator(lambda v: known_name(kind, v, builtins))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def default_metric_name(fn: Any) -> str | None:
    """The name a metric gets when the spec gives none: a built-in's own name, an import
    path's function name (``pkg.mod:top5`` is ``top5``)."""
    return fn.rpartition(":")[2] if isinstance(fn, str) else None


class MetricSpec(_Strict):
    """One evaluation metric: ``fn`` (a built-in or ``"pkg.mod:function"``) shown as
    ``name`` in the job's status, REST answers, page, ``/metrics`` and CLI tables.

    A plain string is the short form: ``"pkg.mod:f1"`` is ``{fn: "pkg.mod:f1"}``, named by
    its function, ``f1``; it is written back in that form when its name is the default."""

    fn: Annotated[str, _known("metric", BUILTIN_METRICS)] = Field(
        description="A built-in (accuracy, mse, perplexity; over the whole held-out set: f1, "
        "precision, recall, confusion_matrix, auroc, mae, rmse, r2) or 'pkg.mod:name': a "
        "function (outputs, targets) -> one value per sample, averaged, or a "
        "torchmetrics.Metric subclass.", examples=["accuracy", "f1", "my_pkg.metrics:top5"])
    name: str = Field(description="What the metric is called everywhere it is shown: a "
                      "letter or _, then letters, digits or _ (64 at most), unique in the job; "
                      "not n or loss. Default: the function's name (f1 for 'pkg.mod:f1').",
                      examples=["f1"])
    average: str | None = Field(
        default=None, description="How f1, precision and recall average over classes: "
        "macro (the default), micro or weighted; auroc: macro or weighted.",
        examples=["weighted"])

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, data: Any) -> Any:
        if isinstance(data, str):  # its problem is the entry's: metrics.<i>
            data = {"fn": known_name("metric", data, BUILTIN_METRICS)}
        elif not isinstance(data, dict | MetricSpec):
            raise ValueError(f"must be a metric ({', '.join(BUILTIN_METRICS)} or "
                             "'pkg.mod:function') or a mapping {name: ..., fn: ...}")
        if isinstance(data, dict) and data.get("name") is None:
            data = {**data, "name": default_metric_name(data.get("fn"))}
        return data

    @field_validator("average")
    @classmethod
    def _average(cls, v: str | None, info: ValidationInfo) -> str | None:
        fn = info.data.get("fn")
        if v is None or fn is None:
            return v
        allowed = AVERAGED_METRICS.get(fn)
        if allowed is None:
            raise ValueError(f"{fn!r} takes no average (only "
                             f"{', '.join(AVERAGED_METRICS)} do)")
        if v not in allowed:
            raise ValueError(f"{v!r} is not an average of {fn}: use {', '.join(allowed)}")
        return v

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, v: Any, info: ValidationInfo) -> Any:
        if "fn" not in info.data:
            return v if isinstance(v, str) else ""  # fn's own error says what is wrong
        if not isinstance(v, str) or not re.match(METRIC_NAME_PATTERN, v):
            raise ValueError(f"{v!r} is not a metric name: a letter or _, then letters, "
                             "digits or _, 64 characters at most (it labels the metric in "
                             "/metrics and every table)")
        if v in RESERVED_METRIC_NAMES:
            raise ValueError(f"{v!r} is reserved (the held-out sample count and loss): give "
                             "the metric another name, {name: ..., fn: ...}")
        return v

    @classmethod
    def __get_pydantic_json_schema__(cls, core: Any, handler: GetJsonSchemaHandler
                                     ) -> dict[str, Any]:
        # The short form is valid input too; output has the same two forms (without the
        # serializer's own schema, which says Any), so JobSpec stays one OpenAPI component.
        mapping = handler({k: v for k, v in core.items() if k != "serialization"})
        return {"anyOf": [{"type": "string"}, mapping]}

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> Any:
        # The short form when it says it all: specs written before names read back the same.
        if self.name == default_metric_name(self.fn) and self.average is None:
            return self.fn
        out = handler(self)
        if isinstance(out, dict) and out.get("average") is None:
            out.pop("average", None)  # written back as it was given
        return out


class DatasetSpec(_Strict):
    """Which data to train on.

    ``name`` is a built-in dataset (``synthetic``, ``digits``, ``mnist``, ``cifar10``,
    ``pysource``), a file-backed source read by position (``parquet``, ``npy``,
    ``imagefolder``: see ``dynabatch.actors.data``) or a user import path
    ``"pkg.mod:function"``; the function takes the ``options`` mapping as keyword arguments
    and returns a ``DatasetArrays``, a tuple of arrays, or a map-style dataset.
    """

    name: Annotated[str, _known("dataset", BUILTIN_DATASETS)] = Field(
        default="digits",
        description="Built-in dataset (synthetic, digits, mnist, cifar10, pysource), a "
        "source read by position (parquet, npy, imagefolder) or 'pkg.mod:load'.",
        examples=["digits", "mnist", "parquet", "my_pkg.data:load"],
    )
    path: str | None = Field(
        default=None,
        description="Directory of the MNIST IDX files or of cifar-10-batches-py. For mnist, "
        "when omitted, MNIST-format data is generated (deterministically, from the seed). "
        "For parquet, npy and imagefolder: a file, a directory or a pyarrow.fs URI "
        "(s3://, gs://, hdfs://, file://); with train/ and test/ inside it, those are the "
        "splits.",
    )
    num_classes: StrictInt | None = Field(
        default=None, ge=1, description="Classes (or output width) when the data does not say."
    )
    targets: Literal["classes", "tokens", "values"] | None = Field(
        default=None, description="What the targets are; default: from the first sample."
    )
    prefetch: StrictInt = Field(
        default=4, ge=1, le=256,
        description="Shares a worker reads ahead of training (file-backed and map-style).",
    )
    loader_threads: StrictInt | None = Field(
        default=None, ge=1, le=64,
        description="Background threads reading a worker's samples; default: one per CPU "
        "of the worker (worker_cpus), at most 16.",
    )
    collate: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="'pkg.mod:fn' building a share's batch from its samples (a list of "
        "(input, target) pairs of a map-style dataset, or of Parquet rows whose lists may "
        "differ in length; inputs may be dicts or tuples of tensors), returning (inputs, "
        "targets), for example padding sequences to the share's longest with an attention "
        "mask. User code, allowed as other import paths are.",
        examples=["my_pkg.text:pad_batch"])
    tokenizer: str | None = Field(
        default=None, min_length=1,
        description="The tokenizer the token ids came from: a tokenizers tokenizer.json "
        "(a local absolute path, confined like dataset.path). Its vocabulary must fit an hf "
        "model's vocab_size; dynabatch export --format hf puts it beside the model.",
        examples=["/data/my-bert/tokenizer.json"])
    labels: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1,
        description="The class names, in class order (label 0 first): an hf export's "
        "config.json gets them as id2label and label2id.", examples=[["negative", "positive"]])
    test_fraction: float = Field(
        default=0.2, gt=0.0, lt=1.0, description="Held-out split when the dataset has none."
    )
    validation: float | str | None = Field(
        default=None,
        description="A validation split, judged by early_stopping and checkpoint.keep_best "
        "instead of the test set (which is then scored at the end): a fraction of the "
        "training samples in (0, 1), held out by a split seeded from the job's seed; or the "
        "split's name (a folder beside train/ and test/ under dataset.path, a key of the "
        "dict a loader returns) or its own path (parquet, npy, imagefolder).",
        examples=[0.1, "validation", "/data/reviews/dev"])
    limit: StrictInt | None = Field(
        default=None, ge=1, description="Use at most this many training samples."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for the loader."
    )
    shuffle: Literal["every_epoch", "once"] = Field(
        default="every_epoch",
        description="every_epoch: a new sample order each epoch; once: one order for the "
        "whole job, so at a fixed global batch the same batches recur in a fixed cycle "
        "(Caffe-style, as ISGD's paper trains).",
    )

    @field_validator("validation", mode="before")
    @classmethod
    def _validation(cls, v: Any) -> Any:
        # One line for a number out of range, rather than one per member of the union.
        if isinstance(v, bool):
            raise ValueError(f"must be a fraction in (0, 1), a split's name or a path, got {v}")
        if isinstance(v, int | float):
            if not 0 < v < 1:
                raise ValueError(f"a fraction of the training samples must be in (0, 1), "
                                 f"got {v}")
            return float(v)
        if isinstance(v, str) and not v.strip():
            raise ValueError("must name a split or a path, not an empty string")
        return v

    @property
    def validation_fraction(self) -> float | None:
        """``validation`` when it is a fraction of train, else None."""
        return self.validation if isinstance(self.validation, float) else None

    @field_validator("tokenizer")
    @classmethod
    def _local_file(cls, v: str | None) -> str | None:
        if v is not None and (re.match(URI_PATTERN, v) or not v.startswith("/")):
            raise ValueError(f"{v!r} must be a local absolute path (a tokenizer.json)")
        return v

    @model_validator(mode="after")
    def _labels_fit(self) -> DatasetSpec:
        if self.labels is not None:
            if len(set(self.labels)) != len(self.labels):
                raise ValueError("labels: every class name must differ")
            if self.num_classes is not None and len(self.labels) != self.num_classes:
                raise ValueError(f"labels: {len(self.labels)} names, but num_classes is "
                                 f"{self.num_classes}")
        return self


class ModelSpec(_Strict):
    """Which network to train: a built-in (``mlp``, ``lenet``, ``resnet``, ``charlm``), a
    Hugging Face ``transformers`` model from its config (``hf``) or ``pkg.mod:build``."""

    name: Annotated[str, _known("model", BUILTIN_MODELS)] = Field(
        default="mlp", examples=["mlp", "lenet", "resnet", "hf", "my_pkg.nets:build"])
    hidden: StrictInt = Field(default=64, ge=1, le=65536, description="Hidden width for the MLP.")
    options: dict[str, Any] = Field(default_factory=dict)
    output: str | None = Field(
        default=None,
        description="'pkg.mod:fn' called as fn(outputs) on what the model returns, giving "
        "the tensor the loss and metrics get. Default: the output itself when it is a "
        "tensor, its logits when it is a transformers ModelOutput.",
        examples=["my_pkg.nets:pooled"])

    @field_validator("output")
    @classmethod
    def _import_path(cls, v: str | None) -> str | None:
        if v is not None and not re.match(IMPORT_PATH_PATTERN, v):
            raise ValueError(f"{v!r} is not an import path of the form 'pkg.mod:function'")
        return v


def hf_option_problems(options: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, problem) for ``model.options`` of ``model.name: hf`` that can be told without
    transformers: their shape, and a hub id, which is refused because nothing is ever
    downloaded (a job has no network at run time). ``pretrained`` is a local folder's
    absolute path (a ``save_pretrained`` folder or a dynabatch model directory), confined
    by the service like ``dataset.path``. The config's own keys are checked by
    :func:`dynabatch.actors.workloads.hf.check_hf_options`, which imports transformers."""
    hub = ("nothing is downloaded (a job has no network at run time): give the model's "
           "config instead, options: {config: {model_type: gpt2, n_layer: 2, ...}}")
    problems: list[tuple[str, str]] = []
    pretrained = options.get("pretrained")
    if pretrained is not None and (not isinstance(pretrained, str)
                                   or not pretrained.startswith("/")):
        problems.append(("model.options.pretrained", f"hub id {pretrained!r}: nothing is "
                         "downloaded (a job has no network at run time): give a local "
                         "folder's absolute path (a save_pretrained folder or a dynabatch "
                         "model directory), or the model's config"))
    if pretrained is not None and "config" in options:
        problems.append(("model.options.config", "not with pretrained: the folder's "
                         "config.json is the model's"))
    unknown = sorted(set(options) - {"config", "task", "pretrained"})
    if unknown:
        problems.append(("model.options", f"unknown option {unknown[0]!r} for hf "
                         "(allowed: config, pretrained, task)"))
    task = options.get("task", HF_TASKS[0])
    if task not in HF_TASKS:
        problems.append(("model.options.task", f"must be {' or '.join(HF_TASKS)}, got "
                         f"{task!r}"))
    config = options.get("config")
    if isinstance(config, str):
        problems.append(("model.options.config", f"{config!r} is a hub id: " + hub))
    elif not isinstance(config, dict):
        if "pretrained" not in options:
            problems.append(("model.options.config", "must be a mapping with model_type and "
                             "the model's fields, e.g. {model_type: gpt2, n_layer: 2}"))
    elif not isinstance(config.get("model_type"), str):
        problems.append(("model.options.config.model_type", "must name the architecture "
                         "(gpt2, bert, llama, ...)"))
    return problems


class LrScheduleSpec(_Strict):
    """The learning rate over the job, as a factor of ``optimizer.lr`` (see
    :mod:`dynabatch.scheduler.core.regime.schedule` for the formulas). ``constant``: 1.
    ``multistep``: ``gamma`` to
    the number of ``milestones`` (epochs) passed. ``cosine``: from 1 down to
    ``min_factor`` over the job. ``warmup_epochs``: a linear warm-up from 0 over the first
    epochs, on top of any of them."""

    name: Literal["constant", "multistep", "cosine"] = "constant"
    milestones: list[Annotated[int, Field(strict=True, ge=1)]] = Field(default_factory=list)
    gamma: float = Field(default=0.1, gt=0.0, le=1.0)
    min_factor: float = Field(default=0.0, ge=0.0, le=1.0)
    warmup_epochs: float = Field(default=0.0, ge=0.0, le=100_000)

    @field_validator("milestones")
    @classmethod
    def _increasing(cls, v: list[int]) -> list[int]:
        if any(b <= a for a, b in itertools.pairwise(v)):
            raise ValueError("milestones must be strictly increasing epochs")
        return v


class LrSchedulerSpec(_Strict):
    """A ``torch.optim.lr_scheduler`` class by name, or the user's ``make(optimizer,
    **options)`` by import path, with its constructor's ``options`` (not its optimizer).
    The coordinator steps it on a dummy parameter (:class:`dynabatch.actors.optim.LrSteps`)
    and puts the resulting learning rate into every step's plan. ``interval: epoch``: epoch
    ``e`` trains at the rate after ``e`` calls of ``step()``; ``interval: step``: the job's
    ``k``-th committed optimizer step (from 0) at the rate after ``k`` calls, the same after
    a lost node or a resume."""

    name: str = Field(description="A torch.optim.lr_scheduler class (StepLR, "
                      "CosineAnnealingLR, OneCycleLR, LinearLR, ...; LambdaLR is not: its "
                      "options are functions) or 'pkg.mod:make' (make(optimizer, **options) "
                      "returns one, as transformers:get_linear_schedule_with_warmup does).",
                      examples=["CosineAnnealingLR"])
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="Keyword arguments of its constructor.",
                                    examples=[{"T_max": 10}])
    interval: Literal["step", "epoch"] = Field(
        default="epoch", description="When it steps: after every optimizer step (step) or "
        "every epoch (epoch).")

    @field_validator("name")
    @classmethod
    def _class_or_path(cls, v: str) -> str:
        if re.match(CLASS_NAME_PATTERN, v) or re.match(IMPORT_PATH_PATTERN, v):
            return v
        raise ValueError(f"{v!r} is neither a torch.optim.lr_scheduler class name nor "
                         "'pkg.mod:make'")


class OptimizerSpec(_Strict):
    """The optimizer every worker builds: a built-in (``sgd``, ``adam``, ``adamw``), any
    ``torch.optim`` class by name (``SGD``, ``RMSprop``, ``Adagrad``, ...), or the user's
    ``"pkg.mod:make"``, called as ``make(params, **options)``. The step plan's learning
    rate replaces every parameter group's ``lr`` before each step, whichever it is."""

    name: str = Field(
        default="sgd",
        description="sgd, adam, adamw, a torch.optim class (SGD, RMSprop, Adagrad, ...) or "
        "'pkg.mod:make' (make(params, **options) -> a torch.optim.Optimizer).",
        examples=["sgd", "RMSprop", "my_pkg.optim:make"])
    lr: float = Field(default=0.1, gt=0.0, le=10.0)
    momentum: float = Field(default=0.0, ge=0.0, lt=1.0)
    nesterov: bool = False
    weight_decay: float = Field(default=0.0, ge=0.0, lt=1.0)
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Further keyword arguments of a torch.optim class (checked against its "
        "constructor) or of 'pkg.mod:make'.", examples=[{"alpha": 0.95}])
    schedule: LrScheduleSpec = Field(default_factory=LrScheduleSpec)
    lr_scheduler: LrSchedulerSpec | None = Field(
        default=None,
        description="A torch.optim.lr_scheduler by name, stepped once per epoch by the "
        "coordinator; not with optimizer.schedule.")
    clip_grad_norm: float | None = Field(
        default=None, gt=0.0,
        description="Clip the global gradient (the all-reduced one, the same in every "
        "worker) to this L2 norm before each optimizer step.")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v in BUILTIN_OPTIMIZERS or re.match(IMPORT_PATH_PATTERN, v) or re.match(
                CLASS_NAME_PATTERN, v):
            return v
        raise ValueError(f"unknown optimizer {v!r}: use {', '.join(BUILTIN_OPTIMIZERS)}, a "
                         "torch.optim class (SGD, RMSprop, Adagrad, ...) or 'pkg.mod:make'")

    @model_validator(mode="after")
    def _ignored(self) -> OptimizerSpec:
        if self.name in ("adam", "adamw") and self.momentum:
            warn_spec(f"optimizer.momentum is ignored by {self.name}")
        if self.options and self.name in BUILTIN_OPTIMIZERS:
            raise ValueError(f"options are for a torch.optim class or 'pkg.mod:make', not "
                             f"{self.name} (its fields are lr, momentum, nesterov and "
                             "weight_decay)")
        if self.nesterov and (self.name not in ("sgd", "SGD") or self.momentum == 0):
            raise ValueError("nesterov needs optimizer sgd with momentum > 0")
        return self


class StageSpec(_Strict):
    """``epochs`` epochs at global batch ``global_batch``. ``lr_factor`` (the stage's LR as a
    factor of ``optimizer.lr``) and ``warmup_epochs`` (the ramp after the jump into it)
    override the schedule's ``lr_scaling`` and ``warmup_epochs`` for this stage (``dynabatch
    tune`` writes them)."""

    epochs: StrictInt = Field(ge=1, le=100_000)
    global_batch: StrictInt = Field(ge=1, le=1_000_000)
    lr_factor: float | None = Field(default=None, gt=0.0, le=10_000.0)
    warmup_epochs: float | None = Field(default=None, ge=0.0, le=100_000)


class BatchScheduleSpec(_Strict):
    """The global batch over the job (Hu et al. 2022: small early, large later).

    ``mode: fixed`` keeps ``global_batch``. ``mode: stages`` trains each stage's epochs at
    its batch; the learning rate is scaled relative to the first stage (``lr_scaling``:
    ``linear`` B_s/B_0, ``sqrt`` √(B_s/B_0), ``none``) and, after each jump, ramps linearly
    from the previous stage's factor over ``warmup_epochs``. ``mode: goodput`` picks the batch
    each epoch from the measured gradient noise scale (Pollux/AdaScale), between
    ``min_global_batch`` (default: ``global_batch``) and ``max_global_batch``;
    ``global_batch`` is B_0, the batch AdaScale's learning-rate gain is relative to.
    """

    mode: Literal["fixed", "stages", "goodput"] = "fixed"
    stages: list[StageSpec] = Field(default_factory=list)
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    warmup_epochs: float = Field(default=0.0, ge=0.0, le=100_000)
    max_global_batch: StrictInt | None = Field(default=None, ge=1, le=1_000_000)
    min_global_batch: StrictInt | None = Field(default=None, ge=1, le=1_000_000)

    @model_validator(mode="before")
    @classmethod
    def _stages_mode(cls, data: Any) -> Any:
        # `schedule: {stages: [...]}` means mode stages without saying so.
        if isinstance(data, dict) and data.get("stages") and "mode" not in data:
            data = {**data, "mode": "stages"}
        return data

    @model_validator(mode="after")
    def _shape(self) -> BatchScheduleSpec:
        if self.mode == "stages" and not self.stages:
            raise ValueError("mode stages needs at least one entry in stages")
        if self.mode != "stages" and self.stages:
            raise ValueError(f"stages are only used with mode stages, not {self.mode}")
        if self.mode != "goodput" and self.min_global_batch is not None:
            raise ValueError(f"min_global_batch is only used with mode goodput, not {self.mode}")
        return self


class IsgdSpec(_Strict):
    """Inconsistent SGD (Wang et al.): statistical process control on the batch losses.

    A batch whose global loss is above ``mean + sigma·std`` of the last ``window`` batch
    losses is under-trained: it gets up to ``max_extra`` more iterations of the conservative
    sub-problem ``½(ψ − limit)² + ε/(2·n_w)·‖w − w_prev‖²`` (``epsilon`` is ε), stopping as
    soon as its loss is below the limit. Monitoring starts after the first epoch.
    ``window: epoch`` is the paper's n_b: the number of batches in an epoch.
    """

    enabled: bool = False
    window: StrictInt | Literal["epoch"] = Field(default=20)
    sigma: float = Field(default=3.0, gt=0.0, le=100.0)
    max_extra: StrictInt = Field(default=5, ge=1, le=1000)
    epsilon: float = Field(default=0.1, ge=0.0, le=1000.0)

    @field_validator("window", mode="before")
    @classmethod
    def _window(cls, v: Any) -> int | str:
        # One clear message instead of one per member of the int | 'epoch' union.
        if isinstance(v, str) and v == "epoch":
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError("must be an integer of at least 2, or 'epoch' (the batches in "
                             "an epoch)")
        if not 2 <= v <= 100_000:
            raise ValueError(f"window must be at least 2 (a standard deviation needs two "
                             f"losses) and at most 100000, got {v}")
        return v


class CompileSpec(_Strict):
    """``torch.compile`` of the model in every worker (the sync protocol's). ``dynamic``:
    the batch dimension is marked dynamic, so one graph serves every share size (a share
    changes whenever the policy re-sizes); false compiles a graph per size (torch's
    recompile limit then falls back to eager). ``backend``: inductor generates kernels
    (on the CPU it needs a C++ compiler); aot_eager and eager only trace (tests,
    debugging)."""

    mode: Literal["default", "reduce-overhead", "max-autotune",
                  "max-autotune-no-cudagraphs"] = "default"
    dynamic: bool = True
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"


class Disturbance(_Strict):
    """From ``epoch`` (and ``step`` within it), worker ``worker`` runs ``factor`` times slower."""

    worker: StrictInt = Field(ge=0, description="Worker index (rank in the initial membership).")
    factor: float = Field(ge=1.0, le=1000.0)
    epoch: StrictInt = Field(default=0, ge=0)
    step: StrictInt = Field(default=0, ge=0)


class EmulationSpec(_Strict):
    """Heterogeneity emulation for clusters whose nodes are equal. Off unless set.

    A worker with slowdown f sleeps (f-1) times its measured compute after each compute
    phase, so its compute time is f times the real one. Fault injection is no part of a job
    spec: tests and benchmarks inject a worker's errors themselves (``bench/worker_probes.py``).
    """

    slowdowns: list[Annotated[float, Field(ge=1.0, le=1000.0)]] = Field(default_factory=list)
    disturbances: list[Disturbance] = Field(default_factory=list)


class RebalanceSpec(_Strict):
    """When the policy may change the allocation.

    ``epoch``: at epoch boundaries. ``steps``: every ``every_steps`` steps.
    ``adaptive``: check every ``check_steps`` steps and rebalance when the predicted gain in
    step time exceeds ``threshold``.
    """

    mode: Literal["epoch", "steps", "adaptive"] = "epoch"
    every_steps: StrictInt = Field(default=10, ge=1)
    check_steps: StrictInt = Field(default=2, ge=1)
    threshold: float = Field(default=0.05, ge=0.0, lt=1.0)

    def min_gain(self, policy: str) -> float | None:
        """The gain in predicted step time a re-size must beat under ``policy``: the
        threshold, for ``adaptive`` checks of a policy that re-sizes (dbs, affine); None
        where it does not apply (the policy keeps its own). The one statement of that
        rule: the driver builds its policy with it, validation warns from it."""
        return self.threshold if self.mode == "adaptive" and policy in ("dbs", "affine") else None


class BestSpec(_Strict):
    """Which epoch is the best: the one whose held-out ``metric`` is lowest (``mode: min``)
    or highest (``max``). ``metric`` is one the job computes: the name of one of its
    ``metrics`` (the defaults of its loss when it names none) or ``loss``, the held-out
    loss."""

    metric: str = Field(min_length=1, max_length=64,
                        description="A metric the job computes (accuracy, perplexity, a "
                        "metrics entry's name) or loss (the held-out loss).",
                        examples=["accuracy", "loss"])
    mode: Literal["min", "max"] = Field(description="min: lower is better; max: higher is.")


class EarlyStoppingSpec(BestSpec):
    """End the job SUCCEEDED when the held-out ``metric`` has not improved (by more than
    ``min_delta``) for ``patience`` evaluated epochs in a row. Each epoch's evaluation is
    then awaited before the next epoch starts (the decision needs it)."""

    patience: StrictInt = Field(default=3, ge=1, le=100_000,
                                description="Epochs without an improvement before the job "
                                "ends.")
    min_delta: float = Field(default=0.0, ge=0.0,
                             description="How much better than the best so far a value must "
                             "be to count as an improvement.")


class EvaluationSpec(_Strict):
    """When the test set is scored. With ``dataset.validation`` every epoch is scored on the
    validation split (early stopping and keep_best judge on it) and the test set once, on
    the final weights (after the last epoch, or after an early stop); ``test_every_epoch``
    scores it after every epoch as well. Without a validation split the test set is the
    one scored every epoch, as it is judged."""

    test_every_epoch: bool = Field(
        default=False, description="Also score the test set after every epoch (with "
        "dataset.validation; without it, the test set is scored every epoch anyway).")


class CheckpointSpec(_Strict):
    """Where the job's checkpoints go (``dir``) and, for a new job, which checkpoint file it
    starts from (``from``: another job's ``DIR/JOB_ID/checkpoint.pt``). ``from`` is a Python
    keyword, so the attribute is ``from_``; specs and dumps spell it ``from``."""

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    dir: str | None = Field(default=None, description="Where checkpoints go; none when unset.")
    every_epochs: StrictInt = Field(default=1, ge=1)
    from_: str | None = Field(
        default=None, alias="from", min_length=1,
        description="A checkpoint file to start from: its weights, and its optimizer state "
        "when it was written with the same optimizer; not its epochs or history. A job "
        "resuming from its own checkpoint (in dir) ignores it.")
    keep_best: BestSpec | None = Field(
        default=None,
        description="Also keep the best epoch's checkpoint by a held-out metric, as "
        "DIR/JOB_ID/best.pt beside the latest (checkpoint.pt); replaced only by a better "
        "epoch. Needs dir.")


class ArtifactsSpec(_Strict):
    """Where the trained model goes at the job's end: ``DIR/JOB_ID/`` holds ``model.safetensors``
    (the final weights), ``best.safetensors`` when ``checkpoint.keep_best`` is set, and
    ``manifest.json`` (``dynabatch.actors.export``). Unset, the service keeps them itself."""

    dir: str | None = Field(
        default=None, min_length=1,
        description="Where the trained model goes (a local path, or a URI pyarrow.fs opens: "
        "s3://, gs://, hdfs://, file://); unset: the service keeps it.")


class TrackingSpec(_Strict):
    """Experiment tracking beside Prometheus: TensorBoard event files of the job's scalars
    (loss, held-out metrics, each worker's batch share, utilisation), per epoch and step."""

    tensorboard: str | None = Field(
        default=None, min_length=1,
        description="Directory of the TensorBoard event files (DIR/JOB_ID/); a local path "
        "confined like artifacts.dir. Unset: none are written.")

    @field_validator("tensorboard")
    @classmethod
    def _local(cls, v: str | None) -> str | None:
        if v is not None and re.match(URI_PATTERN, v):
            raise ValueError(f"{v!r} is a URI; event files go to a local directory (on the "
                             "node that runs the job's driver)")
        return v


class ProtocolSpec(_Strict):
    """How gradients reach the model. ``sync`` (default): synchronous data parallel with
    per-worker batches (the policy). ``ps``: a parameter server (Rudra's hardsync, n-softsync
    and async, with staleness-aware learning rates; ``batch: perf_aware`` is Ji et al.'s
    per-learner batches). Each learner's base batch is ``global_batch // workers`` (μ, so
    μλ = global_batch). See ``dynabatch.scheduler.core.ps.rudra`` for the formulas."""

    name: Literal["sync", "ps"] = "sync"
    mode: Literal["async", "softsync", "hardsync"] = "async"
    n: StrictInt = Field(default=1, ge=1, description="n-softsync: update every ⌊λ/n⌋ "
                         "gradients (λ = workers).")
    lr_staleness: Literal["none", "per_gradient", "average"] = Field(
        default="none", description="α0 | α0/τ per gradient | α0/⟨τ⟩.")
    max_staleness: StrictInt | None = Field(
        default=None, ge=0, description="Bound S on a gradient's staleness; none: unbounded.")
    on_stale: Literal["refuse", "wait"] = "refuse"
    batch: Literal["fixed", "perf_aware"] = "fixed"
    replan_pushes: StrictInt = Field(
        default=0, ge=0, description="perf_aware: re-plan every k pushes (0: every epoch).")
    scale_lr: bool = Field(default=True, description=(
        "perf_aware: scale α by b_i/b0 (the default: the best arm measured by "
        "bench/async_ji.py); false: α0 for every batch size, the paper's plain reading."))
    shards: StrictInt = Field(
        default=1, ge=1, le=64, description="Server actors the flat parameters are split "
        "over (each slice with its own optimizer state); 1: one server.")

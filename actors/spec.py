"""The job specification: one schema for YAML configs, the REST API and the CLI.

Every field is validated here, so bad input is rejected before any Ray work starts,
with a message that names the field. Invalid *combinations* are collected by the
JobSpec model validator as ``(field path, problem)`` pairs and raised together as one
``_CombinationError`` (a ``ValueError``), which :func:`format_validation_error` expands to
one ``field: problem`` line each; values that are accepted but have no effect produce a
``UserWarning``. ``str(SpecError)`` is always a single line.

What a *valid* spec may name when it comes from a REST client (user code, dataset paths,
checkpoint dirs) is the service's decision, not the schema's: :func:`check_submission`
checks it against a :class:`SubmitPolicy` built from the settings.
"""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

POLICIES = ("static", "dbs", "affine")
MAX_WORKERS = 4096

# The grammar dynabatch.actors.workloads.imports resolves: dotted module names, then one attribute.
IMPORT_PATH_PATTERN = r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$"
MODULE_PATTERN = r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$"
BUILTIN_DATASETS = ("synthetic", "digits", "mnist", "cifar10", "pysource")
BUILTIN_MODELS = ("mlp", "lenet", "resnet", "charlm")
BUILTIN_LOSSES = ("cross_entropy", "mse", "next_token")
BUILTIN_METRICS = ("accuracy", "mse", "perplexity")

# Integer fields are StrictInt: "7" or true is an error naming the field, never a silent
# conversion (YAML and JSON configs give real integers). Float fields stay lax: `lr: 1` must
# work, and PyYAML reads `lr: 1e-3` (no dot) as the string "1e-3".


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DatasetSpec(_Strict):
    """Which data to train on.

    ``name`` is a built-in dataset (``synthetic``, ``digits``, ``mnist``, ``cifar10``) or a
    user loader given by import path ``"pkg.mod:function"``; the function takes the
    ``options`` mapping as keyword arguments and returns a ``DatasetArrays``.
    """

    name: str = Field(
        default="digits",
        description="Built-in dataset (synthetic, digits, mnist, cifar10) or 'pkg.mod:load'.",
        examples=["digits", "mnist", "my_pkg.data:load"],
    )
    path: str | None = Field(
        default=None,
        description="Directory of the MNIST IDX files or of cifar-10-batches-py. For mnist, "
        "when omitted, MNIST-format data is generated (deterministically, from the seed).",
    )
    test_fraction: float = Field(
        default=0.2, gt=0.0, lt=1.0, description="Held-out split when the dataset has none."
    )
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

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v in BUILTIN_DATASETS:
            return v
        if not re.match(IMPORT_PATH_PATTERN, v):
            raise ValueError(
                f"unknown dataset {v!r}: use {', '.join(BUILTIN_DATASETS)} "
                "or 'pkg.mod:function'"
            )
        return v


class ModelSpec(_Strict):
    """Which network to train: a built-in (``mlp``, ``lenet``, ``resnet``) or ``pkg.mod:build``."""

    name: str = Field(default="mlp", examples=["mlp", "lenet", "resnet", "my_pkg.nets:build"])
    hidden: StrictInt = Field(default=64, ge=1, le=65536, description="Hidden width for the MLP.")
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v in BUILTIN_MODELS:
            return v
        if not re.match(IMPORT_PATH_PATTERN, v):
            raise ValueError(
                f"unknown model {v!r}: use {', '.join(BUILTIN_MODELS)} or 'pkg.mod:function'"
            )
        return v


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


class OptimizerSpec(_Strict):
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(default=0.1, gt=0.0, le=10.0)
    momentum: float = Field(default=0.0, ge=0.0, lt=1.0)
    nesterov: bool = False
    weight_decay: float = Field(default=0.0, ge=0.0, lt=1.0)
    schedule: LrScheduleSpec = Field(default_factory=LrScheduleSpec)

    @model_validator(mode="after")
    def _ignored(self) -> OptimizerSpec:
        if self.name != "sgd" and self.momentum:
            warnings.warn(f"optimizer.momentum is ignored by {self.name}", UserWarning,
                          stacklevel=2)
        if self.nesterov and (self.name != "sgd" or self.momentum == 0):
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


class Disturbance(_Strict):
    """From ``epoch`` (and ``step`` within it), worker ``worker`` runs ``factor`` times slower."""

    worker: StrictInt = Field(ge=0, description="Worker index (rank in the initial membership).")
    factor: float = Field(ge=1.0, le=1000.0)
    epoch: StrictInt = Field(default=0, ge=0)
    step: StrictInt = Field(default=0, ge=0)


class InjectedError(_Strict):
    """From ``epoch`` (and ``step``) on, worker ``worker`` raises in its compute phase on
    every step: a deterministic worker error, for fault tests and ``bench/faults.py``."""

    worker: StrictInt = Field(ge=0, description="Worker index (rank in the initial membership).")
    epoch: StrictInt = Field(default=0, ge=0)
    step: StrictInt = Field(default=0, ge=0)


class EmulationSpec(_Strict):
    """Heterogeneity emulation for clusters whose nodes are equal. Off unless set.

    A worker with slowdown f sleeps (f-1) times its measured compute after each compute
    phase, so its compute time is f times the real one. ``errors`` injects deterministic
    worker errors.
    """

    slowdowns: list[Annotated[float, Field(ge=1.0, le=1000.0)]] = Field(default_factory=list)
    disturbances: list[Disturbance] = Field(default_factory=list)
    errors: list[InjectedError] = Field(default_factory=list)


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


class CheckpointSpec(_Strict):
    dir: str | None = Field(default=None, description="Where checkpoints go; none when unset.")
    every_epochs: StrictInt = Field(default=1, ge=1)


class ProtocolSpec(_Strict):
    """How gradients reach the model. ``sync`` (default): synchronous data parallel with
    per-worker batches (the policy). ``ps``: a parameter server (Rudra's hardsync, n-softsync
    and async, with staleness-aware learning rates; ``batch: perf_aware`` is Ji et al.'s
    per-learner batches). Each learner's base batch is ``global_batch // workers`` (μ, so
    μλ = global_batch). See ``dynabatch.scheduler.core.ps.protocol`` for the formulas."""

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
    scale_lr: bool = Field(default=False, description="perf_aware: scale α by b_i/b0.")
    shards: StrictInt = Field(
        default=1, ge=1, le=64, description="Server actors the flat parameters are split "
        "over (each slice with its own optimizer state); 1: one server.")


PS_ONLY_FIELDS = ("mode", "n", "lr_staleness", "max_staleness", "on_stale", "batch",
                  "replan_pushes", "scale_lr", "shards")
# Built-ins whose targets are not class labels (the ps learners train cross-entropy on labels).
PS_NOT_CLASSES = {"dataset.name": ("pysource",), "model.name": ("charlm",)}


class _CombinationError(ValueError):
    """Invalid combinations of fields, each as (dotted field path, problem)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{loc}: {msg}" for loc, msg in problems))


class JobSpec(_Strict):
    """A training job. The same schema is used by YAML configs, ``POST /v1/jobs`` and the CLI."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        json_schema_extra={
            "examples": [
                {
                    "name": "digits-hetero",
                    "dataset": {"name": "digits"},
                    "model": {"name": "mlp", "hidden": 64},
                    "workers": 4,
                    "global_batch": 64,
                    "epochs": 5,
                    "policy": "affine",
                    "emulation": {"slowdowns": [1, 1, 2, 4]},
                }
            ]
        },
    )

    name: str = Field(default="job", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    dataset: DatasetSpec = Field(default_factory=DatasetSpec)
    model: ModelSpec = Field(default_factory=ModelSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    loss: str | None = Field(
        default=None,
        description="Per-sample loss: cross_entropy, mse, next_token or 'pkg.mod:function' "
        "((outputs, targets) -> one loss per sample, shape (B,)). Default: from the dataset "
        "(class labels: cross_entropy, token sequences: next_token, regression values: mse).",
        examples=["cross_entropy", "next_token", "my_pkg.losses:huber"],
    )
    working_dir: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="The user's code, shipped with the job to every node through Ray's "
        "runtime_env: a URI Ray accepts (the file:// zip that POST /v1/code returns, "
        "gcs://, https://, s3://...), or, for `dynabatch run` only, a local directory. Its "
        "modules are importable by import paths. Over REST only when the service allows any "
        "user code (DYNABATCH_USER_CODE_MODULES='*').",
    )
    metrics: list[str] | None = Field(
        default=None, max_length=16,
        description="Evaluation metrics on the held-out set: accuracy, mse, perplexity or "
        "'pkg.mod:function' ((outputs, targets) -> one value per sample, averaged). Default: "
        "from the loss (cross_entropy: accuracy, next_token: perplexity and accuracy, mse: mse).",
    )
    schedule: BatchScheduleSpec = Field(default_factory=BatchScheduleSpec)
    isgd: IsgdSpec = Field(default_factory=IsgdSpec)
    workers: int | Literal["auto"] = Field(
        default=2, description="Number of workers, or 'auto' for one per eligible node."
    )
    min_workers: StrictInt | None = Field(default=None, ge=1, le=MAX_WORKERS)
    max_workers: StrictInt | None = Field(default=None, ge=1, le=MAX_WORKERS)
    worker_cpus: float = Field(default=1.0, gt=0.0, le=1024.0)
    worker_gpus: Annotated[float, Field(ge=0.0, le=64.0)] | Literal["auto"] = Field(
        default=0.0,
        description="GPUs per worker (> 0: every worker on a GPU, NCCL), or 'auto': one GPU "
        "where a node has one and the CPU elsewhere, in one job (gloo across them).",
    )
    node_resource: str | None = Field(
        default=None,
        description="Only nodes that offer this custom resource are eligible for workers.",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    global_batch: StrictInt = Field(default=64, ge=1, le=1_000_000)
    max_batch: StrictInt | None = Field(
        default=None, ge=1, description="Cap on any worker's share of a step (hard: the "
        "global batch can never exceed max_batch x workers). To bound a worker's memory "
        "instead, use micro_batch."
    )
    micro_batch: (Annotated[StrictInt, Field(ge=1)]
                  | Annotated[list[Annotated[StrictInt, Field(ge=1)]], Field(min_length=1)]
                  | None) = Field(
        default=None,
        description="Most samples a worker computes at once (its memory cap), for every "
        "worker or one per worker ordinal. Unlike max_batch it does not limit the share: a "
        "larger share is accumulated over ceil(share / micro_batch) micro-batches.",
    )
    allreduce: Literal["bucketed", "flat"] = Field(
        default="bucketed",
        description="bucketed: gradients go out in buckets from backward's hooks, overlapping "
        "communication with compute (as DDP); flat: one all-reduce after backward.",
    )
    bucket_kb: StrictInt | None = Field(
        default=None, ge=1, le=1 << 20,
        description="Bucket size of the bucketed all-reduce. Default on a GPU: from the "
        "model's size, a quarter of it between 32 KiB and 25 MiB, the first bucket at most "
        "1 MiB (as DDP), so that small models get several buckets too; on the CPU, DDP's "
        "sizes (25 MiB, the first 1 MiB): gloo reduces on the cores backward uses.")
    epochs: StrictInt = Field(default=3, ge=1, le=100_000)
    # dbs by default: bench/hetero.py (median of 5 runs, default per-epoch re-plans) found
    # affine 2% faster on cluster (a) and dbs 7% faster on (b); affine is the better choice
    # with `rebalance: adaptive` (bench/disturbance.py: recovered in 11 steps against 25).
    policy: Literal["static", "dbs", "affine"] = "dbs"
    rebalance: RebalanceSpec = Field(default_factory=RebalanceSpec)
    seed: StrictInt = Field(default=0, ge=0, le=2**31 - 1)
    emulation: EmulationSpec = Field(default_factory=EmulationSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    protocol: ProtocolSpec = Field(default_factory=ProtocolSpec)
    collective_timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    worker_wait_timeout_s: float = Field(
        default=60.0,
        gt=0.0,
        le=86400.0,
        description="How long to wait for min_workers before failing.",
    )
    start_timeout_s: float = Field(
        default=300.0, gt=0.0, le=86400.0,
        description="How long the first workers may take to start (scheduling, imports, "
        "data) before the job fails.",
    )
    spares: StrictInt = Field(
        default=1, ge=0, le=MAX_WORKERS,
        description="Pre-warmed spare workers the job keeps on idle eligible nodes, at most "
        "one per node (CPU workers, protocol sync): a worker that scales the job up or "
        "replaces a lost one there adopts the spare and trains within about a second, "
        "instead of paying a process start, the torch import and the model. A spare "
        "reserves no CPU; it costs its node memory (a Python process with torch, the model "
        "and the data). 0: none.",
    )
    max_retries: StrictInt = Field(
        default=2, ge=0, le=100,
        description="Retries of a step that failed with a worker's own (compute) error before "
        "the job fails with that error.",
    )

    @field_validator("loss")
    @classmethod
    def _loss(cls, v: str | None) -> str | None:
        if v is None or v in BUILTIN_LOSSES or re.match(IMPORT_PATH_PATTERN, v):
            return v
        raise ValueError(
            f"unknown loss {v!r}: use {', '.join(BUILTIN_LOSSES)} or 'pkg.mod:function'"
        )

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, v: list[str] | None) -> list[str] | None:
        for m in v or ():
            if m not in BUILTIN_METRICS and not re.match(IMPORT_PATH_PATTERN, m):
                raise ValueError(
                    f"unknown metric {m!r}: use {', '.join(BUILTIN_METRICS)} or "
                    "'pkg.mod:function'"
                )
        if v is not None and len(set(v)) != len(v):
            raise ValueError("metrics are listed twice")
        return v
    @model_validator(mode="before")
    @classmethod
    def _first_stage_batch(cls, data: Any) -> Any:
        # With stages, global_batch is the first stage's batch; it may be left out.
        if isinstance(data, dict) and "global_batch" not in data:
            sched = data.get("schedule")
            stages = sched.get("stages") if isinstance(sched, dict) else None
            if isinstance(stages, list) and stages and isinstance(stages[0], dict):
                b = stages[0].get("global_batch")
                if isinstance(b, int) and not isinstance(b, bool):
                    data = {**data, "global_batch": b}
        return data

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> int | str:
        # One clear message instead of one per member of the int | 'auto' union. Strict like
        # the other integer fields: a boolean, "7" or 7.0 is not a worker count.
        if isinstance(v, str) and v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_WORKERS:
            raise ValueError(f"must be an integer between 1 and {MAX_WORKERS}, or 'auto'")
        return v

    @field_validator("micro_batch", mode="before")
    @classmethod
    def _micro_batch(cls, v: Any) -> Any:
        # One clear message instead of one per member of the union.
        def ok(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 1

        if v is None or ok(v) or (isinstance(v, list) and v and all(map(ok, v))):
            return v
        raise ValueError("must be a positive integer, or a non-empty list of them (one per "
                         "worker ordinal)")

    @model_validator(mode="after")
    def _combinations(self) -> JobSpec:
        problems: list[tuple[str, str]] = []

        def bad(field: str, problem: str) -> None:
            problems.append((field, problem))

        n = self.workers if isinstance(self.workers, int) else None
        lo, hi = self.min_workers, self.max_workers
        if lo is not None and hi is not None and lo > hi:
            bad("min_workers", f"min_workers ({lo}) is greater than max_workers ({hi})")
        if n is not None and lo is not None and n < lo:
            bad("workers", f"workers ({n}) is below min_workers ({lo})")
        if n is not None and hi is not None and n > hi:
            bad("workers", f"workers ({n}) is above max_workers ({hi})")
        if n is not None and n > self.global_batch:
            bad(
                "global_batch",
                f"global_batch ({self.global_batch}) is smaller than workers ({n}): "
                "every worker needs at least one sample per step",
            )
        if self.max_batch is not None and n is not None and self.max_batch * n < self.global_batch:
            bad(
                "max_batch",
                f"max_batch ({self.max_batch}) x workers ({n}) cannot hold global_batch "
                f"({self.global_batch})",
            )
        self._schedule_problems(bad, n)
        slow = self.emulation.slowdowns
        # Workers that join later take the ordinals after the first n, up to max_workers.
        most = max(n, hi or n) if n is not None else None
        if slow and n is not None and len(slow) < n:
            bad(
                "emulation.slowdowns",
                f"emulation.slowdowns has {len(slow)} entries but workers is {n}",
            )
        for i, d in enumerate(self.emulation.disturbances):
            if most is not None and d.worker >= most:
                bad(
                    f"emulation.disturbances.{i}.worker",
                    f"worker {d.worker} does not exist: at most {most} workers "
                    f"(ordinals 0..{most - 1})",
                )
        _ps_problems(self, bad)
        if self.device == "cuda" and self.worker_gpus == 0:
            bad("worker_gpus", "device 'cuda' needs worker_gpus > 0 or 'auto'")
        if self.device == "cpu" and self.worker_gpus == "auto":
            bad("worker_gpus", "worker_gpus 'auto' places workers on GPUs; device is 'cpu'")
        if problems:
            raise _CombinationError(problems)
        _ps_warnings(self)
        if slow and most is not None and len(slow) > most:
            warnings.warn(
                f"emulation.slowdowns has {len(slow)} entries; entries past {most} are "
                "ignored (no more workers can exist: see workers and max_workers)",
                UserWarning,
                stacklevel=2,
            )
        for d in self.emulation.disturbances:
            if d.epoch >= self.epochs:
                warnings.warn(
                    f"emulation disturbance at epoch {d.epoch} is ignored: the job has "
                    f"{self.epochs} epochs",
                    UserWarning,
                    stacklevel=2,
                )
        return self

    def _schedule_problems(self, bad, n: int | None) -> None:
        sched = self.schedule
        if sched.mode == "stages":
            total = sum(st.epochs for st in sched.stages)
            if total != self.epochs:
                bad("schedule.stages", f"the stages' epochs add up to {total}, not to epochs "
                                       f"({self.epochs})")
            if sched.stages[0].global_batch != self.global_batch:
                bad("global_batch", f"global_batch ({self.global_batch}) must be the first "
                                    f"stage's ({sched.stages[0].global_batch}) or left out")
            for i, st in enumerate(sched.stages):
                where = f"schedule.stages.{i}.global_batch"
                if n is not None and st.global_batch < n:
                    bad(where, f"global_batch ({st.global_batch}) is smaller than workers "
                               f"({n}): every worker needs at least one sample per step")
                if self.max_batch is not None and n is not None and (
                        self.max_batch * n < st.global_batch):
                    bad(where, _share_cap_problem(self.max_batch, n, st.global_batch,
                                                  self.micro_batch))
        if sched.mode == "goodput":
            top = sched.max_global_batch
            if top is None:
                bad("schedule.max_global_batch", "mode goodput needs max_global_batch")
            elif top < self.global_batch:
                bad("schedule.max_global_batch", f"max_global_batch ({top}) is below "
                                                 f"global_batch ({self.global_batch})")
            elif self.max_batch is not None and n is not None and self.max_batch * n < top:
                bad("schedule.max_global_batch",
                    _share_cap_problem(self.max_batch, n, top, self.micro_batch))
            low = sched.min_global_batch
            if low is not None and top is not None and low > top:
                bad("schedule.min_global_batch", f"min_global_batch ({low}) is above "
                                                 f"max_global_batch ({top})")
            elif low is not None and n is not None and low < n:
                bad("schedule.min_global_batch", f"min_global_batch ({low}) is smaller than "
                                                 f"workers ({n}): every worker needs at "
                                                 "least one sample per step")
        ms = self.optimizer.schedule.milestones
        if ms and ms[-1] >= self.epochs:
            bad("optimizer.schedule.milestones", f"milestone {ms[-1]} is not before the last "
                                                 f"epoch ({self.epochs})")

    # Helpers used by the scheduler -------------------------------------------------------
    @property
    def batch_range(self) -> tuple[int, int]:
        """The smallest and largest global batch the job may train at."""
        sched = self.schedule
        if sched.mode == "stages":
            sizes = [st.global_batch for st in sched.stages]
            return min(sizes), max(sizes)
        if sched.mode == "goodput" and sched.max_global_batch:
            low = sched.min_global_batch or self.global_batch
            return min(low, sched.max_global_batch), sched.max_global_batch
        return self.global_batch, self.global_batch

    @property
    def initial_workers(self) -> int | None:
        """Workers to start with; None means one per eligible node (``workers: auto``)."""
        return self.workers if isinstance(self.workers, int) else None

    def gpus_on(self, node_gpus: float) -> float:
        """GPUs a worker asks for on a node offering ``node_gpus``."""
        if self.worker_gpus == "auto":
            return 1.0 if node_gpus >= 1.0 else 0.0
        return self.worker_gpus

    @property
    def emulated(self) -> bool:
        e = self.emulation
        return bool(e.slowdowns or e.disturbances or e.errors)


def _share_cap_problem(max_batch: int, workers: int, batch: int,
                       micro_batch: int | list[int] | None) -> str:
    """Why a global batch does not fit the workers' share cap. ``max_batch`` caps what a
    worker trains per step, whatever its memory; ``micro_batch`` caps its memory only (a
    larger share is accumulated), so it never makes room above ``max_batch``."""
    need = -(-batch // workers)
    fix = (f"raise max_batch to at least {need}, or leave it out: micro_batch "
           f"({micro_batch}) already bounds each worker's memory" if micro_batch is not None
           else f"raise max_batch to at least {need}, or leave it out and bound memory "
           "with micro_batch (larger shares accumulate)")
    return (f"global batch {batch} does not fit max_batch ({max_batch}) x workers "
            f"({workers}): max_batch caps every worker's share; {fix}")


def _ps_problems(spec: JobSpec, bad: Any) -> None:
    """Options the parameter server cannot honour, and ps options on a sync job. Only values
    that differ from the defaults count, so a dumped spec validates again."""
    p = spec.protocol
    default = ProtocolSpec()
    if p.name != "ps":
        for f in PS_ONLY_FIELDS:
            if getattr(p, f) != getattr(default, f):
                bad(f"protocol.{f}", "applies only to protocol ps")
        return
    n = spec.initial_workers
    if n is None:
        bad("workers", "protocol ps needs a number of learners, not 'auto'")
    elif p.mode == "softsync" and p.n > n:
        bad("protocol.n", f"n ({p.n}) is greater than the number of learners (workers = {n})")
    if p.mode != "softsync" and p.n != default.n:
        bad("protocol.n", f"applies only to mode softsync, not {p.mode}")
    # The default is accepted (a stored spec round-trips with every field set).
    if spec.policy != type(spec).model_fields["policy"].default:
        bad("policy", "protocol ps sizes batches with protocol.batch, not a policy")
    if spec.rebalance != RebalanceSpec():
        bad("rebalance", "protocol ps re-plans with protocol.replan_pushes")
    if spec.checkpoint.dir:
        bad("checkpoint.dir", "protocol ps does not write checkpoints")
    if spec.worker_gpus != 0 or spec.device == "cuda":
        bad("worker_gpus", "protocol ps learners run on the CPU")
    if spec.emulation.errors:
        bad("emulation.errors", "protocol ps does not inject worker errors")
    if spec.max_batch is not None:
        bad("max_batch", "protocol ps bounds batches itself (perf_aware: 4·b0)")
    # The learners and the server compute cross-entropy and accuracy only.
    if spec.loss not in (None, "cross_entropy"):
        bad("loss", "protocol ps trains with cross_entropy only")
    if spec.metrics not in (None, ["accuracy"]):
        bad("metrics", "protocol ps reports accuracy only")
    # The server applies the base rate alpha0 (scaled by the staleness rule) at a fixed
    # per-learner batch; the synchronous engine's schedules and ISGD are not applied there.
    if spec.schedule != BatchScheduleSpec():
        bad("schedule", "protocol ps keeps each learner's batch (protocol.batch), not a "
            "global batch schedule")
    if spec.isgd.enabled:
        bad("isgd.enabled", "ISGD runs with the synchronous protocol only")
    if spec.dataset.shuffle != "every_epoch":
        bad("dataset.shuffle", "protocol ps learners draw a new order every epoch")
    if spec.optimizer.schedule != LrScheduleSpec():
        bad("optimizer.schedule", "protocol ps uses the staleness rule "
            "(protocol.lr_staleness), not a learning-rate schedule")
    if p.batch != "perf_aware" and (p.replan_pushes != default.replan_pushes
                                    or p.scale_lr != default.scale_lr):
        bad("protocol.batch", "replan_pushes and scale_lr need batch perf_aware")
    if p.on_stale == "wait" and p.max_staleness is None:
        bad("protocol.on_stale", "wait needs max_staleness (the bound to wait for)")
    for field, names in PS_NOT_CLASSES.items():
        name = spec.dataset.name if field == "dataset.name" else spec.model.name
        if name in names:
            bad(field, f"protocol ps trains classification (class labels) only; {name!r} "
                "has token targets")


def _ps_warnings(spec: JobSpec) -> None:
    """Accepted ps settings that have no effect (the API returns them as warnings)."""
    p = spec.protocol
    if p.name == "ps" and p.mode == "hardsync":
        for f in ("max_staleness", "lr_staleness", "on_stale"):
            if getattr(p, f) != getattr(ProtocolSpec(), f):
                warnings.warn(f"protocol.{f} is ignored by mode hardsync (staleness is always "
                              "0)", UserWarning, stacklevel=3)


class SpecError(ValueError):
    """A job spec that failed validation, as one readable line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = [" ".join(p.split()) for p in problems]  # one line each
        super().__init__("; ".join(self.problems))


def format_validation_error(err: ValidationError) -> list[str]:
    """One ``field: problem`` string per error, e.g. ``global_batch: Input should be ...``."""
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, _CombinationError):
            prefix = f"{loc}." if loc else ""
            out.extend(f"{prefix}{field}: {problem}" for field, problem in cause.problems)
            continue
        loc = loc or "spec"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        msg = msg.removeprefix("Value error, ")
        out.append(f"{loc}: {msg}")
    return out


def parse_spec(data: Any) -> JobSpec:
    """Validate a mapping into a JobSpec, raising SpecError with field-named messages."""
    if not isinstance(data, dict):
        raise SpecError([f"spec: expected a mapping of fields, got {type(data).__name__}"])
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err)) from None


def load_spec(path: str | Path) -> JobSpec:
    """Read a YAML (or JSON) config file into a JobSpec. Errors do not repeat the path:
    the callers (the CLI commands) name the file once, before any error."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise SpecError([f"cannot read config ({err.strerror})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpecError([f"not valid YAML ({err})".replace("\n", " ")]) from None
    return parse_spec(data)


# What a spec sent to the service may name ------------------------------------------------
# A spec submitted over REST runs on the operator's cluster, not in its sender's process: its
# import paths are code the cluster's processes import and call, and its paths are files they
# read and write. The service checks it against a SubmitPolicy from its settings before
# storing or launching it; `dynabatch run` is the user's own process and checks none of this.
ANY_MODULE = "*"


@dataclass(frozen=True)
class SubmitPolicy:
    """What the operator lets a submitted spec name. The default allows nothing.

    ``user_code_modules``: module prefixes that import paths may use (``"pkg"`` allows
    ``pkg`` and ``pkg.sub``, not ``pkgx``), or ``"*"`` for any module. ``data_roots``: the
    directories ``dataset.path`` must resolve under. ``checkpoint_root``: the directory
    ``checkpoint.dir`` must resolve under. ``code_root``: where the service stores uploaded
    code (POST /v1/code); a ``working_dir`` of ``file://`` or ``local://`` must be under it.
    """

    user_code_modules: tuple[str, ...] = ()
    data_roots: tuple[str, ...] = ()
    checkpoint_root: str | None = None
    code_root: str | None = None


class SpecNotAllowed(ValueError):
    """A valid spec that names what the service does not allow, as (field, problem) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{field}: {problem}" for field, problem in problems))


def module_allowed(module: str, allowed: Iterable[str]) -> bool:
    """Whether ``module`` is one of the ``allowed`` prefixes or below one (``*``: any)."""
    return any(a == ANY_MODULE or module == a or module.startswith(a + ".") for a in allowed)


URI_PATTERN = r"^[A-Za-z][A-Za-z0-9+.-]*://"
# URIs whose path is on the nodes' own disks: the service only names its own uploads.
_NODE_PATH_SCHEMES = ("file", "local")


def working_dir_problem(value: str, code_root: str | None) -> str | None:
    """Why a submitted ``working_dir`` may not be used (None when it may). Shipped code is
    a URI: one of the service's own uploads (``file://`` under ``code_root``) or code that
    Ray fetches from elsewhere (``gcs://``, ``https://``...). A plain path would make the
    service read its own disk on the sender's behalf."""
    if not re.match(URI_PATTERN, value):
        return (f"{value!r} is a local path: upload the directory instead (`dynabatch submit "
                "--working-dir DIR` does, through POST /v1/code) or name a URI Ray can fetch")
    scheme, _, rest = value.partition("://")
    if scheme.lower() not in _NODE_PATH_SCHEMES:
        return None
    roots = () if code_root is None else (code_root,)
    return path_problem(rest, roots, "shipped code on the nodes' disks (DYNABATCH_CODE_ROOT)")


def check_user_code(spec: JobSpec, allowed: Iterable[str],
                    code_root: str | None = None) -> list[tuple[str, str]]:
    """(field, problem) for each import path in ``spec`` whose module is not ``allowed``, and
    for a ``working_dir`` the service may not ship."""
    allowed = tuple(allowed)
    problems = []
    named = [("dataset.name", spec.dataset.name), ("model.name", spec.model.name)]
    if spec.loss:
        named.append(("loss", spec.loss))
    named += [(f"metrics.{i}", m) for i, m in enumerate(spec.metrics or ())]
    if spec.working_dir is not None and ANY_MODULE not in allowed:
        # Shipped code may shadow any module, allowed ones included: only with "*".
        problems.append(("working_dir", "shipping code with the job is not allowed: this "
                         "service allows no user code from any module (needs "
                         "DYNABATCH_USER_CODE_MODULES='*')"))
    elif spec.working_dir is not None:
        why = working_dir_problem(spec.working_dir, code_root)
        if why:
            problems.append(("working_dir", why))
    for field, name in named:
        if not re.match(IMPORT_PATH_PATTERN, name):
            continue  # a built-in
        module = name.partition(":")[0]
        if module_allowed(module, allowed):
            continue
        if allowed:
            why = f"import paths are allowed only from the modules {', '.join(allowed)}"
        else:
            why = "this service runs no user code (import paths are not allowed)"
        problems.append((field, f"{name!r} is not allowed: {why}"))
    return problems


def path_problem(value: str, roots: Iterable[str], what: str) -> str | None:
    """Why ``value`` does not resolve (symlinks and ``..`` included) under one of ``roots``;
    None when it does. Relative paths are refused: the nodes that use them have another
    working directory than the service that checks them."""
    roots = tuple(roots)
    if not roots:
        return f"not allowed: this service accepts no {what}"
    if not Path(value).is_absolute():
        return f"{value!r} must be an absolute path"
    try:
        resolved = Path(value).resolve()
        allowed = [Path(root).resolve() for root in roots]
    except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, a NUL byte
        return f"{value!r} cannot be resolved ({' '.join(str(err).split())})"
    if any(resolved == root or resolved.is_relative_to(root) for root in allowed):
        return None
    return f"{value!r} is outside the allowed directories ({', '.join(roots)})"


def check_paths(
    spec: JobSpec, data_roots: Iterable[str], checkpoint_root: str | None
) -> list[tuple[str, str]]:
    """(field, problem) for ``dataset.path`` outside ``data_roots`` and ``checkpoint.dir``
    outside ``checkpoint_root``."""
    problems = []
    if spec.dataset.path is not None:
        why = path_problem(spec.dataset.path, data_roots, "dataset paths")
        if why:
            problems.append(("dataset.path", why))
    if spec.checkpoint.dir:  # "" means no checkpoints, as everywhere else
        roots = () if checkpoint_root is None else (checkpoint_root,)
        why = path_problem(spec.checkpoint.dir, roots, "checkpoint directories")
        if why:
            problems.append(("checkpoint.dir", why))
    return problems


def check_submission(spec: JobSpec, policy: SubmitPolicy) -> list[tuple[str, str]]:
    """Everything ``spec`` names that ``policy`` does not allow; empty when it may run."""
    return [
        *check_user_code(spec, policy.user_code_modules, policy.code_root),
        *check_paths(spec, policy.data_roots, policy.checkpoint_root),
    ]

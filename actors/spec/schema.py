"""The job specification: one schema for YAML configs, the REST API and the CLI.

Every field is validated here (each section in :mod:`dynabatch.actors.spec.sections`), so bad
input is rejected before any Ray work starts, with a message that names the field. Invalid
*combinations* are the rules of :mod:`dynabatch.actors.spec.validation`; reading a file or a
mapping into a ``JobSpec`` with one-line errors is :mod:`dynabatch.actors.spec.loading`.

What a *valid* spec may name when it comes from a REST client (user code, dataset paths,
checkpoint dirs) is the service's decision, not the schema's: see
:mod:`dynabatch.service.submit_policy`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from dynabatch.actors.spec.sections import (
    BUILTIN_LOSSES,
    ArtifactsSpec,
    BatchScheduleSpec,
    CheckpointSpec,
    CompileSpec,
    DatasetSpec,
    EarlyStoppingSpec,
    EmulationSpec,
    EvaluationSpec,
    IsgdSpec,
    MetricSpec,
    ModelSpec,
    OptimizerSpec,
    ProtocolSpec,
    RebalanceSpec,
    TrackingSpec,
    _known,
    _Strict,
)
from dynabatch.actors.spec.validation import CombinationError, check_combinations
from pydantic import ConfigDict, Field, StrictInt, field_validator, model_validator

POLICIES = ("static", "dbs", "affine")
MAX_WORKERS = 4096
MAX_PRIORITY = 1000


class JobSpec(_Strict):
    """A training job. The same schema is used by YAML configs, ``POST /v1/jobs`` and the CLI."""

    model_config = ConfigDict(  # extra="forbid" and frozen, as every section (_Strict)
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
    loss: Annotated[str, _known("loss", BUILTIN_LOSSES)] | None = Field(
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
    metrics: list[MetricSpec] | None = Field(
        default=None, max_length=16,
        description="Evaluation metrics on the held-out set, each {name, fn} or just fn: "
        "accuracy, mse, perplexity; over the whole held-out set across workers: f1, "
        "precision, recall ({fn: f1, average: macro|micro|weighted}), confusion_matrix, "
        "auroc, mae, rmse, r2; or 'pkg.mod:name' (a function (outputs, targets) -> one value "
        "per sample, averaged, or a torchmetrics.Metric subclass), shown by its name "
        "(default: the function's name). Default: from the loss (cross_entropy: accuracy, "
        "next_token: perplexity and accuracy, mse: mse).",
        examples=[["accuracy", "f1", {"name": "f1_weighted", "fn": "f1",
                                      "average": "weighted"}, "confusion_matrix"]],
    )
    schedule: BatchScheduleSpec = Field(default_factory=BatchScheduleSpec)
    isgd: IsgdSpec = Field(default_factory=IsgdSpec)
    workers: int | Literal["auto"] = Field(
        default=2, description="Number of workers, or 'auto' for one per eligible node."
    )
    min_workers: StrictInt | None = Field(default=None, ge=1, le=MAX_WORKERS)
    max_workers: StrictInt | None = Field(default=None, ge=1, le=MAX_WORKERS)
    priority: StrictInt = Field(
        default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY,
        description="The job's place in the cluster scheduler's queue: a higher priority is "
        "never queued behind a lower one; equal priorities go in submit order.",
    )
    worker_cpus: float = Field(default=1.0, gt=0.0, le=1024.0)
    worker_gpus: Annotated[float, Field(ge=0.0, le=64.0)] | Literal["auto"] = Field(
        default=0.0,
        description="GPUs per worker (> 0: every worker on a GPU; at most 1: a worker drives "
        "one device), or 'auto': one GPU where a node has one and the CPU elsewhere, in one "
        "job (gloo across them). NCCL when every worker has a GPU of its own; a fraction "
        "(0.5: two workers share a GPU) makes workers that share one use gloo.",
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
    precision: Literal["fp32", "tf32", "bf16", "fp16"] = Field(
        default="fp32",
        description="Arithmetic of forward and backward. fp32: full precision; tf32: fp32 "
        "with TF32 matmuls and convolutions on CUDA GPUs (ignored on the CPU); bf16 or fp16: "
        "autocast (the weights, gradients and all-reduce stay fp32). fp16 scales the loss "
        "dynamically: a step whose all-reduced gradient is not finite is skipped by every "
        "worker and the scale halved.")
    channels_last: bool = Field(
        default=False,
        description="Keep the model and its 4-D (image) inputs in torch.channels_last "
        "memory format, which convolutions on recent GPUs (tensor cores) run faster in. "
        "Ignored, with a warning from the worker, where the inputs are not 4-D.")
    compile: CompileSpec | None = Field(
        default=None,
        description="torch.compile the model in every worker: {mode, dynamic, backend}. "
        "Off by default: compiling costs seconds to minutes at each worker's start.",
        examples=[{"mode": "default", "dynamic": True}])
    epochs: StrictInt = Field(default=3, ge=1, le=100_000)
    # dbs by default, affine with `rebalance: adaptive`: docs/benchmarks.md, "Default policy".
    policy: Literal["static", "dbs", "affine"] = "dbs"
    rebalance: RebalanceSpec = Field(default_factory=RebalanceSpec)
    seed: StrictInt = Field(default=0, ge=0, le=2**31 - 1)
    emulation: EmulationSpec = Field(default_factory=EmulationSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    early_stopping: EarlyStoppingSpec | None = Field(
        default=None,
        description="End the job SUCCEEDED once a held-out metric has stopped improving: "
        "{metric, mode: min|max, patience, min_delta}.")
    evaluation: EvaluationSpec = Field(
        default_factory=EvaluationSpec,
        description="When the test set is scored: {test_every_epoch} (with "
        "dataset.validation).")
    artifacts: ArtifactsSpec = Field(
        default_factory=ArtifactsSpec,
        description="Where the trained model (safetensors and a manifest) goes at the end.")
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec,
        description="Experiment tracking: {tensorboard: DIR} writes TensorBoard event files.")
    protocol: ProtocolSpec = Field(default_factory=ProtocolSpec)
    collective_timeout_s: float = Field(
        default=10.0, gt=0.0, le=3600.0,
        description="How long a collective (a step's all-reduce, the state broadcast) may "
        "wait for a peer before it fails.")
    join_timeout_s: float | None = Field(
        default=None, gt=0.0, le=3600.0,
        description="How long joining the group may take: reaching the store, waiting for "
        "every member and, on NCCL, creating the communicator; a peer missing longer fails "
        "the join. Default: collective_timeout_s.")
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
        "the job fails with that error; likewise of evaluations whose shard failed on a live "
        "worker (a metric that raises), counted in a row.",
    )

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, v: list[MetricSpec] | None) -> list[MetricSpec] | None:
        # Names key the records' test_metrics and label /metrics: unique. Reported as
        # metrics.<i>.name (format_validation_error expands a CombinationError).
        first: dict[str, int] = {}
        problems = []
        for i, m in enumerate(v or ()):
            j = first.setdefault(m.name, i)
            if j != i:
                problems.append((f"{i}.name", f"{m.name!r} is already the name of metrics.{j}"
                                 f" ({v[j].fn}): give one of them another name"))
        if problems:
            raise CombinationError(problems)
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
        check_combinations(self)  # raises every invalid combination at once; warns
        return self

    # Helpers for the coordinator and the cluster scheduler ------------------------------------
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

    @property
    def join_timeout(self) -> float:
        """Seconds a join may take (``join_timeout_s``; default ``collective_timeout_s``)."""
        return self.join_timeout_s or self.collective_timeout_s

    def gpus_on(self, node_gpus: float) -> float:
        """GPUs a worker asks for on a node offering ``node_gpus``."""
        if self.worker_gpus == "auto":
            return 1.0 if node_gpus >= 1.0 else 0.0
        return self.worker_gpus

    def workers_on(self, resources: Mapping[str, float]) -> int:
        """How many of the job's workers a node offering ``resources`` (Ray's totals) holds
        at once: its CPUs and the GPUs a worker asks for there, 0 without the job's
        ``node_resource`` or, for a job that needs a GPU on every worker, without one."""
        gpus = resources.get("GPU", 0.0)
        # Every worker must be on a GPU (device: cuda, or GPUs asked for each worker).
        needs_gpu = self.device == "cuda" or (self.worker_gpus != "auto" and self.worker_gpus > 0)
        if needs_gpu and self.gpus_on(gpus) <= 0:
            return 0
        if self.node_resource and resources.get(self.node_resource, 0.0) <= 0:
            return 0
        return self.room_in(resources, gpus)

    def room_in(self, left: Mapping[str, float], node_gpus: float) -> int:
        """How many of the job's workers fit in ``left`` (a node's CPUs and GPUs not yet
        reserved) on a node offering ``node_gpus`` in all: a worker's GPU ask follows the
        node's total, not what is left. The one rule for Ray's runtime and the simulator."""
        # The epsilon: 0.1 CPU x 3 must fit on 0.3 CPUs.
        n = int(left.get("CPU", 0.0) / self.worker_cpus + 1e-9)
        want = self.gpus_on(node_gpus)
        return min(n, int(left.get("GPU", 0.0) / want + 1e-9)) if want > 0 else n

    @property
    def emulated(self) -> bool:
        e = self.emulation
        return bool(e.slowdowns or e.disturbances)


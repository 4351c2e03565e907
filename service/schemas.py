"""Response (and small request) models of the REST API, with OpenAPI examples.

Job data reuses the coordinator's types (``JobSnapshot``, ``EpochRecord``, ``LogLine``) so the
REST view, the CLI and the metrics read the same fields.
"""

from __future__ import annotations

from typing import Any

from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine
from dynabatch.service.cluster_client import NodeStatus
from dynabatch.service.store import JobRecord
from pydantic import BaseModel, ConfigDict, Field

JOB_ID_EXAMPLE = "3f9c1a7b2e04"

_WORKER_EXAMPLE = {
    "worker": "w0",
    "node": "10.0.0.5",
    "rank": 0,
    "batch": 40,
    "partition": 898,
    "throughput": 5210.4,
    "compute_s_per_step": 0.0077,
    "wait_s_per_step": 0.0012,
    "slowdown": 1.0,
}

_SNAPSHOT_EXAMPLE: dict[str, Any] = {
    "job_id": JOB_ID_EXAMPLE,
    "name": "digits-hetero",
    "state": "RUNNING",
    "reason": None,
    "epoch": 2,
    "step": 11,
    "steps_per_epoch": 23,
    "epochs": 5,
    "generation": 0,
    "policy": "affine",
    "emulated": True,
    "workers": [_WORKER_EXAMPLE, {**_WORKER_EXAMPLE, "worker": "w1", "rank": 1, "batch": 24}],
    "train_loss": 0.412,
    "test_accuracy": 0.913,
    "utilization": 0.87,
    "compute_balance": 0.95,
    "rebalances_total": 1,
    "epochs_completed": 2,
    "epoch_durations_s": [1.9, 1.4],
    "worker_events": {},
    "regroup_seconds_total": 0.0,
    "retried_samples_total": 0,
    "started_at": 1767225600.0,
    "finished_at": None,
}


def progress(snap: JobSnapshot, epochs: int) -> str:
    """Where a job is, as every view shows it (``list``, ``status``, the page): live, the
    epoch it is in, counted from 1 (``epoch 2/60``); finished, the epochs it completed
    (``19 of 60 epochs completed``)."""
    if snap.state.is_terminal:
        return f"{snap.epochs_completed} of {epochs} epochs completed"
    return f"epoch {min(snap.epoch + 1, epochs) if epochs else snap.epoch}/{epochs}"


_PROGRESS = Field(default="", description="Where the job is: 'epoch 2/5' while live (the "
                  "epoch it is in, from 1), '3 of 5 epochs completed' once finished.")


class ErrorResponse(BaseModel):
    detail: str = Field(examples=["job '3f9c1a7b2e04' not found"])


class FieldError(BaseModel):
    loc: list[str | int] = Field(description="Where the problem is, e.g. ['body', 'epochs'].")
    field: str = Field(description="The field, dotted, e.g. 'rebalance.mode'.")
    msg: str = Field(description="What is wrong with it.")
    type: str


class ValidationErrorResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "example": {
                "detail": [
                    {
                        "loc": ["body", "global_batch"],
                        "field": "global_batch",
                        "msg": "Input should be greater than or equal to 1",
                        "type": "greater_than_equal",
                    }
                ]
            }
        }
    )

    detail: list[FieldError]


class JobSubmitted(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "example": {
                "job_id": JOB_ID_EXAMPLE,
                "name": "digits-hetero",
                "state": "PENDING",
                "reason": "submitted; the coordinator is starting",
                "warnings": [],
            }
        }
    )

    job_id: str
    name: str
    state: JobState
    reason: str | None = None
    warnings: list[str] = Field(
        default_factory=list, description="Accepted settings that have no effect."
    )


class JobSummary(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "example": {
                "job_id": JOB_ID_EXAMPLE,
                "name": "digits-hetero",
                "state": "RUNNING",
                "reason": None,
                "policy": "affine",
                "epoch": 2,
                "epochs": 5,
                "step": 11,
                "progress": "epoch 3/5",
                "workers": 2,
                "created_at": 1767225590.0,
                "updated_at": 1767225612.5,
                "finished_at": None,
            }
        }
    )

    job_id: str
    name: str
    state: JobState
    reason: str | None = None
    policy: str
    epoch: int
    epochs: int
    step: int
    progress: str = _PROGRESS
    workers: int = Field(description="Workers in the group that trains now (a worker that is "
                         "up but joins at the next step boundary is not counted yet).")
    created_at: float
    updated_at: float
    finished_at: float | None = None

    @classmethod
    def of(cls, rec: JobRecord) -> JobSummary:
        snap = rec.current_snapshot()
        epochs = snap.epochs or rec.spec.epochs
        return cls(
            job_id=rec.id,
            name=rec.name,
            state=rec.state,
            reason=rec.reason,
            policy=rec.spec.policy,
            epoch=snap.epoch,
            epochs=epochs,
            step=snap.step,
            progress=progress(snap, epochs),
            workers=snap.group_size,
            created_at=rec.created_at,
            updated_at=rec.updated_at,
            finished_at=rec.finished_at,
        )


class JobList(BaseModel):
    items: list[JobSummary]
    total: int = Field(description="Jobs matching the filter, over all pages.")
    offset: int
    limit: int


class JobDetail(JobSnapshot):
    """The job's latest snapshot (per-worker allocation and telemetry) and its spec."""

    model_config = ConfigDict(
        frozen=True,
        json_schema_extra={
            "example": {
                **_SNAPSHOT_EXAMPLE,
                "created_at": 1767225590.0,
                "updated_at": 1767225612.5,
                "resumes": 0,
                "progress": "epoch 3/5",
                "spec": JobSpec.model_config["json_schema_extra"]["examples"][0],  # type: ignore[index]
            }
        },
    )

    created_at: float
    updated_at: float
    resumes: int = Field(
        default=0, description="Times the job was resumed from its checkpoint by a new coordinator."
    )
    spec: JobSpec
    progress: str = _PROGRESS

    @classmethod
    def of(cls, rec: JobRecord) -> JobDetail:
        snap = rec.current_snapshot()
        return cls(
            **snap.model_dump(),
            progress=progress(snap, snap.epochs or rec.spec.epochs),
            created_at=rec.created_at,
            updated_at=rec.updated_at,
            resumes=rec.resumes,
            spec=rec.spec,
        )


class JobHistory(BaseModel):
    job_id: str
    records: list[EpochRecord] = Field(description="One record per finished epoch, in order.")


class JobLogs(BaseModel):
    job_id: str
    lines: list[LogLine]
    next_since: int = Field(description="Pass as ?since= to get only newer lines.")


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"example": {"reason": "oops"}})

    reason: str = Field(default="cancelled by user", min_length=1, max_length=500)


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"example": {"workers": 3}})

    workers: int = Field(
        ge=1,
        le=4096,
        description="Run the job with exactly this many workers from its next step boundary.",
    )


class CodeUploaded(BaseModel):
    model_config = ConfigDict(json_schema_extra={"example": {
        "working_dir": "file:///data/code/9f2c...e1.zip", "sha256": "9f2c...e1",
        "bytes": 2048, "files": 3}})

    working_dir: str = Field(description="Name this as the job spec's working_dir.")
    sha256: str = Field(description="Of the zip: the same code gives the same URI.")
    bytes: int
    files: int


class NodeList(BaseModel):
    nodes: list[NodeStatus]


class Health(BaseModel):
    status: str = Field(examples=["ok"])


class Readiness(BaseModel):
    status: str = Field(examples=["ready", "unavailable"])
    ray: str = Field(description="Ray address, or 'local' for the embedded cluster.")
    embedded: bool

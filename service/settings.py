"""Service settings, read from the environment with the ``DYNABATCH_`` prefix.

``DYNABATCH_RAY_ADDRESS`` (or Ray's own ``RAY_ADDRESS``) selects an existing Ray cluster;
unset, the service starts an embedded local Ray that lives and dies with the API process.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from dynabatch.actors.spec import MODULE_PATTERN
from dynabatch.service.submit_policy import ANY_MODULE, SubmitPolicy
from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def split_list(value: str) -> tuple[str, ...]:
    """The entries of a comma-separated setting, stripped; empty entries dropped."""
    return tuple(part.strip() for part in value.split(",") if part.strip())


def settings_problems(err: ValidationError) -> list[str]:
    """Every problem of a settings validation, each naming its environment variable:
    ``code_root (DYNABATCH_CODE_ROOT): 'code' is not an absolute path``. Pydantic validates
    every field before it raises, so an operator sees all of them at once, not one per
    restart."""
    out = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "settings"
        name = f"{field} (DYNABATCH_{field.upper()})" if field in Settings.model_fields else field
        msg = str(e["msg"]).removeprefix("Value error, ")
        out.append(f"{name}: {msg}")
    return out


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="DYNABATCH_", extra="ignore", populate_by_name=True, frozen=True
    )

    host: str = Field(default="127.0.0.1", description="Interface uvicorn binds to.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port uvicorn listens on.")
    ray_address: str | None = Field(
        default=None,
        validation_alias=AliasChoices("DYNABATCH_RAY_ADDRESS", "RAY_ADDRESS", "ray_address"),
        description="Address of an existing Ray cluster; unset or 'local' for embedded Ray.",
    )
    ray_num_cpus: int | None = Field(
        default=None, ge=1, description="CPUs of the embedded Ray (default: all)."
    )
    db_path: str = Field(default="dynabatch.db", description="SQLite file for jobs and history.")
    api_token: SecretStr | None = Field(
        default=None, description="When set, job data and mutations need 'Bearer <token>'."
    )
    auth_health: bool = Field(default=False, description="/healthz and /readyz need the token.")
    auth_metrics: bool = Field(default=False, description="/metrics needs the token.")
    max_body_bytes: int = Field(default=1_048_576, ge=1, description="Larger bodies get 413.")
    sync_interval_s: float = Field(
        default=1.0, ge=0.0, description="How often live jobs are polled; 0 disables the loop."
    )
    ray_call_timeout_s: float = Field(
        default=10.0, gt=0.0, description="Timeout of one call to a coordinator actor."
    )
    metrics_retention_s: float = Field(
        default=3600.0,
        ge=0.0,
        description="Finished jobs keep their per-job series in /metrics this long.",
    )
    cancel_wait_s: float = Field(
        default=5.0, ge=0.0, le=60.0, description="How long a cancel waits for the job to stop."
    )
    release_finished: bool = Field(
        default=True,
        description="Kill a finished job's detached coordinator once its results are stored.",
    )
    auto_resume_limit: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="Automatic resumes of a job from its checkpoint without it finishing an "
        "epoch in between, before it is marked FAILED; 0 turns automatic resume off.",
    )
    log_level: str = Field(default="info", description="uvicorn and service log level.")
    # The cluster scheduler (dynabatch.scheduler.core.cluster): which nodes each job trains on.
    cluster_policy: Literal["fifo", "fair", "goodput"] = Field(
        default="goodput",
        description="How the cluster scheduler shares nodes between jobs: fifo (submit order, "
        "by priority), fair (max-min fairness on normalised throughput) or goodput (the most "
        "total normalised throughput, a job may span node types).",
    )
    cluster_round_s: float = Field(
        default=30.0, gt=0.0, le=86400.0,
        description="Seconds between the cluster scheduler's rounds (it also decides when a "
        "job is submitted or finishes and when a node joins or is lost).",
    )
    cluster_hold_s: float = Field(
        default=120.0, ge=0.0, le=86400.0,
        description="A job keeps its nodes at least this long between resizes (a lost node "
        "overrides it).",
    )
    cluster_scheduler: bool = Field(
        default=True,
        description="Run the cluster scheduler: submitted jobs queue and train on the nodes "
        "it grants them (resized at step boundaries). Off (0), each job starts at once and "
        "Ray's wait for resources is the only arbiter.",
    )
    # What specs submitted over REST may name (see dynabatch.service.submit_policy). Comma
    # lists are plain strings: pydantic-settings would try to JSON-decode a list from the env.
    user_code_modules: str = Field(
        default="",
        description="Comma-separated module prefixes that import paths in submitted specs may "
        "use ('pkg' allows pkg and pkg.sub), or '*' for any; empty: none.",
    )
    data_roots: str = Field(
        default="",
        description="Comma-separated directories that a submitted dataset.path must resolve "
        "under; empty: no dataset paths.",
    )
    checkpoint_root: str | None = Field(
        default=None,
        description="Directory (absolute) or URI (s3://bucket/checkpoints) that a submitted "
        "checkpoint.dir must resolve under; unset: no checkpoint directories.",
    )
    artifact_root: str | None = Field(
        default=None,
        description="Directory (absolute) or URI (s3://bucket/models) that a submitted "
        "artifacts.dir (and a local tracking.tensorboard) must resolve under; unset: no "
        "artifacts or tracking directories (the service then keeps each job's trained model "
        "beside its database, under models/).",
    )
    code_root: str | None = Field(
        default=None,
        description="Directory where code uploaded with POST /v1/code (dynabatch submit "
        "--working-dir) is stored, as zips every Ray node reads at the same path (a disk "
        "they share); unset: no uploads. Uploads also need DYNABATCH_USER_CODE_MODULES='*'.",
    )
    max_code_bytes: int = Field(
        default=64 * 2**20, ge=1,
        description="Largest code upload (a zip, POST /v1/code); larger ones get 413.",
    )

    @field_validator("user_code_modules")
    @classmethod
    def _modules(cls, v: str) -> str:
        for entry in split_list(v):
            if entry != ANY_MODULE and not re.match(MODULE_PATTERN, entry):
                raise ValueError(f"{entry!r} is not a module name (pkg or pkg.sub) nor '*'")
        return v

    @field_validator("data_roots")
    @classmethod
    def _data_roots(cls, v: str) -> str:
        for entry in split_list(v):
            if not Path(entry).is_absolute():
                raise ValueError(f"{entry!r} is not an absolute path")
        return v

    @field_validator("code_root", mode="before")
    @classmethod
    def _absolute_dir(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip() or None  # an empty variable is unset
        if v is not None and not Path(v).is_absolute():
            raise ValueError(f"{v!r} is not an absolute path")
        return v

    @field_validator("artifact_root", "checkpoint_root", mode="before")
    @classmethod
    def _absolute_dir_or_uri(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip() or None  # an empty variable is unset
        if v is not None and "://" not in v and not Path(v).is_absolute():
            raise ValueError(f"{v!r} is not an absolute path nor a URI")
        return v

    @property
    def submit_policy(self) -> SubmitPolicy:
        """What specs submitted to this service may name."""
        return SubmitPolicy(
            user_code_modules=split_list(self.user_code_modules),
            data_roots=split_list(self.data_roots),
            checkpoint_root=self.checkpoint_root,
            code_root=self.code_root,
            artifact_root=self.artifact_root,
        )

    @property
    def token(self) -> str | None:
        if self.api_token is None:
            return None
        return self.api_token.get_secret_value() or None

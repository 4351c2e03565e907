"""Service settings, read from the environment with the ``DYNABATCH_`` prefix.

``DYNABATCH_RAY_ADDRESS`` (or Ray's own ``RAY_ADDRESS``) selects an existing Ray cluster;
unset, the service starts an embedded local Ray that lives and dies with the API process.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

EMBEDDED_ADDRESSES = frozenset({"", "local"})


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

    @property
    def embedded(self) -> bool:
        """True when the service starts its own Ray (which ends with the API process)."""
        return self.ray_address is None or self.ray_address.strip() in EMBEDDED_ADDRESSES

    @property
    def token(self) -> str | None:
        if self.api_token is None:
            return None
        return self.api_token.get_secret_value() or None

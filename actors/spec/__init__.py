"""The job specification: one schema for YAML configs, the REST API and the CLI. The
names callers use are re-exported here (``from dynabatch.actors.spec import JobSpec``)."""

from dynabatch.actors.spec.loading import (
    SpecError,
    load_spec,
    parse_spec,
    spec_warnings_caught,
)
from dynabatch.actors.spec.schema import MAX_WORKERS, POLICIES, JobSpec
from dynabatch.actors.spec.sections import (
    IMPORT_PATH_PATTERN,
    MODULE_PATTERN,
    URI_PATTERN,
    ArtifactsSpec,
    CheckpointSpec,
    DatasetSpec,
    EmulationSpec,
    MetricSpec,
    ModelSpec,
    SpecWarning,
    StageSpec,
    TrackingSpec,
)

__all__ = [
    "IMPORT_PATH_PATTERN",
    "MAX_WORKERS",
    "MODULE_PATTERN",
    "POLICIES",
    "URI_PATTERN",
    "ArtifactsSpec",
    "CheckpointSpec",
    "DatasetSpec",
    "EmulationSpec",
    "JobSpec",
    "MetricSpec",
    "ModelSpec",
    "SpecError",
    "SpecWarning",
    "StageSpec",
    "TrackingSpec",
    "load_spec",
    "parse_spec",
    "spec_warnings_caught",
]

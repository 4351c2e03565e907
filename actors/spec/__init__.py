"""The job specification: one schema for YAML configs, the REST API and the CLI.

- :mod:`~dynabatch.actors.spec.sections`: the spec's sections (``dataset:``, ``model:``, ...)
  and the grammar of the names it may use;
- :mod:`~dynabatch.actors.spec.schema`: ``JobSpec``, the job itself;
- :mod:`~dynabatch.actors.spec.validation`: the rules across fields;
- :mod:`~dynabatch.actors.spec.loading`: a mapping or a YAML file into a ``JobSpec``, with
  one-line ``SpecError``\\ s.

The names callers use are re-exported here (``from dynabatch.actors.spec import JobSpec``).
What a spec submitted over REST may name is the service's policy:
:mod:`dynabatch.service.submit_policy`.
"""

from dynabatch.actors.spec.loading import (
    SpecError,
    format_validation_error,
    load_spec,
    parse_spec,
    spec_warnings_caught,
    spec_warnings_silenced,
)
from dynabatch.actors.spec.schema import MAX_WORKERS, POLICIES, JobSpec
from dynabatch.actors.spec.sections import (
    BUILTIN_DATASETS,
    BUILTIN_LOSSES,
    BUILTIN_METRICS,
    BUILTIN_MODELS,
    IMPORT_PATH_PATTERN,
    METRIC_NAME_PATTERN,
    MODULE_PATTERN,
    URI_PATTERN,
    ArtifactsSpec,
    BatchScheduleSpec,
    CheckpointSpec,
    CompileSpec,
    DatasetSpec,
    Disturbance,
    EmulationSpec,
    EvaluationSpec,
    IsgdSpec,
    LrScheduleSpec,
    MetricSpec,
    ModelSpec,
    OptimizerSpec,
    ProtocolSpec,
    RebalanceSpec,
    SpecWarning,
    StageSpec,
    TrackingSpec,
)

__all__ = [
    "BUILTIN_DATASETS",
    "BUILTIN_LOSSES",
    "BUILTIN_METRICS",
    "BUILTIN_MODELS",
    "IMPORT_PATH_PATTERN",
    "MAX_WORKERS",
    "METRIC_NAME_PATTERN",
    "MODULE_PATTERN",
    "POLICIES",
    "URI_PATTERN",
    "ArtifactsSpec",
    "BatchScheduleSpec",
    "CheckpointSpec",
    "CompileSpec",
    "DatasetSpec",
    "Disturbance",
    "EmulationSpec",
    "EvaluationSpec",
    "IsgdSpec",
    "JobSpec",
    "LrScheduleSpec",
    "MetricSpec",
    "ModelSpec",
    "OptimizerSpec",
    "ProtocolSpec",
    "RebalanceSpec",
    "SpecError",
    "SpecWarning",
    "StageSpec",
    "TrackingSpec",
    "format_validation_error",
    "load_spec",
    "parse_spec",
    "spec_warnings_caught",
    "spec_warnings_silenced",
]

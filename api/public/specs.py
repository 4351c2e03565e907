"""A job spec as the Python API takes it: a :class:`JobSpec`, a mapping, or a config file.

``Client.submit`` and ``dynabatch.run`` read it as ``dynabatch submit`` and ``dynabatch run``
read a config (:mod:`dynabatch.api.cli.config`): a local ``working_dir`` made absolute and
checked, and the spec validated, before anything is sent or started. Every problem is one
:class:`SpecError` line naming the field (and the file, for a config file).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, TypeAlias

from dynabatch.actors.spec import JobSpec, SpecError, SpecWarning, spec_warnings_caught
from dynabatch.api.cli.common import CliError
from dynabatch.api.cli.config import mapping_config, read_config

# What the Python API accepts as a job: a spec, its fields, or a YAML (or JSON) file's path.
SpecLike: TypeAlias = JobSpec | dict[str, Any] | str | os.PathLike[str]


def resolve_spec(
    spec: SpecLike, *, working_dir: str | os.PathLike[str] | None = None,
    warn_at: int | None = 3,
) -> tuple[dict[str, Any], JobSpec, str]:
    """``spec`` as the mapping to send, the validated spec, and what its local
    ``working_dir`` is called in errors (the argument, or the file's field); a
    :class:`SpecError` for any problem. The spec's warnings are issued ``warn_at`` frames up
    (3: ``dynabatch.run(...)`` in the user's code), not in pydantic; None: not issued
    (``Client.submit`` issues the service's copy instead)."""
    override = Path(working_dir) if working_dir is not None else None
    what = "working_dir"
    with spec_warnings_caught() as messages:
        try:
            if isinstance(spec, str | os.PathLike):
                data, parsed = read_config(Path(spec), working_dir=override,
                                           working_dir_name="working_dir")
                what = "working_dir" if override is not None else f"{Path(spec)}: working_dir"
            elif isinstance(spec, JobSpec | dict):
                # A dict is copied: the caller's is left as it was.
                mapping = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else dict(spec)
                data, parsed = mapping_config(mapping, working_dir=override,
                                              working_dir_name="working_dir")
            else:
                raise SpecError([f"spec: expected a JobSpec, a dict of fields or a config "
                                 f"file's path, got {type(spec).__name__}"])
        except CliError as err:
            raise SpecError([str(err)]) from None
    if warn_at is not None:
        for m in messages:
            warnings.warn(m, SpecWarning, stacklevel=warn_at)
    return data, parsed, what

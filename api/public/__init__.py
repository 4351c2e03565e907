"""dynabatch: heterogeneity-aware elastic data-parallel training on Ray.

The code is in the four sub-packages (``dynabatch.api``, ``.service``, ``.scheduler``,
``.actors``; setup.py maps the repository's top-level folders onto them). This top names the
public Python API, imported on first use so that ``import dynabatch.<layer>`` stays as cheap
as it was:

* :func:`load_model` (``dynabatch.actors.export``): a trained model's directory (``dynabatch
  export ID -o DIR``, or a job's ``artifacts.dir``) back as a ``torch.nn.Module``, no Ray.
* :class:`Client` and :class:`Job` (``dynabatch.client``): a service's jobs from Python,
  as the CLI's client commands (submit, wait, status, history, logs, scale, cancel, model).
* :func:`run` and :class:`RunResult` (``dynabatch.embedded``): train a job in this process's
  Ray (or a cluster's), as ``dynabatch run``, with a progress bar.
* :class:`JobSpec` (``dynabatch.actors.spec``) and the errors: :class:`SpecError` (a bad
  spec, naming the field), :class:`ApiError` and :class:`ConnectionFailed` (the service);
  :class:`SpecWarning`, the category of a spec's accepted settings that have no effect.
"""

from __future__ import annotations

from typing import Any

_PUBLIC = {
    "load_model": "dynabatch.actors.export",
    "Client": "dynabatch.client",
    "Job": "dynabatch.client",
    "run": "dynabatch.embedded",
    "RunResult": "dynabatch.embedded",
    "JobSpec": "dynabatch.actors.spec",
    "SpecError": "dynabatch.actors.spec",
    "SpecWarning": "dynabatch.actors.spec",
    "ApiError": "dynabatch.service.rest_client",
    "ConnectionFailed": "dynabatch.service.rest_client",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'dynabatch' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

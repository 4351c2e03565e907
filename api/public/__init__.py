"""dynabatch: heterogeneity-aware elastic data-parallel training on Ray.

The code is in the four sub-packages (``dynabatch.api``, ``.service``, ``.scheduler``,
``.actors``; setup.py maps the repository's top-level folders onto them). This top names the
public Python API, imported on first use so that ``import dynabatch.<layer>`` stays as cheap
as it was:

* :func:`load_model` (``dynabatch.actors.export``): a trained model's directory (``dynabatch
  export ID -o DIR``, or a job's ``artifacts.dir``) back as a ``torch.nn.Module``, no Ray.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_model"]

_PUBLIC = {"load_model": "dynabatch.actors.export"}


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

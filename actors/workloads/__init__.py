"""Workloads: the datasets and models a job trains.

``load_dataset(spec, seed)`` gives a :class:`DatasetArrays` (normalised numpy arrays) and
``build_model(spec, input_shape, num_classes)`` a ``torch.nn.Module``. Both accept a built-in
name or a user import path ``"pkg.mod:function"``. Every problem is a :class:`WorkloadError`
whose one-line message starts with the spec field at fault (``dataset.path: ...``).

The heavy submodules (torch, scikit-learn) are imported on first use, so that importing
``WorkloadError`` (for example in the API process) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any


class WorkloadError(ValueError):
    """A dataset or model that cannot be loaded or built; the message names the spec field."""


if TYPE_CHECKING:
    from dynabatch.actors.workloads.datasets import DatasetArrays, load_dataset
    from dynabatch.actors.workloads.models import build_model

__all__ = ["DatasetArrays", "WorkloadError", "build_model", "load_dataset"]

_LAZY = {
    "DatasetArrays": "dynabatch.actors.workloads.datasets",
    "load_dataset": "dynabatch.actors.workloads.datasets",
    "build_model": "dynabatch.actors.workloads.models",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

"""Workloads: the datasets and models a job trains.

:func:`~dynabatch.actors.workloads.datasets.load_dataset` gives a ``DatasetArrays``
(normalised numpy arrays) and :func:`~dynabatch.actors.workloads.models.build_model` a
``torch.nn.Module``. Both accept a built-in name or a user import path
``"pkg.mod:function"``. Every problem is a :class:`WorkloadError` whose one-line message
starts with the spec field at fault (``dataset.path: ...``).

This package imports nothing heavy (torch, scikit-learn), so that importing
``WorkloadError`` (for example in the API process) stays cheap.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


class WorkloadError(ValueError):
    """A dataset or model that cannot be loaded or built; the message names the spec field."""


def check_option_names(field: str, name: str, options: Collection[str],
                       allowed: Collection[str], error: type[WorkloadError] = WorkloadError
                       ) -> None:
    """An ``error`` naming the first of ``options`` (``field``, of ``name``) not ``allowed``."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise error(f"{field}: unknown option {unknown[0]!r} for {name} "
                    f"(allowed: {', '.join(sorted(allowed)) or 'none'})")


def int_option(value: Any, field: str, lo: int, hi: int) -> int:
    """``value`` when it is an integer in ``[lo, hi]``, else a WorkloadError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise WorkloadError(f"{field}: must be an integer from {lo} to {hi}, got {value!r}")
    return value

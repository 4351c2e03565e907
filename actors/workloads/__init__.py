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


class WorkloadError(ValueError):
    """A dataset or model that cannot be loaded or built; the message names the spec field."""

"""How stateful metrics' states travel in a shard's evaluation sums, without torch (the
driver's evaluation bookkeeping, ``dynabatch.scheduler.sync.evaluation``, stays pure).

A shard's sums hold ``{STATES: {metric name: [payload]}}``, a payload being
``{"args", "state"}`` of numpy arrays (``dynabatch.actors.workloads.eval_metrics.Accumulator``).
:func:`merge_states` gathers the shards' payloads side by side; the metric's own
``merge_state`` (torchmetrics: sums add, lists concatenate) merges them when the scores
are computed (``dynabatch.actors.workloads.eval_metrics.compute``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

STATES = "states"


def merge_states(parts: Iterable[Mapping[str, list[Any]]]) -> dict[str, list[Any]]:
    """The shards' states side by side: ``{metric name: [payload, ...]}``."""
    out: dict[str, list[Any]] = {}
    for part in parts:
        for name, payloads in part.items():
            out.setdefault(name, []).extend(payloads)
    return out


def split_scores(scores: Mapping[str, Any]
                 ) -> tuple[dict[str, float], dict[str, list[list[float]]]]:
    """Finished scores as the epoch records keep them: the numbers, and the tables (a
    confusion matrix, a list of rows)."""
    scalars: dict[str, float] = {}
    matrices: dict[str, list[list[float]]] = {}
    for k, v in scores.items():
        if isinstance(v, list):
            matrices[k] = v
        else:
            scalars[k] = float(v)
    return scalars, matrices

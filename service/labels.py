"""Short, readable names shown for Ray nodes and metrics: the same in the CLI's tables, the
REST answers' display, the job page and the Prometheus labels.

A Ray node id is 56 hex digits; its first :data:`NODE_CHARS` name it everywhere we show it
(as ``git`` names a commit). A metric that is an import path (``pkg.mod:top5``) is shown by
its function's name, ``top5``, unless that would clash with another of the job's metrics.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from dynabatch.scheduler.telemetry import EpochRecord

NODE_CHARS = 8
_RAY_NODE_ID = re.compile(r"^[0-9a-f]{40,}$")


def node_label(node: str) -> str:
    """A Ray node id cut to its first 8 hex digits; any other name (an address, a host, a
    simulator's node) as it is."""
    return node[:NODE_CHARS] if _RAY_NODE_ID.match(node) else node


def metric_label(name: str) -> str:
    """``pkg.mod:fn`` as ``fn``; a built-in metric's name as it is."""
    return name.rpartition(":")[2] if ":" in name else name


def metric_labels(names: Iterable[str]) -> dict[str, str]:
    """Each name's label (:func:`metric_label`), the full name kept where two would clash."""
    names = list(dict.fromkeys(names))
    short = [metric_label(n) for n in names]
    return {n: (s if short.count(s) == 1 else n) for n, s in zip(names, short, strict=True)}


def relabel_metrics(record: EpochRecord) -> EpochRecord:
    """``record`` with its ``test_metrics`` keyed by label (:func:`metric_labels`)."""
    if not any(":" in k for k in record.test_metrics):
        return record
    labels = metric_labels(record.test_metrics)
    metrics = {labels[k]: v for k, v in record.test_metrics.items()}
    return record.model_copy(update={"test_metrics": metrics})

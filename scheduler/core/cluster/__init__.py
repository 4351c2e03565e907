"""The cluster scheduler's pure core: which nodes each job trains on (several jobs, one
cluster of unequal nodes). No Ray, no torch, no clock: nodes and jobs in, one
:class:`~.values.ClusterDecision` out. See docs/cluster.md."""

from dynabatch.scheduler.core.cluster.decision import decide
from dynabatch.scheduler.core.cluster.throughput import ThroughputModel, bootstrap
from dynabatch.scheduler.core.cluster.values import (
    POLICIES,
    ClusterJob,
    ClusterKnobs,
    ClusterNode,
)

__all__ = [
    "POLICIES",
    "ClusterJob",
    "ClusterKnobs",
    "ClusterNode",
    "ThroughputModel",
    "bootstrap",
    "decide",
]

"""The cluster scheduler's pure core: which nodes each job trains on (several jobs, one
cluster of unequal nodes). No Ray, no torch, no clock: nodes and jobs in, one
:class:`ClusterDecision` out. See docs/cluster.md."""

from dynabatch.scheduler.core.cluster.decision import decide
from dynabatch.scheduler.core.cluster.throughput import (
    ThroughputModel,
    bootstrap,
)
from dynabatch.scheduler.core.cluster.values import (
    POLICIES,
    ClusterDecision,
    ClusterJob,
    ClusterKnobs,
    ClusterNode,
    JobPlan,
)

__all__ = [
    "POLICIES",
    "ClusterDecision",
    "ClusterJob",
    "ClusterKnobs",
    "ClusterNode",
    "JobPlan",
    "ThroughputModel",
    "bootstrap",
    "decide",
]

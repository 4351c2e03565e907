"""Prometheus families of the cluster scheduler's last round, read at scrape time from the
same :class:`~dynabatch.scheduler.core.cluster.view.ClusterView` as ``GET /v1/cluster``.
With no scheduler running, the families are there without samples."""

from __future__ import annotations

from collections.abc import Iterator

from dynabatch.scheduler.core.cluster.view import ClusterView
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def cluster_families(view: ClusterView | None) -> Iterator[Metric]:
    queue = GaugeMetricFamily(
        "dynabatch_cluster_queue_length", "Jobs the cluster scheduler keeps waiting."
    )
    allocated = GaugeMetricFamily(
        "dynabatch_cluster_allocated_workers",
        "Workers the cluster scheduler allocates to a job on a node type.",
        labels=["job_id", "node_type"],
    )
    members = GaugeMetricFamily(
        "dynabatch_cluster_member_workers",
        "Workers a job itself last reported to the cluster scheduler (beside its allocation: "
        "they differ while workers start or drain, or when it refused an assignment).",
        labels=["job_id"],
    )
    utilization = GaugeMetricFamily(
        "dynabatch_cluster_utilization_ratio",
        "Worker slots held by jobs over the slots the nodes offer.",
    )
    resizes = CounterMetricFamily(
        "dynabatch_cluster_resizes", "Job resizes the cluster scheduler made."
    )
    if view is not None:
        queue.add_metric([], float(len(view.queue)))
        for job in view.jobs:
            for node_type, n in job.by_type:
                allocated.add_metric([job.job_id, node_type], float(n))
            if job.members is not None:
                members.add_metric([job.job_id], float(sum(k for _, k in job.members)))
        utilization.add_metric([], view.utilization)
        resizes.add_metric([], float(view.resizes))
    yield from (queue, allocated, members, utilization, resizes)

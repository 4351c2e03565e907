"""Prometheus families of parameter-server jobs (``protocol: ps``), read from the same
snapshots as the other job metrics (:class:`dynabatch.api.metrics.JobCollector`).

* ``dynabatch_ps_staleness``: histogram per learner of the staleness τ of its applied
  gradients (server versions between its pull and the update);
* ``dynabatch_ps_pushes_per_second``: gradients pushed per second over the server's last
  10 s (a rolling rate: start-up and old history do not dilute it);
* ``dynabatch_ps_gradients``: counter of gradients by ``outcome`` (applied, refused);
* ``dynabatch_ps_deferred_updates``: counter of updates put off by ``on_stale: wait``;
* ``dynabatch_ps_server_version``: updates applied so far.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from dynabatch.scheduler.telemetry import JobSnapshot
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

STALENESS_BUCKETS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128)


def _staleness_buckets(counts: dict[int, int]) -> tuple[list[tuple[str, float]], float]:
    out = []
    for bound in (*STALENESS_BUCKETS, math.inf):
        total = sum(n for tau, n in counts.items() if tau <= bound)
        out.append(("+Inf" if math.isinf(bound) else repr(float(bound)), float(total)))
    s = float(sum(tau * n for tau, n in counts.items()))
    return out, s


def ps_families(snaps: Iterable[JobSnapshot]) -> Iterator[Metric]:
    staleness = HistogramMetricFamily(
        "dynabatch_ps_staleness", "Staleness of each learner's applied gradients.",
        labels=["job_id", "worker"])
    pushes = GaugeMetricFamily(
        "dynabatch_ps_pushes_per_second", "Gradients pushed per second (last 10 s).",
        labels=["job_id"])
    grads = CounterMetricFamily(
        "dynabatch_ps_gradients", "Gradients by outcome (applied, refused).",
        labels=["job_id", "outcome"])
    deferred = CounterMetricFamily(
        "dynabatch_ps_deferred_updates", "Updates put off by on_stale: wait.",
        labels=["job_id"])
    version = GaugeMetricFamily(
        "dynabatch_ps_server_version", "Updates the server applied.", labels=["job_id"])
    for snap in snaps:
        ps = snap.ps
        if ps is None:
            continue
        job = snap.job_id
        pushes.add_metric([job], ps.pushes_per_s)
        grads.add_metric([job, "applied"], float(ps.applied))
        grads.add_metric([job, "refused"], float(ps.refused))
        deferred.add_metric([job], float(ps.deferred))
        version.add_metric([job], float(ps.version))
        for w in ps.workers:
            buckets, total = _staleness_buckets(w.staleness_counts)
            staleness.add_metric([job, w.worker], buckets, sum_value=total)
    yield from (staleness, pushes, grads, deferred, version)

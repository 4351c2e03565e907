"""Prometheus families of a job's schedule: the global batch and learning rate in force, the
goodput mode's noise-scale estimate and chosen batch, and ISGD's counters. Read from the
same :class:`~dynabatch.scheduler.telemetry.JobSnapshot` as the other job metrics; label
``job_id``."""

from __future__ import annotations

import math
from collections.abc import Iterator

from dynabatch.scheduler.telemetry import JobSnapshot
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def schedule_families(snaps: list[JobSnapshot]) -> Iterator[Metric]:
    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=["job_id"])

    def counter(name: str, doc: str) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=["job_id"])

    batch = gauge("dynabatch_job_global_batch", "The global batch in force (samples).")
    lr = gauge("dynabatch_job_learning_rate", "The learning rate of the current step.")
    noise = gauge("dynabatch_job_gradient_noise_scale",
                  "Goodput mode: estimated gradient noise scale tr(Sigma)/|grad L|^2.")
    chosen = gauge("dynabatch_job_goodput_batch", "Goodput mode: the global batch it chose.")
    flagged = counter("dynabatch_job_isgd_flagged_batches",
                      "Batches ISGD flagged as under-trained.")
    extra = counter("dynabatch_job_isgd_extra_iterations", "ISGD extra iterations.")
    for s in snaps:
        labels = [s.job_id]
        for family, value in ((batch, s.global_batch), (lr, s.lr), (noise, s.noise_scale),
                              (chosen, s.goodput_batch)):
            if value is not None and math.isfinite(value):
                family.add_metric(labels, float(value))
        flagged.add_metric(labels, float(s.isgd_flagged_total))
        extra.add_metric(labels, float(s.isgd_extra_iterations_total))
    yield from (batch, lr, noise, chosen, flagged, extra)

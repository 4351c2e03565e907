"""Prometheus metrics: a collector that reads job state at scrape time, and request metrics.

Names are exactly those of docs/architecture.md. Everything lives in the app's own
``CollectorRegistry``; nothing is registered globally. Counters are emitted without
``_created`` series, so the exposition holds the documented names and no others.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from api.schedule_metrics import schedule_families
from scheduler.state import JobState
from scheduler.telemetry import JobSnapshot
from service.jobs import JobService

REQUEST_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
EPOCH_BUCKETS: tuple[float, ...] = (
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
UNMATCHED_ROUTE = "unmatched"

WORKER_LABELS = ["job", "worker", "node"]


def _bucket_counts(values: Iterable[float], bounds: Sequence[float]) -> list[int]:
    """Per-bucket (not cumulative) counts; the last entry is the +Inf overflow."""
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1
    return counts


def _cumulative(counts: Sequence[int], bounds: Sequence[float]) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip([*bounds, math.inf], counts, strict=True):
        total += n
        out.append(("+Inf" if math.isinf(bound) else repr(float(bound)), float(total)))
    return out


class RequestStats:
    """Request counts and latencies per route template, method and status; thread-safe."""

    def __init__(self, buckets: Sequence[float] = REQUEST_BUCKETS):
        self.buckets = tuple(buckets)
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, str], int] = {}
        self._latency: dict[tuple[str, str], tuple[list[int], float]] = {}

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        method = method if method in METHODS else "OTHER"
        with self._lock:
            key = (route, method, str(status))
            self._counts[key] = self._counts.get(key, 0) + 1
            empty: tuple[list[int], float] = ([0] * (len(self.buckets) + 1), 0.0)
            counts, total = self._latency.get((route, method)) or empty
            counts[bisect.bisect_left(self.buckets, seconds)] += 1
            self._latency[(route, method)] = (counts, total + seconds)

    def families(self) -> list[Metric]:
        requests = CounterMetricFamily(
            "dynabatch_http_requests",
            "HTTP requests by route template, method and status code.",
            labels=["route", "method", "status"],
        )
        latency = HistogramMetricFamily(
            "dynabatch_http_request_duration_seconds",
            "HTTP request latency by route template and method.",
            labels=["route", "method"],
        )
        with self._lock:
            for (route, method, status), n in sorted(self._counts.items()):
                requests.add_metric([route, method, status], float(n))
            for (route, method), (counts, total) in sorted(self._latency.items()):
                latency.add_metric(
                    [route, method], _cumulative(counts, self.buckets), sum_value=total
                )
        return [requests, latency]


class RequestMetricsMiddleware:
    """Pure ASGI middleware: times each HTTP request and records it under its route template."""

    def __init__(self, app: Any, stats: RequestStats):
        self.app = app
        self.stats = stats

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
            self.stats.observe(route, scope["method"], status, time.perf_counter() - start)


class JobCollector(Collector):
    """Reads the JobService's job state at scrape time."""

    def __init__(self, service: JobService, requests: RequestStats):
        self.service = service
        self.requests = requests

    def collect(self) -> Iterator[Metric]:
        snaps = self.service.metric_snapshots()
        yield from self._job_families(snaps)
        yield from schedule_families(snaps)
        nodes = self.service.alive_nodes
        if nodes is not None:
            g = GaugeMetricFamily("dynabatch_cluster_nodes", "Alive Ray nodes.")
            g.add_metric([], float(nodes))
            yield g
        jobs = GaugeMetricFamily("dynabatch_jobs", "Jobs in the store by state.", labels=["state"])
        for state, n in self.service.job_counts().items():
            jobs.add_metric([state.value], float(n))
        yield jobs
        yield from self.requests.families()

    @staticmethod
    def _job_families(snaps: list[JobSnapshot]) -> Iterator[Metric]:
        def worker_gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=WORKER_LABELS)

        batch = worker_gauge("dynabatch_worker_batch_size", "Worker's batch size (samples).")
        partition = worker_gauge(
            "dynabatch_worker_partition_samples", "Samples in the worker's epoch partition."
        )
        throughput = worker_gauge(
            "dynabatch_worker_throughput_samples_per_second",
            "Worker's samples per compute-second.",
        )
        compute = worker_gauge(
            "dynabatch_worker_compute_seconds", "Worker's compute seconds per step."
        )
        wait = worker_gauge(
            "dynabatch_worker_wait_seconds", "Worker's all-reduce wait seconds per step."
        )

        def job_gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["job"])

        def job_counter(name: str, doc: str, labels: list[str] | None = None) -> Any:
            return CounterMetricFamily(name, doc, labels=labels or ["job"])

        info = GaugeMetricFamily(
            "dynabatch_job_info",
            "A job's name and policy (always 1).",
            labels=["job", "name", "policy"],
        )
        state = GaugeMetricFamily(
            "dynabatch_job_state",
            "1 for the job's current state, 0 for the others.",
            labels=["job", "state"],
        )
        epoch = job_gauge("dynabatch_job_epoch", "Current epoch.")
        step = job_gauge("dynabatch_job_step", "Current step within the epoch.")
        workers = job_gauge("dynabatch_job_workers", "Workers in the current allocation.")
        loss = job_gauge("dynabatch_job_train_loss", "Latest training loss.")
        accuracy = job_gauge("dynabatch_job_test_accuracy_ratio", "Latest test accuracy (0-1).")
        utilization = job_gauge(
            "dynabatch_job_utilization_ratio", "sum(compute) / (workers x wall time)."
        )
        balance = job_gauge(
            "dynabatch_job_compute_balance_ratio", "mean(compute) / max(compute) over workers."
        )
        generation = job_gauge("dynabatch_job_membership_generation", "Membership generation.")
        rebalances = job_counter("dynabatch_job_rebalances", "Allocation changes.")
        events = job_counter(
            "dynabatch_job_worker_events",
            "Worker joins, leaves and failures.",
            labels=["job", "kind", "reason"],
        )
        regroup = job_counter(
            "dynabatch_job_regroup_seconds", "Seconds spent re-forming the worker group."
        )
        retried = job_counter(
            "dynabatch_job_retried_samples", "Samples trained again after a failed step."
        )
        durations = HistogramMetricFamily(
            "dynabatch_job_epoch_duration_seconds",
            "Wall time of finished epochs.",
            labels=["job"],
        )

        for s in snaps:
            job = s.job_id
            info.add_metric([job, s.name, s.policy], 1.0)
            for st in JobState:
                state.add_metric([job, st.value], 1.0 if st == s.state else 0.0)
            epoch.add_metric([job], float(s.epoch))
            step.add_metric([job], float(s.step))
            workers.add_metric([job], float(len(s.workers)))
            generation.add_metric([job], float(s.generation))
            for family, value in (
                (loss, s.train_loss),
                (accuracy, s.test_accuracy),
                (utilization, s.utilization),
                (balance, s.compute_balance),
            ):
                if value is not None and math.isfinite(value):
                    family.add_metric([job], float(value))
            rebalances.add_metric([job], float(s.rebalances_total))
            regroup.add_metric([job], float(s.regroup_seconds_total))
            retried.add_metric([job], float(s.retried_samples_total))
            for key, n in sorted(s.worker_events.items()):
                kind, _, reason = key.partition(":")
                events.add_metric([job, kind, reason], float(n))
            durations.add_metric(
                [job],
                _cumulative(_bucket_counts(s.epoch_durations_s, EPOCH_BUCKETS), EPOCH_BUCKETS),
                sum_value=float(sum(s.epoch_durations_s)),
            )
            for w in s.workers:
                labels = [job, w.worker, w.node]
                batch.add_metric(labels, float(w.batch))
                partition.add_metric(labels, float(w.partition))
                throughput.add_metric(labels, float(w.throughput))
                compute.add_metric(labels, float(w.compute_s_per_step))
                wait.add_metric(labels, float(w.wait_s_per_step))

        yield from (batch, partition, throughput, compute, wait)
        yield from (info, state, epoch, step, workers, loss, accuracy, utilization, balance)
        yield from (rebalances, durations, generation, events, regroup, retried)

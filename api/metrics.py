"""Prometheus metrics: a collector that reads job state at scrape time, and request metrics.

Names are exactly those of docs/architecture.md. Everything lives in the app's own
``CollectorRegistry``; nothing is registered globally. Counters are emitted without
``_created`` series, so the exposition holds the documented names and no others. The job
families, those of a job's schedule and of parameter-server jobs are read from the same
snapshots; the cluster scheduler's from the same round as ``GET /v1/cluster`` (the families
are there without samples while no scheduler runs).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from dynabatch.scheduler.core.cluster.ray_nodes import node_label
from dynabatch.scheduler.core.cluster.view import ClusterView
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot
from dynabatch.service.job_service import JobService
from prometheus_client import Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

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


def _histogram(counts: Iterable[tuple[float, int]], bounds: Sequence[float]
               ) -> list[tuple[str, float]]:
    """Cumulative bucket counts of (value, how many times) pairs, ``+Inf`` last."""
    per = [0] * (len(bounds) + 1)
    for value, n in counts:
        per[bisect.bisect_left(bounds, value)] += n
    out, total = [], 0
    for bound, n in zip([*bounds, math.inf], per, strict=True):
        total += n
        out.append(("+Inf" if math.isinf(bound) else repr(float(bound)), float(total)))
    return out


class RequestStats:
    """Request counts and latencies per route template, method and status: a
    prometheus_client ``Counter`` and ``Histogram`` (thread-safe themselves), kept out of
    any registry and yielded by the app's collector with the job metrics."""

    def __init__(self) -> None:
        self.requests = Counter(
            "dynabatch_http_requests", "HTTP requests by route template, method and status code.",
            ["route", "method", "status"], registry=None,
        )
        self.latency = Histogram(
            "dynabatch_http_request_duration_seconds",
            "HTTP request latency by route template and method.",
            ["route", "method"], buckets=REQUEST_BUCKETS, registry=None,
        )

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        method = method if method in METHODS else "OTHER"
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)

    def families(self) -> list[Metric]:
        # Without the `_created` samples: they are not request data and would double the
        # series (a process may set PROMETHEUS_DISABLE_CREATED_SERIES; this does not rely on it).
        out = []
        for fam in [*self.requests.collect(), *self.latency.collect()]:
            fam.samples = [x for x in fam.samples if not x.name.endswith("_created")]
            out.append(fam)
        return out


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


class Exposition:
    """The /metrics body, rendered at most once per ``service.metrics_ttl_s`` (the sync
    interval, at most 1 s): concurrent scrapes wait for one render and share it, instead of
    each rendering every series and queueing behind the others' renders. A render is never
    older than that interval, and none is reused after the store changed (a sync, a
    submission, a cancel)."""

    def __init__(self, registry: Any, service: JobService):
        self.registry = registry
        self.service = service
        self._lock = threading.Lock()
        # The last render: (body, the store's version it read, when). One value, so kept()
        # reads it whole without the lock.
        self._kept: tuple[bytes, int, float] | None = None

    def kept(self) -> bytes | None:
        """The last render when it is current, else None. No I/O and no lock: the async
        route answers with it on the event loop, and renders in a worker thread only when it
        is None."""
        kept = self._kept
        if kept is None:
            return None
        body, version, at = kept
        if time.monotonic() - at >= self.service.metrics_ttl_s:
            return None
        return body if self.service.store.version == version else None

    def render(self) -> bytes:
        if self.service.metrics_ttl_s <= 0:
            return generate_latest(self.registry)
        with self._lock:
            body = self.kept()  # another scrape rendered it while this one waited
            if body is None:
                now, version = time.monotonic(), self.service.store.version
                body = generate_latest(self.registry)
                self._kept = (body, version, now)
            return body


def job_gauge(name: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=["job_id"])


def job_counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels or ["job_id"])


class JobCollector(Collector):
    """Reads the JobService's job state at scrape time."""

    def __init__(self, service: JobService, requests: RequestStats):
        self.service = service
        self.requests = requests

    def collect(self) -> Iterator[Metric]:
        # Live jobs and those that finished within the retention window, oldest first.
        store = self.service.store
        recs = store.live() + store.finished_since(
            self.service.clock() - self.service.settings.metrics_retention_s)
        recs.sort(key=lambda r: (r.created_at, r.id))
        snaps = [r.current_snapshot() for r in recs]
        yield from self._job_families(snaps)
        yield from self._heldout_families(snaps, store.last_records(s.job_id for s in snaps))
        yield from ps_families(snaps)
        yield from schedule_families(snaps)
        nodes = self.service.reconciler.alive_nodes
        if nodes is not None:
            g = GaugeMetricFamily("dynabatch_cluster_nodes", "Alive Ray nodes.")
            g.add_metric([], float(nodes))
            yield g
        yield from cluster_families(self.service.cluster_view())
        jobs = GaugeMetricFamily("dynabatch_jobs", "Jobs in the store by state.", labels=["state"])
        for job_state, n in store.count_by_state().items():
            jobs.add_metric([job_state.value], float(n))
        yield jobs
        yield from self.requests.families()

    @staticmethod
    def _heldout_families(snaps: list[JobSnapshot],
                          last: dict[str, EpochRecord]) -> Iterator[Metric]:
        """The held-out loss and every evaluation metric of each job's last epoch, each
        labelled by its name in the spec (``metrics.<i>.name``: a user metric's default is
        its function's name)."""
        loss = GaugeMetricFamily("dynabatch_job_test_loss",
                                 "Held-out loss of the last epoch.", labels=["job_id"])
        metric = GaugeMetricFamily(
            "dynabatch_job_test_metric",
            "Each evaluation metric of the last epoch on the held-out set (accuracy, mse, "
            "perplexity, user metrics by their name in the spec).",
            labels=["job_id", "metric"],
        )
        for s in snaps:
            rec = last.get(s.job_id)
            if rec is None:
                continue
            if rec.test_loss is not None and math.isfinite(rec.test_loss):
                loss.add_metric([s.job_id], float(rec.test_loss))
            for name, value in sorted(rec.test_metrics.items()):
                if value is not None and math.isfinite(value):
                    metric.add_metric([s.job_id, name], float(value))
        yield from (loss, metric)

    @staticmethod
    def _job_families(snaps: list[JobSnapshot]) -> Iterator[Metric]:
        def worker_gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["job_id", "worker", "node"])

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

        info = GaugeMetricFamily(
            "dynabatch_job_info",
            "A job's name and policy (always 1).",
            labels=["job_id", "name", "policy"],
        )
        state = GaugeMetricFamily(
            "dynabatch_job_state",
            "1 for the job's current state, 0 for the others.",
            labels=["job_id", "state"],
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
            labels=["job_id", "kind", "reason"],
        )
        regroup = job_counter(
            "dynabatch_job_regroup_seconds", "Seconds spent re-forming the worker group."
        )
        retried = job_counter(
            "dynabatch_job_retried_samples", "Samples trained again after a failed step."
        )
        rollbacks = job_counter(
            "dynabatch_job_rollbacks", "Returns to the last checkpoint: every holder lost."
        )
        durations = HistogramMetricFamily(
            "dynabatch_job_epoch_duration_seconds",
            "Wall time of finished epochs.",
            labels=["job_id"],
        )

        for s in snaps:
            job = s.job_id
            info.add_metric([job, s.name, s.policy], 1.0)
            for st in JobState:
                state.add_metric([job, st.value], 1.0 if st == s.state else 0.0)
            epoch.add_metric([job], float(s.epoch))
            step.add_metric([job], float(s.step))
            workers.add_metric([job], float(s.group_size))
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
            rollbacks.add_metric([job], float(s.rollbacks_total))
            for key, n in sorted(s.worker_events.items()):
                kind, _, reason = key.partition(":")
                events.add_metric([job, kind, reason], float(n))
            durations.add_metric(
                [job],
                _histogram(((d, 1) for d in s.epoch_durations_s), EPOCH_BUCKETS),
                sum_value=float(sum(s.epoch_durations_s)),
            )
            if s.state.is_terminal:
                continue  # an ended job has no workers: only its job-level series stay
            for w in s.workers:
                labels = [job, w.worker, node_label(w.node)]
                batch.add_metric(labels, float(w.batch))
                if s.ps is not None:
                    continue  # a learner has no partition or step times (its staleness: ps_*)
                partition.add_metric(labels, float(w.partition))
                throughput.add_metric(labels, float(w.throughput))
                compute.add_metric(labels, float(w.compute_s_per_step))
                wait.add_metric(labels, float(w.wait_s_per_step))

        yield from (batch, partition, throughput, compute, wait)
        yield from (info, state, epoch, step, workers, loss, accuracy, utilization, balance)
        yield from (rebalances, durations, generation, events, regroup, retried, rollbacks)


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


def schedule_families(snaps: list[JobSnapshot]) -> Iterator[Metric]:
    batch = job_gauge("dynabatch_job_global_batch", "The global batch in force (samples).")
    lr = job_gauge("dynabatch_job_learning_rate", "The learning rate of the current step.")
    noise = job_gauge("dynabatch_job_gradient_noise_scale",
                      "Goodput mode: estimated gradient noise scale tr(Sigma)/|grad L|^2.")
    chosen = job_gauge("dynabatch_job_goodput_batch", "Goodput mode: the global batch it chose.")
    flagged = job_counter("dynabatch_job_isgd_flagged_batches",
                          "Batches ISGD flagged as under-trained.")
    extra = job_counter("dynabatch_job_isgd_extra_iterations", "ISGD extra iterations.")
    for s in snaps:
        labels = [s.job_id]
        for family, value in ((batch, s.global_batch), (lr, s.lr), (noise, s.noise_scale),
                              (chosen, s.goodput_batch)):
            if value is not None and math.isfinite(value):
                family.add_metric(labels, float(value))
        flagged.add_metric(labels, float(s.isgd_flagged_total))
        extra.add_metric(labels, float(s.isgd_extra_iterations_total))
    yield from (batch, lr, noise, chosen, flagged, extra)


STALENESS_BUCKETS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128)


def ps_families(snaps: Iterable[JobSnapshot]) -> Iterator[Metric]:
    staleness = HistogramMetricFamily(
        "dynabatch_ps_staleness", "Staleness of each learner's applied gradients.",
        labels=["job_id", "worker"])
    pushes = job_gauge("dynabatch_ps_pushes_per_second", "Gradients pushed per second (last 10 s).")
    grads = job_counter("dynabatch_ps_gradients", "Gradients by outcome (applied, refused).",
                        labels=["job_id", "outcome"])
    deferred = job_counter("dynabatch_ps_deferred_updates", "Updates put off by on_stale: wait.")
    version = job_gauge("dynabatch_ps_server_version", "Updates the server applied.")
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
            counts = w.staleness_counts
            staleness.add_metric([job, w.worker], _histogram(counts.items(), STALENESS_BUCKETS),
                                 sum_value=float(sum(tau * n for tau, n in counts.items())))
    yield from (staleness, pushes, grads, deferred, version)

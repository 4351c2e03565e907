"""A job's throughput on a configuration of node types, and how it is estimated (pure).

``throughput(S) = S / (1 + S·τ/B)``, with ``S = Σ_t n_t·rate_t`` the samples per second of
compute the workers offer, τ the per-step time more workers do not shrink and B the global
batch: concave in S, so the cluster MILP bounds it by tangent lines. :func:`bootstrap` fills
the types a job has not run on from other jobs' ratios (Sia), else from the :func:`prior`.
docs/cluster.md, "The throughput model".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ThroughputModel:
    """One job's speed per node type.

    ``rates``: (type, samples/s of compute of one worker of that type), sorted by type; a
    type missing or at 0 is one the job cannot use. ``measured``: the types whose rate comes
    from the job's own telemetry. ``overhead_s``: τ above. ``global_batch``: B."""

    rates: tuple[tuple[str, float], ...] = ()
    measured: frozenset[str] = frozenset()
    overhead_s: float = 0.0
    global_batch: float = 1.0

    def __post_init__(self) -> None:
        for node_type, rate in self.rates:
            if not (math.isfinite(rate) and rate >= 0.0):
                raise ValueError(f"rate of node type {node_type!r}: {rate} is not >= 0")
        if not (math.isfinite(self.overhead_s) and self.overhead_s >= 0.0):
            raise ValueError(f"overhead_s: {self.overhead_s} is not >= 0")
        if not (math.isfinite(self.global_batch) and self.global_batch > 0.0):
            raise ValueError(f"global_batch: {self.global_batch} is not > 0")

    @classmethod
    def of(
        cls,
        rates: Mapping[str, float],
        measured: Iterable[str] = (),
        overhead_s: float = 0.0,
        global_batch: float = 1.0,
    ) -> ThroughputModel:
        return cls(
            tuple(sorted((t, float(r)) for t, r in rates.items())),
            frozenset(measured),
            float(overhead_s),
            float(global_batch),
        )

    def rate(self, node_type: str) -> float:
        for t, r in self.rates:
            if t == node_type:
                return r
        return 0.0

    @property
    def saturation(self) -> float:
        """τ/B: ``throughput(S) = S / (1 + saturation·S)``."""
        return self.overhead_s / self.global_batch

    def of_speed(self, speed: float) -> float:
        """Throughput (samples/s) of a configuration offering ``speed`` = S."""
        return speed / (1.0 + self.saturation * speed)

    def throughput(self, counts: Mapping[str, int]) -> float:
        """Samples per second on ``counts`` workers per node type."""
        return self.of_speed(sum(n * self.rate(t) for t, n in counts.items()))


# Relative training throughput of one GPU by model (an H100 = 1): the class a node type's
# GPU model puts it in, for a job that has not run on it. Round figures from public
# per-GPU training benchmarks (MLPerf Training, vendor sheets) and Gavel's measured tables
# (V100 : P100 : K80 about 1 : 0.6 : 0.2); only their order and rough ratios matter, since
# a job's own measurement replaces them. Keys are matched case-insensitively inside the
# type's name (``gpu-A100x8``, ``v100``), longest first.
GPU_SPEED: dict[str, float] = {
    "H200": 1.1,
    "H100": 1.0,
    "A100": 0.6,
    "L40S": 0.5,
    "A10G": 0.25,
    "L4": 0.2,
    "V100": 0.3,
    "T4": 0.1,
    "P100": 0.18,
    "K80": 0.06,
}
# A CPU-only node type (``cpu<count>``), against the same H100.
CPU_SPEED = 0.02


def prior(
    node_types: Iterable[str], speeds: Mapping[str, float] | None = None
) -> dict[str, float]:
    """The prior relative speed of one worker per node type, for :func:`bootstrap`'s
    ``hints``: ``speeds`` where given (a cluster file's ``speed`` column, a node label),
    else the class of the GPU model named in the type (:data:`GPU_SPEED`), else
    :data:`CPU_SPEED` for a ``cpu<count>`` type, else 1 (no prior: every such type rated
    alike)."""
    speeds = dict(speeds or {})
    out: dict[str, float] = {}
    models = sorted(GPU_SPEED, key=len, reverse=True)
    for t in node_types:
        if speeds.get(t, 0.0) > 0.0:
            out[t] = float(speeds[t])
            continue
        name = t.upper()
        found = next((m for m in models if m in name), None)
        if found is not None:
            out[t] = GPU_SPEED[found]
        elif name.startswith("CPU"):
            out[t] = CPU_SPEED
        else:
            out[t] = 1.0
    return out


def bootstrap(
    models: Mapping[str, ThroughputModel],
    node_types: Iterable[str],
    hints: Mapping[str, float] | None = None,
) -> dict[str, ThroughputModel]:
    """Every job's model completed over ``node_types``.

    A type the job measured keeps its measured rate. An unmeasured type u is estimated from
    each measured type m of the job as ``rate_m · ratio(u, m)``, the ratio taken from the
    *other* jobs that measured both (Sia's bootstrap), else from ``hints`` (relative speeds
    per type, e.g. from the node's resources); several estimates are combined by their
    geometric mean. A job that measured nothing gets the hints themselves (its scale does
    not matter: the policies compare a job's throughput only with its own). A type with no
    estimate at all gets rate 0 and is not used for that job."""
    hints = dict(hints or {})
    types = sorted(set(node_types))
    out: dict[str, ThroughputModel] = {}
    # (u, m) → the median of rate_u / rate_m over the jobs that measured both (of the log
    # ratios, so (u, m) and (m, u) are reciprocal). A job's own ratios only cover types it
    # measured, which are never estimated, so one table over all jobs is the table over
    # the others.
    logs: dict[tuple[str, str], list[float]] = {}
    for model in models.values():
        known = sorted((t, r) for t, r in model.rates if t in model.measured and r > 0.0)
        for u, ru in known:
            for m, rm in known:
                if u != m:
                    logs.setdefault((u, m), []).append(math.log(ru / rm))
    others = {k: math.exp(float(np.median(v))) for k, v in logs.items()}
    for job_id, model in models.items():
        mine = {t: r for t, r in model.rates if t in model.measured and r > 0.0}
        rates: dict[str, float] = {}
        for u in types:
            if u in mine:
                rates[u] = mine[u]
                continue
            logs = []
            for m, rm in mine.items():
                ratio = others.get((u, m))
                if ratio is None and hints.get(u, 0.0) > 0.0 and hints.get(m, 0.0) > 0.0:
                    ratio = hints[u] / hints[m]
                if ratio is not None:
                    logs.append(math.log(rm * ratio))
            if logs:
                rates[u] = math.exp(sum(logs) / len(logs))
            elif not mine:
                rates[u] = max(0.0, float(hints.get(u, 0.0)))
            else:
                rates[u] = 0.0
        out[job_id] = ThroughputModel.of(
            rates, model.measured, model.overhead_s, model.global_batch
        )
    return out

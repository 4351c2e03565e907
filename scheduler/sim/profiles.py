"""Cluster descriptions fitted to a real run (``dynabatch run --report``). Pure: numpy only.

:func:`profiles_from_report` fits ``a_i, c_i`` per worker: each epoch record gives one point
``(partition/steps, compute_s/steps / slowdown)``, which lies on the worker's line because
``t`` is affine in ``b``; the fit is the policy's own estimator
(:func:`dynabatch.scheduler.core.sync.steptime.fit`). Dividing by the emulated slowdown gives
the node's own speed (the job spec's emulation re-applies it in the simulation). A worker
whose batch never changed gets the proportional fit ``a = 0``; an epoch in which a worker's
slowdown changed part-way gives it no point (its record carries one slowdown for two).

The rest of a step (charged as the all-reduce, put into ``α``) is the median over the epochs
after the first (which pays the start-up) of ``wall_s / steps`` less the slowest worker's
compute per step: the all-reduce, the optimizer, the coordinator's and evaluation's share,
and emulated compute's wait for a shared core. A record without ``wall_s`` falls back to the
slowest worker's wait per step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.sync.steptime import StepTimeStats, fit
from dynabatch.scheduler.sim.cluster_spec import ClusterError, ClusterSpec, parse_cluster


@dataclass(frozen=True)
class WorkerProfile:
    worker: str
    node: str
    a_s: float
    c_s: float
    points: int


def profiles_from_report(report: dict[str, Any]) -> tuple[list[WorkerProfile], float]:
    """Per-worker ``(a, c)`` fitted from a run report's epochs, and the all-reduce seconds per
    step (see the module docstring). Raises :class:`ClusterError` naming the field."""
    history = report.get("history")
    if not isinstance(history, list) or not history:
        raise ClusterError("history: the report has no epoch records to fit profiles from")
    stats: dict[str, StepTimeStats] = {}
    nodes: dict[str, str] = {}
    points: dict[str, int] = {}
    rests: list[float] = []
    mixed = _mixed_epochs(report)
    for e, rec in enumerate(history):
        workers = rec.get("workers") if isinstance(rec, dict) else None
        if not isinstance(workers, list):
            raise ClusterError(f"history.{e}.workers: missing")
        slowest: tuple[float, float] | None = None
        epoch = rec.get("epoch", e)
        for w in workers:
            try:
                steps = int(w["steps"])
                part, comp = float(w["partition"]), float(w["compute_s"])
                wait, slow = float(w["wait_s"]), float(w.get("slowdown", 1.0)) or 1.0
                name, node = str(w["worker"]), str(w["node"])
            except (KeyError, TypeError, ValueError) as err:
                raise ClusterError(f"history.{e}.workers: bad worker record ({err})") from None
            if steps <= 0 or part <= 0 or comp <= 0:
                continue
            if slowest is None or comp / steps > slowest[0]:
                slowest = (comp / steps, wait / steps)
            if (_ordinal(name)[0], epoch) in mixed:
                continue
            x, y = part / steps, comp / steps / slow
            stats[name] = stats.get(name, StepTimeStats()).add(x, y)
            nodes[name] = node
            points[name] = points.get(name, 0) + 1
        if slowest is not None:
            rests.append(_rest_of_step(rec, slowest))
    out = []
    for name in sorted(stats, key=_ordinal):
        f = fit(stats[name])
        if f is None:
            raise ClusterError(f"history: worker {name} has no usable compute times")
        out.append(WorkerProfile(name, nodes[name], f.a, f.c, points[name]))
    if not out:
        raise ClusterError("history: no worker trained a sample")
    rests = rests[1:] or rests  # the first epoch pays the workers' start-up
    return out, float(np.median(rests)) if rests else 0.0


def _rest_of_step(rec: dict[str, Any], slowest: tuple[float, float]) -> float:
    """An epoch's step time beyond its slowest compute (see the module docstring)."""
    try:
        wall, steps = float(rec["wall_s"]), int(rec["steps"])
    except (KeyError, TypeError, ValueError):
        return slowest[1]
    return max(0.0, wall / steps - slowest[0]) if steps > 0 else slowest[1]


def _mixed_epochs(report: dict[str, Any]) -> set[tuple[float, int]]:
    """(worker ordinal, epoch) pairs whose emulated slowdown changed after the epoch's first
    step: the report spec's disturbances that start part-way through an epoch."""
    spec = report.get("spec")
    emulation = spec.get("emulation") if isinstance(spec, dict) else None
    found = emulation.get("disturbances") if isinstance(emulation, dict) else None
    out: set[tuple[float, int]] = set()
    for d in found if isinstance(found, list) else []:
        try:
            if int(d.get("step", 0)) > 0:
                out.add((float(d["worker"]), int(d["epoch"])))
        except (AttributeError, KeyError, TypeError, ValueError):
            continue  # a spec the run itself validated; nothing to leave out
    return out


def _ordinal(worker: str) -> tuple[float, str]:
    """Sort key: ``w10`` after ``w9``; other names last."""
    m = re.match(r"^w(\d+)$", worker)
    return (float(m.group(1)), worker) if m else (math.inf, worker)


def cluster_from_profiles(profiles: Sequence[WorkerProfile], allreduce_s: float, *,
                          noise_sigma: float = 0.0, seed: int = 0,
                          events: Sequence[dict] = (), cpus: float = 1.0,
                          gpus: float = 0.0) -> ClusterSpec:
    """One single-node class per profiled worker (in worker order, so worker ``w{k}`` lands
    on its own profile again), with the measured all-reduce put into ``α`` for this ``n``.
    ``cpus``/``gpus``: what each node offers; it hosted its worker, so the job's
    (:func:`hosting`)."""
    n = len(profiles)
    alpha_ms = allreduce_s * 1e3 / (2 * (n - 1)) if n > 1 else 0.0
    return parse_cluster({
        "classes": [{"name": f"{p.worker}", "count": 1, "a_ms": p.a_s * 1e3,
                     "c_ms_per_sample": p.c_s * 1e3, "cpus": cpus, "gpus": gpus}
                    for p in profiles],
        "noise_sigma": noise_sigma, "seed": seed,
        "allreduce": {"alpha_ms": alpha_ms, "beta_ms_per_mb": 0.0, "model_mb": 0.0},
        "events": list(events),
    })


def hosting(spec: JobSpec) -> dict[str, float]:
    """What a node that hosted one of ``spec``'s workers offered at least: its CPUs, and a
    GPU when every worker needs one (``cluster_from_profiles``' ``cpus`` and ``gpus``)."""
    gpus = 0.0 if spec.worker_gpus == "auto" else float(spec.worker_gpus)
    if spec.device == "cuda":
        gpus = max(gpus, 1.0)
    return {"cpus": spec.worker_cpus, "gpus": gpus}


"""Slots per node type for the cluster policy (pure): each type's capacity and its workers'
sizes divided by their greatest common divisor, so whole GPUs (``GPU_UNITS`` slots each), or
one share throughout, count one slot per worker again, where gang admission is Hall's
condition and not a program per job.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
from dynabatch.scheduler.core.cluster.values import ClusterJob, ClusterNode


def scaled(
    nodes: Sequence[ClusterNode], jobs: Sequence[ClusterJob], tix: dict[str, int]
) -> tuple[list[ClusterNode], Callable[[ClusterJob, ClusterNode], int]]:
    """The nodes with each type's capacity, and the slots a worker takes there, divided by
    their greatest common divisor over the type: whole-GPU workers (``GPU_UNITS`` each) or
    jobs sharing GPUs alike then count one slot per worker, so the plain (Hall) admission
    and the MILP see small integers, and the exact same fits."""
    unit = [0] * len(tix)
    kinds: set[tuple[int, bool]] = set()  # (type, GPU node): a worker's size depends on no more
    for n in nodes:
        t = tix[n.node_type]
        unit[t] = math.gcd(unit[t], n.capacity)
        kinds.add((t, n.gpu))
    for t, gpu in kinds:
        unit[t] = math.gcd(unit[t], *{j.gpu_units if gpu else j.worker_slots for j in jobs})
    unit = [u or 1 for u in unit]

    def size_of(job: ClusterJob, node: ClusterNode) -> int:
        return job.size_on(node) // unit[tix[node.node_type]]

    out = [replace(n, capacity=n.capacity // unit[tix[n.node_type]]) for n in nodes]
    return out, size_of


def whole(
    nodes: Sequence[ClusterNode],
    tix: dict[str, int],
    free: dict[str, int],
    size: dict[str, np.ndarray],
    sized: bool,
) -> dict[str, np.ndarray]:
    """job → the most of its workers each type's nodes hold whole in their ``free`` slots
    (with one slot per worker: the type's free slots)."""
    per_type: dict[int, Counter[int]] = {}
    for n in nodes:
        per_type.setdefault(tix[n.node_type], Counter())[free[n.node_id]] += 1
    plain = np.zeros(len(tix), dtype=np.int64)
    for t, c in per_type.items():
        plain[t] = sum(f * k for f, k in c.items())
    if not sized:
        return {j: plain for j in size}
    out = {}
    for j, v in size.items():
        row = plain.copy()
        for t, c in per_type.items():
            if v[t] > 1:
                row[t] = sum((f // int(v[t])) * k for f, k in c.items())
        out[j] = row
    return out

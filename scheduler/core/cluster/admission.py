"""Which jobs run at all: the queue order, holds, and gang admission (pure).

Order. Jobs are considered by ``(-priority, running first, submit time, id)``: a higher
priority comes first; among equals a running job is not displaced by a later arrival.

Gangs. A job is admitted only when its ``min_workers`` fit together next to the held jobs'
allocations and the minimums of the jobs admitted before it; a job that is not admitted
holds nothing. Whether a set of minimums fits on node types each job may use is a
transportation problem; by Hall's theorem it is feasible exactly when for every set U of
types, the minimums of the jobs that can use only types in U fit in U's capacity. With a
few node types that is 2^T sums (a subset-sum transform), cheap enough to ask per job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from dynabatch.scheduler.core.cluster.values import ClusterJob, ClusterNode

MAX_TYPES = 16


def order_key(job: ClusterJob) -> tuple:
    return (-job.priority, 0 if job.allocation else 1, job.submit_s, job.job_id)


def sanitize(
    nodes: Mapping[str, ClusterNode], ordered: Sequence[ClusterJob]
) -> tuple[dict[str, dict[str, int]], set[str]]:
    """Current allocations restricted to the nodes that exist and their capacity.

    Slots on a lost node are dropped; where a node's capacity shrank below what its jobs
    hold, the jobs later in the order lose the excess. Returns (job → node → workers, the
    jobs that lost slots)."""
    used: dict[str, int] = {}
    out: dict[str, dict[str, int]] = {}
    lost: set[str] = set()
    for job in ordered:
        mine: dict[str, int] = {}
        for node_id, n in job.allocation:
            node = nodes.get(node_id)
            room = 0 if node is None else node.capacity - used.get(node_id, 0)
            keep = max(0, min(n, room))
            if keep < n:
                lost.add(job.job_id)
            if keep:
                mine[node_id] = mine.get(node_id, 0) + keep
                used[node_id] = used.get(node_id, 0) + keep
        out[job.job_id] = mine
    return out, lost


@dataclass
class GangCheck:
    """Hall's condition over node types, for gang admission.

    ``free``: capacity per type left for the jobs being admitted."""

    free: np.ndarray

    def __post_init__(self) -> None:
        t = len(self.free)
        if t > MAX_TYPES:
            raise ValueError(f"nodes: {t} node types; at most {MAX_TYPES} are supported")
        masks = np.arange(1 << t)
        bits = (masks[:, None] >> np.arange(t)) & 1
        self._cap = bits @ np.asarray(self.free, dtype=np.int64)
        self._demand = np.zeros(1 << t, dtype=np.int64)

    def _fits(self, demand: np.ndarray) -> bool:
        closed = demand.copy()
        masks = np.arange(len(closed))
        for b in range(len(self.free)):
            upper = masks[(masks >> b) & 1 == 1]
            closed[upper] += closed[upper ^ (1 << b)]
        return bool((closed <= self._cap).all())

    def admit(self, mask: int, workers: int) -> bool:
        """Reserve ``workers`` on the types in ``mask`` if that keeps every admitted
        minimum placeable; False (nothing reserved) otherwise."""
        if mask == 0:
            return False
        trial = self._demand.copy()
        trial[mask] += workers
        if not self._fits(trial):
            return False
        self._demand = trial
        return True

    def reserved_within(self, mask: int) -> int:
        """Workers already reserved by jobs that can use only types in ``mask``."""
        sub = np.arange(len(self._demand))
        return int(self._demand[(sub & ~mask) == 0].sum())


def single_type_admit(free: np.ndarray, mask: int, rates: np.ndarray, workers: int) -> int:
    """For a one-type-per-job policy: the type (index) the gang fits on, the job's fastest
    such, reserving it in ``free``; -1 when none has room."""
    best = -1
    for t in range(len(free)):
        if (
            mask >> t & 1
            and free[t] >= workers
            and (best < 0 or (rates[t], free[t]) > (rates[best], free[best]))
        ):
            best = t
    if best >= 0:
        free[best] -= workers
    return best

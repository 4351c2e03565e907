"""Which jobs run at all: the queue order, lost slots, and gang admission (pure).

Jobs are considered by ``(-priority, running first, submit time, id)``, so a running job is
not displaced by a later arrival of its priority. A job is admitted only when its
``min_workers`` fit together next to the held jobs and the minimums admitted before it. With
one slot per worker that is Hall's condition over node types (:class:`GangCheck`: for every
set of types, the minimums of the jobs limited to it fit its capacity, 2^T sums); with
workers of several slots HiGHS checks the MILP's own capacity rows (:class:`SizedGangCheck`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from dynabatch.scheduler.core.cluster.values import ClusterJob, ClusterNode
from scipy.optimize import Bounds, LinearConstraint, milp

MAX_TYPES = 16


def order_key(job: ClusterJob) -> tuple:
    return (-job.priority, 0 if job.allocation else 1, job.submit_s, job.job_id)


def sanitize(
    nodes: Mapping[str, ClusterNode], ordered: Sequence[ClusterJob]
) -> tuple[dict[str, dict[str, int]], set[str]]:
    """Current allocations restricted to the nodes that exist and their capacity.

    Slots on a lost node are dropped; where a node's capacity shrank below what its jobs
    hold, the jobs later in the order lose the excess (a worker keeps its slots whole).
    Returns (job → node → workers, the jobs that lost slots)."""
    used: dict[str, int] = {}
    out: dict[str, dict[str, int]] = {}
    lost: set[str] = set()
    for job in ordered:
        mine: dict[str, int] = {}
        for node_id, n in job.allocation:
            node = nodes.get(node_id)
            size = 1 if node is None else job.size_on(node)
            room = 0 if node is None else node.capacity - used.get(node_id, 0)
            keep = max(0, min(n, room // size))
            if keep < n:
                lost.add(job.job_id)
            if keep:
                mine[node_id] = mine.get(node_id, 0) + keep
                used[node_id] = used.get(node_id, 0) + keep * size
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


@dataclass
class SizedGangCheck:
    """Gang admission for jobs whose workers take several slots. ``free``: slots per type
    left; :meth:`admit` takes the job's slots per worker (``size``) and the most workers its
    nodes hold whole (``room``) per type. A gang that fits greedily beside the placement kept
    of the admitted minimums is admitted at once; otherwise HiGHS decides, all gangs free to
    move."""

    free: np.ndarray

    def __post_init__(self) -> None:
        self._gangs: list[tuple[np.ndarray, np.ndarray, int]] = []
        self._left = np.asarray(self.free, dtype=np.int64).copy()

    def admit(self, size: np.ndarray, room: np.ndarray, workers: int) -> bool:
        gang = (np.asarray(size, dtype=np.int64), np.asarray(room, dtype=np.int64), workers)
        take = np.zeros(len(self._left), dtype=np.int64)
        want = workers
        for t in np.argsort(-self._left, kind="stable"):
            take[t] = min(want, int(self._left[t] // gang[0][t]), int(gang[1][t]))
            want -= int(take[t])
        if want <= 0:
            self._left -= take * gang[0]
            self._gangs.append(gang)
            return True
        x = self.placement(self.free, [*self._gangs, gang])
        if x is None:
            return False
        self._gangs.append(gang)
        used = sum((g[0] * x[j] for j, g in enumerate(self._gangs)), np.zeros_like(self._left))
        self._left = np.asarray(self.free, dtype=np.int64) - used
        return True

    @staticmethod
    def placement(
        free: np.ndarray, gangs: Sequence[tuple[np.ndarray, np.ndarray, int]]
    ) -> np.ndarray | None:
        """Integer workers x_jt ≤ room_jt with Σ_t x_jt ≥ min_j and Σ_j size_jt·x_jt ≤
        free_t (rows: gangs), or None when there are none."""
        n_types = len(free)
        nvar = len(gangs) * n_types
        a = np.zeros((n_types + len(gangs), nvar))
        for j, (size, _, _) in enumerate(gangs):
            a[:n_types, j * n_types : (j + 1) * n_types] = np.diag(size)
            a[n_types + j, j * n_types : (j + 1) * n_types] = 1.0
        lo = np.concatenate([np.full(n_types, -np.inf), [w for _, _, w in gangs]])
        hi = np.concatenate([np.asarray(free, dtype=float), np.full(len(gangs), np.inf)])
        ub = np.concatenate([np.asarray(room, dtype=float) for _, room, _ in gangs])
        res = milp(
            np.zeros(nvar),
            integrality=np.ones(nvar),
            bounds=Bounds(np.zeros(nvar), ub),
            constraints=LinearConstraint(a, lo, hi),
        )
        if res.x is None:
            return None
        return np.rint(res.x).astype(np.int64).reshape(len(gangs), n_types)


def single_type_admit(
    free: np.ndarray,
    mask: int,
    rates: np.ndarray,
    workers: int,
    size: np.ndarray,
    room: np.ndarray,
) -> int:
    """For a one-type-per-job policy: the type (index) the gang fits on, the job's fastest
    such, reserving it in ``free`` (slots; ``size`` slots per worker on each type, and at
    most ``room`` workers on each type); -1 when none has room."""
    best = -1
    for t in range(len(free)):
        if (
            mask >> t & 1
            and free[t] >= workers * size[t]
            and room[t] >= workers
            and (best < 0 or (rates[t], free[t]) > (rates[best], free[best]))
        ):
            best = t
    if best >= 0:
        free[best] -= workers * size[best]
    return best

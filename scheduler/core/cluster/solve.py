"""The cluster MILP: worker counts per (job, node type) for the admitted jobs (pure).

Nodes are aggregated by type, so the program's size depends on jobs × types, not on the
number of nodes; concrete nodes are chosen afterwards (:mod:`.assign`).

Variables, per admitted job j and type t: ``x_jt`` (integer workers), ``y_j`` (normalised
throughput, bounded by tangent lines of the job's concave curve, :mod:`.throughput`),
``d_jt ≥ |x_jt − x0_jt|`` and a binary ``m_j`` (resized) for a running job with current
counts ``x0``; for ``single_type`` a binary ``u_jt`` (the one type). Constraints:
``Σ_j size_jt·x_jt ≤ free_t`` (a worker may take several slots, :mod:`.units`), ``x_jt ≤
room_jt`` (what its nodes of type t hold whole), ``min_j ≤ Σ_t x_jt ≤ max_j`` (gang admission
made this feasible), ``Σ_t d_jt ≤ M·m_j``; single type: ``x_jt ≤ max_j·u_jt, Σ_t u_jt ≤ 1``.

Objectives (``scipy.optimize.milp``, HiGHS): ``goodput`` / ``single_type`` maximise ``Σ y_j −
resize_penalty·Σ m_j − move_cost·Σ d_jt``; ``fair`` takes the LP relaxation's max-min level
``L`` first, then maximises ``W·(Σ_j w_j + τ) + Σ_j y_j`` with ``w_j ≤ min(y_j, L)`` and ``τ ≤
y_j`` (``W``: ``fair_weight``), so every job's shortfall below the fair level outweighs
throughput. Hysteresis: the current counts are kept when feasible and the solution (less its
penalties) beats them by at most ``hysteresis``, so a decision fed back as the current
allocation changes nothing even where the solver stops within its gap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from dynabatch.scheduler.core.cluster.values import ClusterKnobs
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array


@dataclass(frozen=True)
class Problem:
    """Admitted, not-held jobs (rows) over node types (columns)."""

    rates: np.ndarray  # (J, T) samples/s of one worker; 0: not usable
    lo: np.ndarray  # (J,) min_workers
    hi: np.ndarray  # (J,) max_workers
    saturation: np.ndarray  # (J,) τ/B
    ref: np.ndarray  # (J,) throughput on max_workers of the fastest type
    x0: np.ndarray  # (J, T) current counts (zeros for a job not running)
    running: np.ndarray  # (J,) bool
    free: np.ndarray  # (T,) slots per type left after held jobs
    size: np.ndarray | None = None  # (J, T) slots per worker; None: one
    room: np.ndarray | None = None  # (J, T) most workers on a type's nodes; None: no bound

    def sizes(self) -> np.ndarray:
        return np.ones_like(self.rates, dtype=np.int64) if self.size is None else self.size

    def rooms(self) -> np.ndarray:
        return np.full(self.rates.shape, np.inf) if self.room is None else self.room


def tangents(
    rates: np.ndarray, lo: int, hi: int, saturation: float, ref: float, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """(intercepts, slopes) in normalised units per unit of S: ``y ≤ a_k + g_k·S``."""
    positive = rates[rates > 0]
    s_lo = lo * float(positive.min())
    s_hi = hi * float(positive.max())
    if saturation <= 0.0 or count == 1 or s_hi <= s_lo:
        knots = np.array([s_hi]) if saturation > 0.0 else np.array([0.0])
    else:
        knots = np.geomspace(s_lo, s_hi, count)
    scale = 1.0 + saturation * knots
    value = knots / scale
    slope = 1.0 / scale**2
    return (value - slope * knots) / ref, slope / ref


def normalised(problem: Problem, x: np.ndarray, curves) -> np.ndarray:
    """y_j of counts ``x`` as the MILP sees it (the lowest tangent)."""
    speed = (problem.rates * x).sum(axis=1)
    return np.array([float(np.min(a + g * s)) for (a, g), s in zip(curves, speed, strict=True)])


def _feasible(problem: Problem, x: np.ndarray, single: bool) -> bool:
    total = x.sum(axis=1)
    return bool(
        (total >= problem.lo).all()
        and (total <= problem.hi).all()
        and ((x * problem.sizes()).sum(axis=0) <= problem.free).all()
        and (x <= problem.rooms()).all()
        and (x[problem.rates <= 0] == 0).all()
        and (not single or ((x > 0).sum(axis=1) <= 1).all())
    )


class _Builder:
    """Sparse rows for one MILP."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []

    def row(self, entries, lb: float, ub: float) -> None:
        r = len(self.lb)
        for c, v in entries:
            self.rows.append(r)
            self.cols.append(c)
            self.vals.append(v)
        self.lb.append(lb)
        self.ub.append(ub)

    def constraint(self, nvar: int) -> LinearConstraint:
        a = coo_array((self.vals, (self.rows, self.cols)), shape=(len(self.lb), nvar)).tocsr()
        return LinearConstraint(a, np.array(self.lb), np.array(self.ub))


def solve(problem: Problem, policy: str, knobs: ClusterKnobs) -> np.ndarray:
    """Integer counts (J, T) for the policy (``fair``, ``goodput`` or ``single_type``)."""
    n_jobs, n_types = problem.rates.shape
    if n_jobs == 0:
        return np.zeros((0, n_types), dtype=np.int64)
    single = policy == "single_type"
    curves = [
        tangents(
            problem.rates[j],
            int(problem.lo[j]),
            int(problem.hi[j]),
            float(problem.saturation[j]),
            float(problem.ref[j]),
            knobs.tangents,
        )
        for j in range(n_jobs)
    ]
    jt = n_jobs * n_types
    ix_y, ix_d, ix_m = jt, jt + n_jobs, 2 * jt + n_jobs
    ix_u = 2 * jt + 2 * n_jobs
    ix_tau = ix_u + (jt if single else 0)
    ix_w = ix_tau + 1
    nvar = ix_w + n_jobs
    lb = np.zeros(nvar)
    ub = np.zeros(nvar)
    integrality = np.zeros(nvar, dtype=np.int64)
    b = _Builder()
    size, room = problem.sizes(), problem.rooms()
    for t in range(n_types):
        b.row(
            ((j * n_types + t, float(size[j, t])) for j in range(n_jobs)),
            0.0,
            float(problem.free[t]),
        )
    for j in range(n_jobs):
        xs = range(j * n_types, (j + 1) * n_types)
        for t, col in zip(range(n_types), xs, strict=True):
            if problem.rates[j, t] > 0:
                ub[col] = min(
                    float(problem.hi[j]), float(problem.free[t]) // size[j, t], room[j, t]
                )
            integrality[col] = 1
        b.row(((c, 1.0) for c in xs), float(problem.lo[j]), float(problem.hi[j]))
        intercepts, slopes = curves[j]
        for a, g in zip(intercepts, slopes, strict=True):
            b.row(
                [(ix_y + j, 1.0), *((c, -g * problem.rates[j, t]) for t, c in enumerate(xs))],
                -np.inf,
                float(a),
            )
        ub[ix_y + j] = np.inf
        if problem.running[j]:
            big = float(problem.hi[j] + problem.x0[j].sum())
            for t, c in enumerate(xs):
                dcol = ix_d + j * n_types + t
                ub[dcol] = np.inf
                b.row(((c, 1.0), (dcol, -1.0)), -np.inf, float(problem.x0[j, t]))
                b.row(((c, -1.0), (dcol, -1.0)), -np.inf, -float(problem.x0[j, t]))
            b.row(
                [*((ix_d + j * n_types + t, 1.0) for t in range(n_types)), (ix_m + j, -big)],
                -np.inf,
                0.0,
            )
            ub[ix_m + j] = 1.0
            integrality[ix_m + j] = 1
        if single:
            for t, c in enumerate(xs):
                ub[ix_u + j * n_types + t] = 1.0 if problem.rates[j, t] > 0 else 0.0
                integrality[ix_u + j * n_types + t] = 1
                b.row(((c, 1.0), (ix_u + j * n_types + t, -float(problem.hi[j]))), -np.inf, 0.0)
            b.row(((ix_u + j * n_types + t, 1.0) for t in range(n_types)), 0.0, 1.0)
    options = {"node_limit": knobs.node_limit, "mip_rel_gap": knobs.mip_gap}

    def run(c: np.ndarray, extra: _Builder | None = None) -> np.ndarray | None:
        rows = [b.constraint(nvar)]
        if extra is not None:
            rows.append(extra.constraint(nvar))
        res = milp(
            c, integrality=integrality, bounds=Bounds(lb, ub), constraints=rows, options=options
        )
        if res.x is None:
            return None
        return np.rint(res.x[:jt]).astype(np.int64).reshape(n_jobs, n_types)

    goodput = np.zeros(nvar)
    goodput[ix_y : ix_y + n_jobs] = -1.0
    goodput[ix_m : ix_m + n_jobs] = knobs.resize_penalty
    goodput[ix_d : ix_d + jt] = knobs.move_cost
    current_ok = bool(problem.running.all()) and _feasible(problem, problem.x0, single)
    fair_rows = _Builder()  # tau <= y_j, w_j <= y_j
    for j in range(n_jobs):
        fair_rows.row(((ix_tau, 1.0), (ix_y + j, -1.0)), -np.inf, 0.0)
        fair_rows.row(((ix_w + j, 1.0), (ix_y + j, -1.0)), -np.inf, 0.0)
    extra = None
    if policy == "fair":
        # The max-min level of the LP relaxation (Gavel's LP); the integer program then
        # maximises every job's part of that level and the worst job's throughput (tau),
        # and total throughput after. An integer max-min objective alone is costly to prove
        # (its bound hardly moves; docs/cluster.md).
        lp = milp(
            np.where(np.arange(nvar) == ix_tau, -1.0, 0.0),
            integrality=None,
            bounds=Bounds(lb, np.where(np.arange(nvar) == ix_tau, np.inf, ub)),
            constraints=[b.constraint(nvar), fair_rows.constraint(nvar)],
        )
        level = float(lp.x[ix_tau]) if lp.x is not None else 0.0
        ub[ix_tau] = np.inf
        ub[ix_w : ix_w + n_jobs] = level
        goodput[ix_tau] = -knobs.fair_weight
        goodput[ix_w : ix_w + n_jobs] = -knobs.fair_weight
        extra = fair_rows
    x = run(goodput, extra)
    if x is None or not _feasible(problem, x, single):
        # Node limit hit before any integer point: any feasible counts (with one slot per
        # worker the x-part is a transportation polytope, so the first LP vertex is
        # integral; with sized workers gang admission checked this very program).
        x = run(np.zeros(nvar), extra)
        if x is None or not _feasible(problem, x, single):
            raise RuntimeError("cluster MILP found no allocation for admitted gangs")
    if current_ok:

        def value(counts: np.ndarray) -> float:
            y = normalised(problem, counts, curves)
            if policy != "fair":
                return float(y.sum())
            return float(y.sum() + knobs.fair_weight * (y.min() + np.minimum(y, ub[ix_w]).sum()))

        moved = np.abs(x - problem.x0)
        keep = value(problem.x0)
        gain = (
            value(x)
            - knobs.resize_penalty * float((moved.sum(axis=1) > 0).sum())
            - knobs.move_cost * float(moved.sum())
            - keep
        )
        if gain <= knobs.hysteresis * max(abs(keep), 1e-12):
            return problem.x0.copy()
    return x

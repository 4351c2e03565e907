"""How long a simulated cluster's steps take: the cost model. Pure: numpy only; no ray, no
torch, no clock.

The simulator (:mod:`dynabatch.scheduler.sim.simulator`) runs the engine's own machines on a
virtual clock; this module says how much virtual time each thing costs, from the numbers of
the cluster's description (:mod:`dynabatch.scheduler.sim.cluster_spec`).

**Compute.** Worker ``i`` on a node of its class computes a local batch ``b`` in::

    t_i(b) = (a_i + c_i·b) · f_i · ε,     ε = exp(σ·z), z ~ N(0, 1)

``a_i`` is the fixed per-step cost (seconds), ``c_i`` the per-sample cost, ``f_i`` the product
of every slowdown in force (cluster events and the job spec's emulation), and ε a
multiplicative lognormal jitter drawn per worker and per step (median 1, σ =
``noise_sigma``). A worker whose share of a step is empty skips forward and backward, as the
real worker does: ``t_i(0) = 0``. ``node_sigma`` spreads the nodes of one class: each node's
``a`` and ``c`` are its class's times one persistent ``exp(σ_node·z)`` (the node's *true*
speed, which the policy can learn; the per-step jitter it cannot).

**Communication.** A ring all-reduce of ``m`` bytes over ``n`` workers (Thakur et al.; a
reduce-scatter then an all-gather, each ``n − 1`` hops of ``m/n`` bytes)::

    t_ar(n, m) = 2(n − 1)·α + 2·(n − 1)/n · m·β          (0 when n = 1)

with ``α`` the per-hop latency and ``β`` the time per byte. The buffer is the gradients
(``model_mb``) plus one float32 coverage slot per position of the step (``4·B_s`` bytes),
as in the real worker. A step of the synchronous protocol takes::

    T_step = max_i t_i(b_i) + t_ar(n, m)

and each worker reports ``compute_s = t_i(b_i)`` and ``wait_s = T_step − t_i(b_i)`` (its
all-reduce, including the wait for slower peers), the split the real worker reports.

**Parameter server** (:mod:`dynabatch.scheduler.sim.ps_job` only): a push or a pull of
``m`` bytes over ``k`` server actors,
:class:`~dynabatch.scheduler.sim.cluster_spec.ParameterServerModel`'s formulas.

**Recovery.** A node failure is seen by the survivors ``detect_s`` after it happens;
forming a group takes ``regroup_s`` plus the state broadcast ``model_mb·β``; a worker on a
joining node is up ``start_s`` after it is spawned (defaults measured on Ray:
:class:`~dynabatch.scheduler.sim.cluster_spec.RecoveryModel`).

**The ideal.** For a set of workers with true ``a_i, c_i`` (each node's own speed times the
slowdowns in force: its cluster events and the spec's emulation; no jitter) and global batch
``B``, the equal-finish split ``b*`` solves ``a_i + c_i·b_i* = T*`` with ``Σ b_i* = B`` and
``1 ≤ b_i*`` (:func:`dynabatch.scheduler.core.sync.steptime.equal_finish`; a worker whose one
sample already takes
longer than T* stays at 1). Worker ``i``'s throughput there is ``v_i = b_i* / t_i(b_i*)``
(``= b_i*/T*`` when no bound holds, so ``Σ v_i = B / T*``): the cluster's compute-only ideal.
Every allocation also pays the all-reduce, and with per-step jitter even the equal-finish
split finishes when its slowest draw does; the ideal is that split's expected step::

    T_ideal = max_i t_i(b_i*)·m_n + t_ar(n, m),   m_n = E[max of n iid exp(σ·z)]  (Monte Carlo)

and the ideal epoch is the sum of ``T_ideal`` over its steps (the last one at its own size).
``fraction_of_ideal = ideal epoch / measured steady epoch``; the compute-only ratio
``throughput / Σv_i`` is reported beside it.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

import numpy as np
from dynabatch.scheduler.core.sync.steptime import equal_finish
from dynabatch.scheduler.sim.cluster_spec import MB, ClusterSpec, Event


def compute_time(a: np.ndarray, c: np.ndarray, b: np.ndarray, factor: np.ndarray | float = 1.0,
                 eps: np.ndarray | float = 1.0) -> np.ndarray:
    """``(a + c·b)·factor·eps`` per worker; 0 where the share ``b`` is empty."""
    b = np.asarray(b, dtype=np.float64)
    t = (np.asarray(a) + np.asarray(c) * b) * factor * eps
    return np.where(b > 0, t, 0.0)


def jitter(rng: np.random.Generator, sigma: float, n: int) -> np.ndarray:
    """``exp(σ·z)``: multiplicative lognormal noise with median 1 (ones when σ = 0)."""
    if sigma <= 0.0:
        return np.ones(n)
    return np.exp(sigma * rng.standard_normal(n))


def ring_allreduce_s(n: int, nbytes: float, alpha_s: float, beta_s_per_byte: float) -> float:
    """``2(n−1)·α + 2(n−1)/n·bytes·β``; 0 for a single worker (no communication)."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) * alpha_s + 2.0 * (n - 1) / n * nbytes * beta_s_per_byte


def expected_max_jitter(sigma: float, n: int, seed: int = 0, trials: int = 400) -> float:
    """``E[max of n iid exp(σ·z)]`` by Monte Carlo (1 when σ = 0)."""
    if sigma <= 0.0 or n <= 0:
        return 1.0
    rng = np.random.default_rng([seed, 0x4D4158])
    total = 0.0
    chunk = max(1, 2_000_000 // n)
    done = 0
    while done < trials:
        k = min(chunk, trials - done)
        total += float(np.exp(sigma * rng.standard_normal((k, n)).max(axis=1)).sum())
        done += k
    return total / trials


@dataclass(frozen=True)
class Ideal:
    """The equal-finish optimum for a set of workers (see the module docstring)."""

    batches: np.ndarray  # b_i* (real)
    times: np.ndarray  # t_i(b_i*): T* for every worker a bound does not hold elsewhere
    epoch_s: float  # Σ over the epoch's steps of max_i t_i(b_i*)·m_n + t_ar

    @property
    def sum_v(self) -> float:
        """``Σ v_i``, ``v_i = b_i* / t_i(b_i*)``: each worker's throughput at its equal-finish
        batch."""
        return float((self.batches / self.times).sum())


@dataclass
class Node:
    node_id: str
    node_class: str
    a_s: float
    c_s: float
    cpus: float = 1.0
    gpus: float = 0.0
    alive: bool = True
    factor: float = 1.0  # product of the cluster's slowdown events in force
    e_s: float = 0.0  # seconds to score one held-out sample (its class's, with the spread)


@dataclass
class SimulatedCluster:
    """The cluster's nodes (true speeds), its noise source and its costs."""

    spec: ClusterSpec
    nodes: list[Node] = field(default_factory=list)
    by_class: dict[str, list[Node]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng([self.spec.seed, 0x4E4F495345])
        self._node_rng = np.random.default_rng([self.spec.seed, 0x4E4F4445])
        self._classes = {c.name: c for c in self.spec.classes}
        for c in self.spec.classes:
            self.by_class.setdefault(c.name, [])
            for _ in range(c.count):
                self.add_node(c.name)

    def add_node(self, class_name: str) -> Node:
        c = self._classes[class_name]
        k = len(self.by_class[class_name])
        spread = float(np.exp(self.spec.node_sigma * self._node_rng.standard_normal())) if (
            self.spec.node_sigma > 0) else 1.0
        node = Node(f"{class_name}-{k:05d}", class_name, c.a_ms / 1e3 * spread,
                    c.c_ms_per_sample / 1e3 * spread, c.cpus, c.gpus,
                    e_s=c.eval_ms_per_sample / 1e3 * spread)
        self.nodes.append(node)
        self.by_class[class_name].append(node)
        return node

    def apply(self, e: Event, busy: Container[str]) -> list[Node]:
        """Cluster event ``e`` happens: the nodes it adds, slows down or fails (the victims
        by the one rule of every simulator; ``busy``: the ids of the nodes hosting a worker)."""
        if e.join is not None:
            return [self.add_node(e.join.node_class) for _ in range(e.join.count)]
        if e.slowdown is not None:
            s = e.slowdown
            pool = self.by_class[s.node_class]
            nodes = pool if s.index is None else pool[s.index:s.index + 1]
            for n in nodes:
                n.factor = s.factor
            return nodes
        # A failure takes the class's ``index``-th node if it is alive; else the class's (or
        # the cluster's) alive nodes, the latest first, those hosting a worker first.
        sel = e.selector
        pool = [n for n in self.nodes if sel.node_class is None or n.node_class == sel.node_class]
        if sel.node_class is not None and sel.index is not None:
            pool = pool[sel.index:sel.index + 1]
        alive = [n for n in reversed(pool) if n.alive]
        victims = ([n for n in alive if n.node_id in busy]
                   + [n for n in alive if n.node_id not in busy])[:sel.count]
        for n in victims:
            n.alive = False
        return victims

    # --- costs ---------------------------------------------------------------------------
    def allreduce_s(self, n: int, step_size: int, model_bytes: float | None = None) -> float:
        """The step's ring all-reduce: the gradients (``model_mb``, or ``model_bytes`` when
        given) and one float32 coverage slot per position of the step."""
        ar = self.spec.allreduce
        grads = ar.model_mb * MB if model_bytes is None else model_bytes
        nbytes = grads + 4.0 * step_size
        return ring_allreduce_s(n, nbytes, ar.alpha_ms / 1e3, ar.beta_ms_per_mb / 1e3 / MB)

    def broadcast_s(self) -> float:
        """State broadcast at a regroup: the model's bytes once over each link (pipelined)."""
        ar = self.spec.allreduce
        return ar.model_mb * ar.beta_ms_per_mb / 1e3

    def ideal(self, a: np.ndarray, c: np.ndarray, global_batch: int,
              dataset_size: int) -> Ideal:
        """The equal-finish optimum for workers of true step costs ``a``, ``c`` (seconds; the
        slowdowns in force included, no jitter in ``b*``), with the expected jitter maximum
        and the all-reduce in the epoch time."""
        a = np.asarray(a, dtype=np.float64)
        c = np.asarray(c, dtype=np.float64)
        n = len(a)
        m_n = expected_max_jitter(self.spec.noise_sigma, n, self.spec.seed)

        def step(size: int) -> np.ndarray:
            b, _ = equal_finish(a, c, float(size), np.full(n, min(1.0, size / n)),
                                np.full(n, float(size)))
            return b

        b = step(global_batch)
        times = a + c * b
        full, last = divmod(dataset_size, global_batch)
        epoch = full * (float(times.max()) * m_n + self.allreduce_s(n, global_batch))
        if last:
            b_last = step(last)
            epoch += float((a + c * b_last).max()) * m_n + self.allreduce_s(n, last)
        return Ideal(b, times, epoch)

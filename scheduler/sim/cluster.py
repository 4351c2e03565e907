"""What a simulated cluster is made of, and how long its steps take. Pure: numpy, pydantic
and yaml only; no ray, no torch, no clock.

The simulator (:mod:`dynabatch.scheduler.sim.simulator`) runs the engine's own machines on a virtual
clock; this module says how much virtual time each thing costs.

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

**Parameter server** (the asynchronous protocols, :mod:`dynabatch.scheduler.sim.ps`; the synchronous
one does not use it): a push or a pull of ``m`` bytes takes ``push_ms + m·β_ps`` or
``pull_ms + m·β_ps``. Sharded over ``k`` server actors the k slices move in parallel, and a
push has two phases (slices 1..k−1 to their shards, then the commit with slice 0 to the
server that decides)::

    push = 2·push_ms + (m/k)·β_ps,     pull = pull_ms + (m/k)·β_ps        (k > 1)

**Recovery.** A node failure is seen by the survivors ``detect_s`` after it happens (their
collective fails; measured median 0.47 s with the fast health checks, bench/results-elastic
.json); forming a group takes ``regroup_s`` plus the state broadcast ``model_mb·β``
(measured median 0.08 s); a worker on a joining node is up ``start_s`` after it is spawned
(measured 6.5 s from node ready to join).

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

**Profiles from a real run.** :func:`profiles_from_report` fits ``a_i, c_i`` per worker from
a ``dynabatch run --report`` file: each epoch record gives one point
``(partition/steps, compute_s/steps / slowdown)``. Because ``t`` is affine in ``b``, the mean
step time over an epoch is exactly ``a + c·(mean b)``, so these points lie on the worker's
line; a least-squares fit over the epochs (:func:`dynabatch.scheduler.core.sync.steptime.fit`, the
policy's own
estimator) recovers it. Dividing by the recorded emulated slowdown gives the node's own
speed; the job spec's emulation re-applies it in the simulation. A worker whose batch never
changed (a static run) cannot separate ``a`` from ``c`` and gets the proportional fit
``a = 0``. The all-reduce is estimated as the median over epochs of the per-step wait of that
epoch's slowest worker (the one nobody waits for), put into ``α`` for the run's ``n``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import yaml
from dynabatch.scheduler.core.sync.steptime import StepTimeStats, equal_finish, fit
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

MB = 1 << 20
NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"


class ClusterError(ValueError):
    """A cluster description that cannot be used; ``str()`` is one line naming the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class NodeClass(_Strict):
    """``count`` nodes with per-step cost ``a_ms`` and per-sample cost ``c_ms_per_sample``.
    ``cpus``/``gpus`` are what the nodes offer; the engine reads them as its first guess at
    a new worker's speed, as it does on Ray."""

    name: str = Field(min_length=1, max_length=64, pattern=NAME_PATTERN)
    count: StrictInt = Field(ge=0, le=1_000_000)
    a_ms: float = Field(ge=0.0, le=1e7)
    c_ms_per_sample: float = Field(gt=0.0, le=1e7)
    cpus: float = Field(default=1.0, gt=0.0, le=4096.0)
    gpus: float = Field(default=0.0, ge=0.0, le=64.0)


class AllReduceModel(_Strict):
    """Ring all-reduce: ``2(n−1)·alpha + 2(n−1)/n · bytes · beta``."""

    alpha_ms: float = Field(default=0.005, ge=0.0, le=1e5, description="Per-hop latency.")
    beta_ms_per_mb: float = Field(default=0.1, ge=0.0, le=1e6,
                                  description="Milliseconds per MiB per link (0.1: ~10 GB/s).")
    model_mb: float = Field(default=0.0, ge=0.0, le=1e6,
                            description="Gradient bytes per step, in MiB.")


class ParameterServerModel(_Strict):
    """Push/pull latency for the asynchronous (parameter-server) protocols."""

    push_ms: float = Field(default=0.0, ge=0.0, le=1e6)
    pull_ms: float = Field(default=0.0, ge=0.0, le=1e6)
    beta_ms_per_mb: float = Field(default=0.1, ge=0.0, le=1e6)

    def push_s(self, nbytes: float, shards: int = 1) -> float:
        """One gradient push of ``nbytes`` over ``shards`` server actors."""
        hops = 1 if shards <= 1 else 2
        return (hops * self.push_ms + nbytes / max(1, shards) / MB * self.beta_ms_per_mb) / 1e3

    def pull_s(self, nbytes: float, shards: int = 1) -> float:
        """One weights pull of ``nbytes`` from ``shards`` server actors (in parallel)."""
        return (self.pull_ms + nbytes / max(1, shards) / MB * self.beta_ms_per_mb) / 1e3


class RecoveryModel(_Strict):
    """Costs of membership changes (defaults: medians measured in bench/results-elastic.json)."""

    detect_s: float = Field(default=0.5, ge=0.0, le=1e5)
    regroup_s: float = Field(default=0.1, ge=0.0, le=1e5)
    start_s: float = Field(default=6.5, ge=0.0, le=1e5)


class NodeSelector(_Strict):
    """``count`` nodes of class ``class`` (any class when omitted); ``index`` picks the
    class's ``index``-th node (in creation order) instead."""

    node_class: str | None = Field(default=None, alias="class")
    count: StrictInt = Field(default=1, ge=1, le=1_000_000)
    index: StrictInt | None = Field(default=None, ge=0)


class JoinSpec(_Strict):
    node_class: str = Field(alias="class")
    count: StrictInt = Field(default=1, ge=1, le=1_000_000)


class SlowdownSpec(_Strict):
    """From the event on, the step time of the class's ``index``-th node (every node of the
    class when ``index`` is omitted) is multiplied by ``factor``."""

    node_class: str = Field(alias="class")
    index: StrictInt | None = Field(default=None, ge=0)
    factor: float = Field(gt=0.0, le=1e4)


class Event(_Strict):
    """Something that happens to the cluster, at ``at_s`` seconds of simulated time (0 is the
    job's launch) or when the job reaches ``epoch`` (and ``step``)."""

    at_s: float | None = Field(default=None, ge=0.0)
    epoch: StrictInt | None = Field(default=None, ge=0)
    step: StrictInt = Field(default=0, ge=0)
    fail: StrictInt | NodeSelector | None = Field(default=None)
    join: JoinSpec | None = None
    slowdown: SlowdownSpec | None = None

    @field_validator("fail", mode="before")
    @classmethod
    def _fail_shape(cls, v: Any) -> Any:
        # One message instead of one per member of the int | NodeSelector union.
        if v is None or isinstance(v, dict) or (isinstance(v, int) and not isinstance(v, bool)):
            return v
        raise ValueError("must be a number of nodes or {class, count, index}")

    @model_validator(mode="after")
    def _one_of(self) -> Event:
        kinds = [k for k in ("fail", "join", "slowdown") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("give exactly one of fail, join, slowdown")
        if (self.at_s is None) == (self.epoch is None):
            raise ValueError("give exactly one of at_s, epoch")
        if isinstance(self.fail, int) and self.fail < 1:
            raise ValueError("fail: must be at least 1 node")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("fail", "join", "slowdown") if getattr(self, k) is not None)

    @property
    def selector(self) -> NodeSelector | None:
        if self.fail is None:
            return None
        return NodeSelector(count=self.fail) if isinstance(self.fail, int) else self.fail


class ClusterSpec(_Strict):
    """A simulated cluster: node classes with counts, noise, communication and events."""

    classes: Annotated[list[NodeClass], Field(min_length=1)]
    noise_sigma: float = Field(default=0.0, ge=0.0, le=2.0)
    node_sigma: float = Field(default=0.0, ge=0.0, le=2.0)
    seed: StrictInt = Field(default=0, ge=0, le=2**31 - 1)
    allreduce: AllReduceModel = Field(default_factory=AllReduceModel)
    parameter_server: ParameterServerModel = Field(default_factory=ParameterServerModel)
    recovery: RecoveryModel = Field(default_factory=RecoveryModel)
    events: list[Event] = Field(default_factory=list)

    @model_validator(mode="after")
    def _references(self) -> ClusterSpec:
        names = [c.name for c in self.classes]
        seen: set[str] = set()
        for i, n in enumerate(names):
            if n in seen:
                raise ValueError(f"classes.{i}.name: duplicate node class {n!r}")
            seen.add(n)
        if sum(c.count for c in self.classes) < 1:
            raise ValueError("classes: no nodes (every count is 0)")
        known = ", ".join(names)
        counts = {c.name: c.count for c in self.classes}
        for i, e in enumerate(self.events):
            target = e.fail if isinstance(e.fail, NodeSelector) else e.join or e.slowdown
            cls = getattr(target, "node_class", None)
            if cls is not None and cls not in seen:
                raise ValueError(f"events.{i}.{e.kind}.class: unknown node class {cls!r} "
                                 f"(classes: {known})")
            index = getattr(target, "index", None)
            if index is not None and e.kind != "join" and index >= counts[cls] and not any(
                    x.join is not None and x.join.node_class == cls for x in self.events):
                raise ValueError(f"events.{i}.{e.kind}.index: class {cls!r} has "
                                 f"{counts[cls]} nodes (indices 0..{counts[cls] - 1})")
            if isinstance(e.fail, NodeSelector) and e.fail.index is not None and e.fail.count != 1:
                raise ValueError(f"events.{i}.fail.count: give count 1 with index")
        return self

    @property
    def nodes(self) -> int:
        return sum(c.count for c in self.classes)


def format_errors(err: ValidationError) -> str:
    """One line, ``field: problem; field: problem`` (model-level problems name their field)."""
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        out.append(f"{loc}: {msg}" if loc and not _names_field(msg) else
                   (f"{loc}.{msg}" if loc else msg))
    return " ".join("; ".join(out).split())


def _names_field(msg: str) -> bool:
    """A model validator's message that already starts with its own field path."""
    return bool(re.match(r"^[A-Za-z_][\w.]*: ", msg))


def parse_cluster(data: Any) -> ClusterSpec:
    if not isinstance(data, dict):
        raise ClusterError(f"cluster: expected a mapping of fields, got {type(data).__name__}")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as err:
        raise ClusterError(format_errors(err)) from None


def load_cluster(path: str | Path) -> ClusterSpec:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ClusterError(f"{p}: cannot read cluster ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ClusterError(" ".join(f"{p}: not valid YAML ({err})".split())) from None
    return parse_cluster(data)


def check_job(cluster: ClusterSpec, global_batch: int, workers: int | None) -> None:
    """The job's workers must each get a sample per step (``workers``: None = one per node)."""
    n = cluster.nodes if workers is None else min(workers, cluster.nodes)
    if n > global_batch:
        what = "nodes (workers: auto)" if workers is None else "workers"
        raise ClusterError(
            f"classes: {n} {what} is more than global_batch ({global_batch}): every worker "
            "needs at least one sample per step")


# ---------------------------------------------------------------------------- formulas
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
    def step_compute_s(self) -> float:
        """A full step's compute: T*, or longer when a worker's minimum batch of 1 sample
        already takes longer (a per-step cost above T*)."""
        return float(self.times.max())

    @property
    def v(self) -> np.ndarray:
        """``v_i = b_i* / t_i(b_i*)``: each worker's throughput at its equal-finish batch."""
        return self.batches / self.times

    @property
    def sum_v(self) -> float:
        return float(self.v.sum())


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


@dataclass
class ClusterModel:
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
                    c.c_ms_per_sample / 1e3 * spread, c.cpus, c.gpus)
        self.nodes.append(node)
        self.by_class[class_name].append(node)
        return node

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

    def push_s(self, nbytes: float, shards: int = 1) -> float:
        return self.spec.parameter_server.push_s(nbytes, shards)

    def pull_s(self, nbytes: float, shards: int = 1) -> float:
        return self.spec.parameter_server.pull_s(nbytes, shards)

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


# ------------------------------------------------------------------- real-run profiles
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
    waits: list[float] = []
    for e, rec in enumerate(history):
        workers = rec.get("workers") if isinstance(rec, dict) else None
        if not isinstance(workers, list):
            raise ClusterError(f"history.{e}.workers: missing")
        slowest: tuple[float, float] | None = None
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
            x, y = part / steps, comp / steps / slow
            stats[name] = stats.get(name, StepTimeStats()).add(x, y)
            nodes[name] = node
            points[name] = points.get(name, 0) + 1
            if slowest is None or comp / steps > slowest[0]:
                slowest = (comp / steps, wait / steps)
        if slowest is not None:
            waits.append(slowest[1])
    out = []
    for name in sorted(stats, key=_ordinal):
        f = fit(stats[name])
        if f is None:
            raise ClusterError(f"history: worker {name} has no usable compute times")
        out.append(WorkerProfile(name, nodes[name], f.a, f.c, points[name]))
    if not out:
        raise ClusterError("history: no worker trained a sample")
    return out, float(np.median(waits)) if waits else 0.0


def _ordinal(worker: str) -> tuple[float, str]:
    """Sort key: ``w10`` after ``w9``; other names last."""
    m = re.match(r"^w(\d+)$", worker)
    return (float(m.group(1)), worker) if m else (math.inf, worker)


def cluster_from_profiles(profiles: Sequence[WorkerProfile], allreduce_s: float, *,
                          noise_sigma: float = 0.0, seed: int = 0,
                          events: Sequence[dict] = ()) -> ClusterSpec:
    """One single-node class per profiled worker (in worker order, so worker ``w{k}`` lands
    on its own profile again), with the measured all-reduce put into ``α`` for this ``n``."""
    n = len(profiles)
    alpha_ms = allreduce_s * 1e3 / (2 * (n - 1)) if n > 1 else 0.0
    return parse_cluster({
        "classes": [{"name": f"{p.worker}", "count": 1, "a_ms": p.a_s * 1e3,
                     "c_ms_per_sample": p.c_s * 1e3} for p in profiles],
        "noise_sigma": noise_sigma, "seed": seed,
        "allreduce": {"alpha_ms": alpha_ms, "beta_ms_per_mb": 0.0, "model_mb": 0.0},
        "events": list(events),
    })

"""Parameter-server training in the simulator: the same
:class:`~dynabatch.scheduler.core.ps.machine.PSCore`
(protocol, ledger, batch policy) as the Ray server actor, on a virtual clock, with real
gradients computed in-process.

Each learner ``i`` takes ``t_i(b) = (a_i + c_i·b)·ε`` seconds of virtual time to compute a
gradient over ``b`` samples (``ε`` a log-normal jitter with σ = ``noise``), plus ``rtt_s``
and, with a cluster's ``parameter_server`` costs, the pull and push of the model's bytes
over ``shards`` server actors (:class:`dynabatch.scheduler.sim.cluster.ParameterServerModel`). A
learner's gradient is computed when it pulls (it depends only on the weights of the version
it pulled, so this is exact) and pushed ``t_i(b)`` and the transfers later; the server's own
work takes no virtual time. Learners lost at a given time have their in-flight gradient
dropped (the core re-queues its samples); joining learners pull and start.

Real gradients: one :class:`~dynabatch.actors.ps.ParamStore` (flat weights and the optimizer state)
and one :class:`~dynabatch.actors.ps.GradientComputer` replica, which loads the pulled weights for
each
gradient. This module imports torch (through :mod:`dynabatch.actors.ps`); the pure core does not.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from dynabatch.actors.ps import GradientComputer, ParamStore
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.scheduler.core.ps.machine import PSCore
from dynabatch.scheduler.sim.cluster import (
    ClusterError,
    ClusterModel,
    ClusterSpec,
    ParameterServerModel,
)


@dataclass(frozen=True, slots=True)
class SimLearner:
    name: str
    per_sample_s: float  # c_i
    overhead_s: float = 0.0  # a_i


@dataclass(frozen=True, slots=True)
class PSSimConfig:
    learners: tuple[SimLearner, ...]
    noise: float = 0.05
    rtt_s: float = 0.0
    seed: int = 0
    lose: tuple[tuple[float, str], ...] = ()  # (virtual time, learner)
    join: tuple[tuple[float, SimLearner], ...] = ()
    eval_train: bool = True  # final training loss over the whole training set
    parameter_server: ParameterServerModel | None = None  # push/pull costs (none: free)
    shards: int = 1


@dataclass
class PSSimResult:
    epochs: list[dict[str, Any]] = field(default_factory=list)
    staleness: dict[str, list[int]] = field(default_factory=dict)  # per worker, applied τ
    virtual_s: float = 0.0
    samples_applied: int = 0
    final_train_loss: float | None = None
    snapshot: dict[str, Any] = field(default_factory=dict)
    weights: np.ndarray | None = None  # the server's final flat weights

    @property
    def throughput(self) -> float:
        return self.samples_applied / self.virtual_s if self.virtual_s else 0.0

    def staleness_summary(self) -> dict[str, float]:
        all_tau = np.array([t for v in self.staleness.values() for t in v] or [0])
        return {"mean": float(all_tau.mean()), "p99": float(np.percentile(all_tau, 99)),
                "max": float(all_tau.max())}


def simulate_ps(spec: JobSpec, core: PSCore, config: PSSimConfig,
                data: Any | None = None) -> PSSimResult:
    ds = data if data is not None else load_dataset(spec.dataset, seed=spec.seed)
    shape, classes = tuple(ds.input_shape), ds.num_classes
    store = ParamStore(spec, shape, classes)
    computer = GradientComputer(spec, ds.x_train, ds.y_train, shape, classes)
    rng = np.random.default_rng(config.seed)
    models = {ln.name: ln for ln in config.learners}
    ps_cost = config.parameter_server
    nbytes = 4.0 * store.size  # float32 weights and gradients
    comm_s = config.rtt_s + (0.0 if ps_cost is None else
                             ps_cost.pull_s(nbytes, config.shards)
                             + ps_cost.push_s(nbytes, config.shards))
    res = PSSimResult()
    heap: list[tuple[float, int, str, str, Any]] = []
    seq = 0

    def at(t: float, kind: str, worker: str, payload: Any = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, worker, payload))

    grads: dict[int, np.ndarray] = {}
    idle: set[str] = set()
    alive: set[str] = set()

    def handle(events: Sequence[Any], t: float) -> None:
        for e in events:
            kind = type(e).__name__
            if kind == "Apply":
                store.apply([(grads.pop(g.push_id), g.weight) for g in e.gradients])
                for g in e.gradients:
                    res.staleness.setdefault(g.worker, []).append(g.staleness)
                    res.samples_applied += g.samples
            elif kind == "Refuse":
                grads.pop(e.push_id, None)
            elif kind == "EpochEnd":
                loss, acc = store.evaluate(ds.x_test, ds.y_test)
                res.epochs.append({"epoch": e.epoch, "t": t, "version": e.version,
                                   "test_loss": loss, "test_accuracy": acc,
                                   "verified": e.verification.verified,
                                   "problems": list(e.verification.problems)})

    def wake(t: float) -> None:
        for w in sorted(idle):
            at(t, "request", w)
        idle.clear()

    for ln in config.learners:
        core.join(ln.name)
        alive.add(ln.name)
        at(0.0, "request", ln.name)
    for t, w in config.lose:
        at(t, "lose", w)
    for t, ln in config.join:
        at(t, "join", ln.name, ln)

    t = 0.0
    while heap and not core.finished:
        t, _, kind, w, payload = heapq.heappop(heap)
        if kind == "join":
            models[w] = payload
            core.join(w)
            alive.add(w)
            at(t, "request", w)
            continue
        if kind == "lose":
            if w in alive:
                alive.discard(w)
                idle.discard(w)
                handle(core.leave(w), t)
                wake(t)
            continue
        if w not in alive:
            continue  # a lost learner's pending request or push never happens
        if kind == "request":
            work, events = core.request(w)
            handle(events, t)
            name = type(work).__name__
            if name == "Idle":
                idle.add(w)
            elif name == "Work":
                ids = computer.indices(work.seed, work.epoch, work.dataset_size,
                                       work.chunk.ranges)
                g, _ = computer.gradient(store.flat.detach(), ids)
                grads[work.ticket] = g.copy()
                m = models[w]
                dt = (m.overhead_s + m.per_sample_s * len(ids)) * math.exp(
                    config.noise * rng.standard_normal())
                at(t + dt + comm_s, "push", w, (work, dt))
            if events:
                wake(t)
        elif kind == "push":
            work, dt = payload
            handle(core.push(w, work.ticket, work.version, dt), t)
            at(t, "request", w)
            wake(t)
    res.virtual_s = t
    res.snapshot = core.snapshot()
    res.weights = store.weights()
    if config.eval_train:
        res.final_train_loss = store.evaluate(ds.x_train, ds.y_train)[0]
    return res


def learners_on(spec: JobSpec, cluster: ClusterSpec) -> PSSimConfig:
    """The job's learners on a simulated cluster (``dynabatch simulate`` of a ``protocol: ps``
    spec): learner ``w{i}`` on node ``i mod nodes`` (as the Ray driver places them), its
    ``a, c`` the node's times the spec's emulated slowdown, the cluster's noise, its
    ``parameter_server`` push/pull costs over ``protocol.shards`` servers. Events at ``at_s``
    that fail nodes lose their learners; joins add one learner per new node. Epoch-timed
    events and slowdowns are refused (the parameter-server simulator runs on time only)."""
    model = ClusterModel(cluster)
    nodes = list(model.nodes)
    slow = spec.emulation.slowdowns
    n = spec.initial_workers or len(nodes)

    def learner(i: int, node: Any) -> SimLearner:
        f = slow[i] if i < len(slow) else 1.0
        return SimLearner(f"w{i}", node.c_s * f, node.a_s * f)

    learners = [learner(i, nodes[i % len(nodes)]) for i in range(n)]
    placed = {ln.name: nodes[i % len(nodes)] for i, ln in enumerate(learners)}
    lose: list[tuple[float, str]] = []
    join: list[tuple[float, SimLearner]] = []
    for k, e in enumerate(cluster.events):
        if e.at_s is None or e.kind == "slowdown":
            raise ClusterError(f"events.{k}: the parameter-server simulator takes fail and "
                               f"join events at at_s only, not {e.kind} at an epoch")
        if e.kind == "join":
            for _ in range(e.join.count):
                node = model.add_node(e.join.node_class)
                ln = learner(n, node)
                n += 1
                placed[ln.name] = node
                join.append((e.at_s, ln))
            continue
        sel = e.selector
        pool = (model.nodes if sel.node_class is None else model.by_class[sel.node_class])
        pool = [x for x in pool if x.alive]
        if sel.index is not None:
            pool = [model.by_class[sel.node_class][sel.index]]
        for node in pool[:sel.count]:  # every learner on a failed node is lost
            node.alive = False
            lose.extend((e.at_s, w) for w, x in placed.items() if x is node)
    return PSSimConfig(tuple(learners), noise=cluster.noise_sigma, seed=cluster.seed,
                       lose=tuple(lose), join=tuple(join),
                       parameter_server=cluster.parameter_server, shards=spec.protocol.shards)

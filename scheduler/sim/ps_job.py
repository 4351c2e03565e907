"""Parameter-server training in the simulator: the shipped
:class:`~dynabatch.scheduler.ps.driver.PSCoordinator` (the same driver, core, ledger, batch
policy and event interpreter as on Ray) over a
:class:`~dynabatch.scheduler.sim.ps_runtime.SimPSRuntime` on a virtual clock, with real
gradients computed in-process.

* :func:`simulate_ps`: run a job on learners of given speeds (:class:`PSSimConfig`), or on a
  simulated cluster (``PSSimConfig.cluster``, built by :func:`learners_on`);
* :class:`PSSimResult`: the server's epoch records, every applied gradient's staleness per
  learner, the virtual time, the final weights and training loss, the driver's history.

Learners ``w0, w1, ...`` are named by the driver; learner ``i`` of a :class:`PSSimConfig`
without a cluster runs on its own node (named after ``learners[i].name``), ``lose`` fails
the node of the named learner and ``join`` adds a node with the given speed, on which the
driver starts the next learner. This module imports torch (through the runtime).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from dynabatch.actors.spec import ArtifactsSpec, JobSpec, TrackingSpec
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.scheduler.core.ps.machine import PSCore
from dynabatch.scheduler.sim.cluster_spec import ClusterError, ClusterSpec, ParameterServerModel
from dynabatch.scheduler.sim.cost_model import Node, SimulatedCluster
from dynabatch.scheduler.sim.ps_runtime import Join, NodeFailure, SimPSRuntime, TimedEvent
from dynabatch.scheduler.sim.timeline import ClusterHappening, SimClock
from dynabatch.scheduler.telemetry import EpochRecord


@dataclass(frozen=True, slots=True)
class SimLearner:
    name: str
    per_sample_s: float  # c_i
    overhead_s: float = 0.0  # a_i


@dataclass(frozen=True, slots=True)
class PSSimConfig:
    """``cluster``: run on that cluster's nodes and timed events instead (``learners``,
    ``lose`` and ``join`` unused); each learner's ``a, c`` is its node's times the spec's
    emulated slowdown of its ordinal."""

    learners: tuple[SimLearner, ...]
    noise: float = 0.05
    rtt_s: float = 0.0
    seed: int = 0
    lose: tuple[tuple[float, str], ...] = ()  # (virtual time, learner)
    join: tuple[tuple[float, SimLearner], ...] = ()
    eval_train: bool = True  # final training loss over the whole training set
    parameter_server: ParameterServerModel | None = None  # push/pull costs (none: free)
    shards: int = 1
    cluster: ClusterSpec | None = None


@dataclass
class PSSimResult:
    epochs: list[dict[str, Any]] = field(default_factory=list)
    staleness: dict[str, list[int]] = field(default_factory=dict)  # per worker, applied τ
    virtual_s: float = 0.0
    samples_applied: int = 0
    final_train_loss: float | None = None
    snapshot: dict[str, Any] = field(default_factory=dict)
    weights: np.ndarray | None = None  # the server's final flat weights
    state: str = ""  # the driver's final JobState value
    reason: str | None = None
    history: list[EpochRecord] = field(default_factory=list)  # the driver's epoch records
    happened: list[ClusterHappening] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.samples_applied / self.virtual_s if self.virtual_s else 0.0

    def staleness_summary(self) -> dict[str, float]:
        all_tau = np.array([t for v in self.staleness.values() for t in v] or [0])
        return {"mean": float(all_tau.mean()), "p99": float(np.percentile(all_tau, 99)),
                "max": float(all_tau.max())}


def _node(ln: SimLearner) -> Node:
    return Node(ln.name, ln.name, ln.overhead_s, ln.per_sample_s)


def _world(spec: JobSpec, config: PSSimConfig) -> tuple[list[Node], Any, list[TimedEvent]]:
    """The nodes, each learner's speed and the timed events of ``config``."""
    if config.cluster is None:
        events: list[TimedEvent] = [(t, NodeFailure(1, w, 0)) for t, w in config.lose]
        events += [(t, Join(lambda ln=ln: [_node(ln)])) for t, ln in config.join]
        return [_node(ln) for ln in config.learners], lambda i, n: (n.a_s, n.c_s), events
    model = SimulatedCluster(config.cluster)
    slow = spec.emulation.slowdowns

    def speed(i: int, node: Node) -> tuple[float, float]:
        f = slow[i] if i < len(slow) else 1.0
        return node.a_s * f, node.c_s * f

    events = []
    for e in config.cluster.events:
        if e.kind == "join":
            j = e.join
            events.append((e.at_s, Join(lambda j=j: [model.add_node(j.node_class)
                                                    for _ in range(j.count)])))
        else:
            sel = e.selector
            events.append((e.at_s, NodeFailure(sel.count, sel.node_class, sel.index)))
    return model.nodes, speed, events


def simulate_ps(spec: JobSpec, core: PSCore, config: PSSimConfig,
                data: Any | None = None, job_id: str = "sim-ps") -> PSSimResult:
    """Run ``spec`` with ``core`` through the production driver on the simulated learners."""
    from dynabatch.scheduler.ps.driver import PSCoordinator

    ds = data if data is not None else load_dataset(spec.dataset, seed=spec.seed)
    # As the synchronous simulator: a simulation writes no event files into the job's
    # tracking directory, nor its model into its artifacts directory (the driver keeps
    # the model's files: model_files()).
    spec = spec.model_copy(update={"tracking": TrackingSpec(), "artifacts": ArtifactsSpec()})
    if config.cluster is None:  # one learner per configured learner
        spec = spec.model_copy(update={"workers": len(config.learners)})
    nodes, speed, events = _world(spec, config)
    clock = SimClock()
    runtime = SimPSRuntime(spec, ds, nodes, speed, events=events, noise=config.noise,
                           seed=config.seed, rtt_s=config.rtt_s,
                           parameter_server=config.parameter_server, shards=config.shards,
                           clock=clock)
    coord = PSCoordinator(job_id, spec, runtime=runtime, core=core, clock=clock,
                          final_train_loss=config.eval_train)
    coord.run()
    snap = coord.snapshot()
    interp = runtime.events
    return PSSimResult(
        epochs=list(runtime.epochs), staleness=interp.staleness if interp else {},
        virtual_s=clock.now(), samples_applied=interp.samples_applied if interp else 0,
        final_train_loss=coord.final_train_loss, snapshot=core.snapshot(),
        weights=runtime.store.weights() if runtime.store is not None else None,
        state=snap.state.value, reason=snap.reason, history=coord.history(),
        happened=list(runtime.happened))


def learners_on(spec: JobSpec, cluster: ClusterSpec) -> PSSimConfig:
    """The job on a simulated cluster (``dynabatch simulate`` of a ``protocol: ps`` spec):
    the driver places learner ``w{i}`` on node ``i mod nodes`` as on Ray, its ``a, c`` the
    node's times the spec's emulated slowdown, with the cluster's noise and its
    ``parameter_server`` push/pull costs over ``protocol.shards`` servers. Events at ``at_s``
    that fail nodes lose their learners (the nodes chosen by the rule every simulator uses);
    joins add one learner per new node. Epoch-timed events, slowdowns and a fault script
    are refused (the parameter-server simulator runs on time only, and has no segments,
    regroups or spares for the script's faults)."""
    if cluster.faults:
        raise ClusterError("faults: the parameter-server simulator plays no fault script "
                           "(protocol sync only)")
    for k, e in enumerate(cluster.events):
        if e.at_s is None or e.kind == "slowdown":
            raise ClusterError(f"events.{k}: the parameter-server simulator takes fail and "
                               f"join events at at_s only, not {e.kind} at an epoch")
    return PSSimConfig((), noise=cluster.noise_sigma, seed=cluster.seed,
                       parameter_server=cluster.parameter_server, shards=spec.protocol.shards,
                       cluster=cluster)

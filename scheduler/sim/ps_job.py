"""Parameter-server training in the simulator: the shipped
:class:`~dynabatch.scheduler.ps.driver.PSCoordinator` (the same driver, core, ledger, batch
policy and event interpreter as on Ray) over a
:class:`~dynabatch.scheduler.sim.ps_runtime.SimPSRuntime` on a simulated cluster's virtual
clock, with real gradients computed in-process. This module imports torch (through the
runtime).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from dynabatch.actors.spec import ArtifactsSpec, JobSpec, TrackingSpec
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.scheduler.core.ps.machine import PSCore
from dynabatch.scheduler.sim.cluster_spec import ClusterError, ClusterSpec
from dynabatch.scheduler.sim.cost_model import SimulatedCluster
from dynabatch.scheduler.sim.ps_runtime import SimPSRuntime
from dynabatch.scheduler.sim.timeline import ClusterHappening, SimClock
from dynabatch.scheduler.telemetry import EpochRecord


@dataclass
class PSSimResult:
    """The server's epoch records, every applied gradient's staleness per learner, the
    virtual time, the final weights and training loss, the driver's history."""

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


def simulate_ps(spec: JobSpec, core: PSCore, cluster: ClusterSpec, *,
                data: Any | None = None, job_id: str = "sim-ps",
                final_train_loss: bool = True) -> PSSimResult:
    """Run ``spec`` with ``core`` through the production driver on ``cluster``: learner
    ``w{i}`` on node ``i mod nodes``, as on Ray. ``final_train_loss``: evaluate the final
    weights on the whole training set."""
    from dynabatch.scheduler.ps.driver import PSCoordinator

    check_cluster(cluster)
    ds = data if data is not None else load_dataset(spec.dataset, seed=spec.seed)
    # As the synchronous simulator: a simulation writes no event files into the job's
    # tracking directory, nor its model into its artifacts directory (the driver keeps
    # the model's files: model_files()).
    spec = spec.model_copy(update={"tracking": TrackingSpec(), "artifacts": ArtifactsSpec()})
    clock = SimClock()
    runtime = SimPSRuntime(spec, ds, SimulatedCluster(cluster), clock=clock)
    coord = PSCoordinator(job_id, spec, runtime=runtime, core=core, clock=clock)
    coord.run()
    snap = coord.snapshot()
    interp = runtime.events
    store = runtime.store
    loss = store.evaluate(ds.x_train, ds.y_train)[0] if final_train_loss and store else None
    return PSSimResult(
        epochs=list(runtime.epochs), staleness=interp.staleness if interp else {},
        virtual_s=clock.now(), samples_applied=interp.samples_applied if interp else 0,
        final_train_loss=loss, snapshot=core.snapshot(),
        weights=store.weights() if store is not None else None,
        state=snap.state.value, reason=snap.reason, history=coord.history(),
        happened=list(runtime.happened))


def check_cluster(cluster: ClusterSpec) -> None:
    """The parameter-server simulator runs on time only: it takes fail and join events at
    ``at_s``, and has no segments, regroups or spares for a fault script to hit."""
    if cluster.faults:
        raise ClusterError("faults: the parameter-server simulator plays no fault script "
                           "(protocol sync only)")
    for k, e in enumerate(cluster.events):
        if e.at_s is None or e.kind == "slowdown":
            raise ClusterError(f"events.{k}: the parameter-server simulator takes fail and "
                               f"join events at at_s only, not {e.kind} at an epoch")

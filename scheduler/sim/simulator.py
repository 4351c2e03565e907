"""The simulator: the engine's own machines on a virtual clock.

:func:`simulate` builds the production :class:`~dynabatch.scheduler.sync.coordinator.Coordinator`
(so the same :class:`~dynabatch.scheduler.core.sync.protocol.SyncProtocol`, policy, tracker,
ledger, membership and failure classes, and the same driver code) over a
:class:`~dynabatch.scheduler.sim.runtime.SimRuntime` instead of Ray. The runtime is the world:
it answers the coordinator's calls from a
:class:`~dynabatch.scheduler.sim.cost_model.SimulatedCluster` and moves the
:class:`~dynabatch.scheduler.sim.timeline.SimClock` by the time each call would take. Nothing
of the engine is copied here; a claim measured in the simulator
is a claim about the shipped code.

What each call costs, and how failures, stragglers and injected errors play out, is
:mod:`dynabatch.scheduler.sim.runtime`; the cluster's events,
:mod:`dynabatch.scheduler.sim.world`. :func:`simulate` runs a job and returns a
:class:`SimResult` (the coordinator's history, the cluster's happenings, the steady
throughput and its fraction of the cluster's ideal).

This module imports neither ray nor torch; the coordinator (whose checkpoint module imports
torch) is imported when :func:`simulate` runs, and real-gradient mode imports
:mod:`dynabatch.scheduler.sim.gradients` (torch) only when asked for.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynabatch.actors.spec import ArtifactsSpec, CheckpointSpec, JobSpec, TrackingSpec
from dynabatch.scheduler.runtime.seam import DataInfo
from dynabatch.scheduler.sim.cluster_spec import ClusterError, ClusterSpec, check_job
from dynabatch.scheduler.sim.cost_model import Ideal, SimulatedCluster
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sim.timeline import ClusterHappening, Recovery, SimClock

if TYPE_CHECKING:
    from dynabatch.scheduler.sync.coordinator import Coordinator
    from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine, MembershipEvent


# The service caps a job at dynabatch.actors.spec.MAX_WORKERS (4096) workers, and the coordinator
# builds its Membership with that cap. It is a limit of the service, not of the engine's
# machines, so simulated clusters beyond it lift it (the coordinator's ``worker_cap``).
SIM_MAX_WORKERS = 1_000_000

# ------------------------------------------------------------------------------ the driver
@dataclass
class SimResult:
    spec: JobSpec
    cluster: ClusterSpec
    snapshot: JobSnapshot
    history: list[EpochRecord]
    events: list[MembershipEvent]
    logs: list[LogLine]
    happened: list[ClusterHappening]
    recoveries: list[Recovery]
    sim_seconds: float
    wall_s: float
    dataset_size: int
    ideal: Ideal | None
    runtime: SimRuntime = field(repr=False)

    def steady(self) -> list[EpochRecord]:
        """The epochs after the first two (the policies' learning epochs)."""
        return self.history[2:] or self.history

    @property
    def steady_epoch_s(self) -> float | None:
        s = self.steady()
        return statistics.mean(r.wall_s for r in s) if s else None

    @property
    def throughput(self) -> float | None:
        s = self.steady()
        wall = sum(r.wall_s for r in s)
        return sum(r.samples_trained for r in s) / wall if wall else None

    @property
    def fraction_of_ideal(self) -> float | None:
        """ideal epoch / measured steady epoch (see :mod:`dynabatch.scheduler.sim.cost_model`)."""
        e = self.steady_epoch_s
        return self.ideal.epoch_s / e if self.ideal and e else None

    @property
    def compute_fraction(self) -> float | None:
        """Steady throughput over Σv_i: the compute-only ratio (communication and per-step
        jitter count against it)."""
        tp = self.throughput
        return tp / self.ideal.sum_v if self.ideal and tp else None

    def steady_mean(self, attr: str) -> float | None:
        s = self.steady()
        return statistics.mean(getattr(r, attr) for r in s) if s else None


def dataset_sizes(spec: JobSpec) -> tuple[str, int, int]:
    """(name, train, test) of the job's dataset, loaded as a real run loads it (no torch)."""
    from dynabatch.actors.workloads.datasets import load_dataset

    ds = load_dataset(spec.dataset, seed=spec.seed)
    return ds.name, len(ds.y_train), len(ds.y_test)


def simulate(
    spec: JobSpec,
    cluster: ClusterSpec,
    *,
    dataset_size: int | None = None,
    real_gradients: bool = False,
    holdout: float = 0.0,
    progress: Callable[[int, int], None] | None = None,
    coordinator_hook: Callable[[Coordinator], None] | None = None,
) -> SimResult:
    """Run ``spec`` on ``cluster`` with the production coordinator over a :class:`SimRuntime`.

    ``dataset_size``: timing-only mode trains this many samples per epoch without loading the
    data (default: the size of the job's dataset). ``real_gradients``: train the actual model
    on the actual data (one worker's share after another); ``holdout``: evaluate it on that
    fraction of the training samples, held out of training (a validation split), instead of
    the test set. ``progress(done, total)`` is called
    after every control-loop step. ``coordinator_hook`` sees the coordinator before it runs
    (tests record its decisions).
    """
    check_job(cluster, spec.batch_range[0], spec.initial_workers)
    # The simulator never writes into the job's checkpoint, artifacts or tracking directory
    # (with real gradients, the coordinator keeps the trained model's files: model_files()).
    spec = spec.model_copy(update={"checkpoint": CheckpointSpec(), "artifacts": ArtifactsSpec(),
                                   "tracking": TrackingSpec()})
    gradients = None
    if real_gradients:
        from dynabatch.scheduler.sim.gradients import GradientEngine

        gradients = GradientEngine(spec, holdout)
        if dataset_size is not None and dataset_size != gradients.n_train:
            raise ClusterError(f"dataset_size: real-gradient mode trains the job's dataset "
                               f"({gradients.n_train} samples), not {dataset_size}")
        data = DataInfo(gradients.name, gradients.n_train, gradients.n_test,
                        gradients.input_shape, gradients.num_classes,
                        n_validation=0 if holdout else gradients.n_validation)
    elif dataset_size is None:
        data = DataInfo(*dataset_sizes(spec))
    else:
        if dataset_size < 1:
            raise ClusterError(f"dataset_size: must be at least 1, got {dataset_size}")
        data = DataInfo(f"{spec.dataset.name} (timing only)", dataset_size, 0)
    model = SimulatedCluster(cluster)
    clock = SimClock()
    runtime = SimRuntime(spec, model, clock=clock, data=data, gradients=gradients)

    from dynabatch.scheduler.sync.coordinator import (
        Coordinator,  # imports torch (dynabatch.scheduler.checkpoint)
    )

    coord = Coordinator(f"sim-{spec.policy}", spec, resume=False, runtime=runtime,
                        clock=clock, worker_cap=SIM_MAX_WORKERS)
    if coordinator_hook is not None:
        coordinator_hook(coord)
    # Steps per epoch at each epoch's planned batch (a stage schedule's; goodput mode's
    # first batch): the progress bar's scale.
    before = [0]
    for e in range(spec.epochs):
        before.append(before[-1] + -(-data.n_train // coord.regime.batch_for(e)))
    total = before[-1]
    t0 = time.perf_counter()
    while coord.step():
        if progress is not None:
            done = before[min(coord.epoch, spec.epochs)] + coord.step_in_epoch
            progress(min(done, total), total)
    wall = time.perf_counter() - t0
    if progress is not None:
        progress(total, total)
    history = coord.history()
    ideal = None
    if history:
        last = history[-1]
        a, c = runtime.speeds_in_force([(w.worker, w.node) for w in last.workers], last.epoch)
        ideal = model.ideal(a, c, spec.global_batch, data.n_train)
    return SimResult(
        spec=spec, cluster=cluster, snapshot=coord.snapshot(), history=history,
        events=coord.membership_events(), logs=coord.logs(), happened=runtime.happened,
        recoveries=runtime.recoveries, sim_seconds=clock.now(), wall_s=wall,
        dataset_size=data.n_train, ideal=ideal, runtime=runtime)

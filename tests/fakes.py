"""Test doubles without Ray: :class:`FakeCluster`, the service's cluster, and
:class:`FakeRuntime`, a runtime with injected faults for the coordinator's own tests.

:class:`FakeCluster` is an in-memory :class:`dynabatch.service.cluster_client.ClusterClient`
for route, service and client tests. Each job it launches is run by the real driver (the
synchronous :class:`~dynabatch.scheduler.sync.coordinator.Coordinator`, or the
:class:`~dynabatch.scheduler.ps.driver.PSCoordinator` for ``protocol: ps``) on the
simulator's runtime and virtual clock, over a simulated cluster whose nodes are the ones
``nodes()`` lists: the service meets the real lifecycle, snapshots, records, log lines,
checkpoints and errors. Nothing runs in the background: each ``snapshot()`` (when
``auto_advance``) or ``advance()`` is one step boundary of the job's driver
(``coordinator.step()``), so tests are deterministic. Coordinators live in the FakeCluster, not
in a JobService, so a second service on the same cluster re-attaches them the way an API
restart finds detached actors; one launched again for a job resumes from the checkpoint its
predecessor wrote in ``checkpoint.dir``, as on Ray.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from dynabatch.actors.accumulate import largest_micro, micro_ranges
from dynabatch.actors.contracts import SegmentPlan, SegmentResult, StepTelemetry, encode_counts
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.scheduler.control import JobControl
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.core.lifecycle import InvalidTransition
from dynabatch.scheduler.core.membership import NodeInfo, Spawn
from dynabatch.scheduler.ps.driver import PSCoordinator, build_core
from dynabatch.scheduler.runtime.seam import (
    DataInfo,
    RegroupResult,
    ShardResult,
    Started,
    WorkerCallError,
)
from dynabatch.scheduler.sim.cluster_spec import parse_cluster
from dynabatch.scheduler.sim.cost_model import SimulatedCluster
from dynabatch.scheduler.sim.ps_runtime import Fail, SimPSRuntime
from dynabatch.scheduler.sim.replicas import StepOutcome
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sim.timeline import SimClock
from dynabatch.scheduler.sync.coordinator import Coordinator
from dynabatch.scheduler.telemetry import (
    EpochRecord,
    JobSnapshot,
    LogLine,
)
from dynabatch.service.cluster_client import ClusterNode
from dynabatch.service.errors import (
    ClusterUnavailable,
    CoordinatorGone,
    JobConflict,
    RayCallError,
    WorkerNotFound,
)

NODE_IDS = ("a" * 56, "b" * 56)


def _sim_cluster(node_ids: tuple[str, ...], hold: bool) -> SimulatedCluster:
    """One simulated node per id, each slower than the one before (unequal nodes), where a
    worker starts at once; with ``hold``, every node is down from the start. A step takes
    about 0.1 s of simulated time, so the driver lists the nodes (every 0.2 s) every step or
    two: a scale-up is placed at the next step boundary."""
    classes = [
        {"name": f"n{i}", "count": 1, "a_ms": 100.0, "c_ms_per_sample": 1.0 * (i + 1), "cpus": 2.0}
        for i in range(len(node_ids))
    ]
    events = [{"at_s": 0.0, "fail": len(node_ids)}] if hold else []
    # A worker is up as soon as it is spawned: a scale-up joins at the next step boundary.
    recovery = {"start_s": 0.0}
    cluster = SimulatedCluster(
        parse_cluster({"classes": classes, "events": events, "recovery": recovery})
    )
    for node, node_id in zip(cluster.nodes, node_ids, strict=True):
        node.node_id = node_id  # the simulated nodes are the ones nodes() lists
    return cluster


class _ServiceClock(SimClock):
    """The simulator's virtual clock, stamped with the wall's time: durations are simulated
    (the driver waits and trains in no real time), while the times a job's records carry
    (started, finished, log lines) are the service's own, so its retention and ages hold."""

    def time(self) -> float:
        return time.time()


class FakeCluster:
    """Implements ``ClusterClient`` over the simulator (see the module docstring).

    Knobs: ``embedded``; ``auto_advance`` (each ``snapshot()`` is one step of the job's
    driver); ``steps_per_epoch`` (a synchronous job trains that many steps of its global
    batch per epoch, timing only: no model, no losses or scores); ``real_gradients`` (it
    trains the spec's model on its dataset instead: real losses, scores and model files);
    ``hold`` (every node is down: jobs wait PENDING with their driver's reason);
    ``launch_error``; ``unavailable``. ``kill(job_id)`` makes a coordinator die.

    Coordinators are named by job and generation, as Ray names them: a name stays taken
    while its coordinator lives, or after ``kill(job_id, keep_name=True)`` (a process killed
    outside Ray, whose name Ray keeps reserved)."""

    def __init__(
        self,
        *,
        embedded: bool = False,
        auto_advance: bool = True,
        steps_per_epoch: int = 3,
        real_gradients: bool = False,
        hold: bool = False,
        nodes: tuple[str, ...] = NODE_IDS,
    ):
        self._embedded = embedded
        self.auto_advance = auto_advance
        self.steps_per_epoch = steps_per_epoch
        self.real_gradients = real_gradients
        self.hold = hold
        self.node_ids = nodes
        self.coordinators: dict[str, JobControl] = {}
        self.launch_error: Exception | None = None
        self.scheduler: object | None = None  # a fake Scheduling (service.scheduling)
        self.unavailable = False
        self.connected = False
        self.released: list[str] = []
        self.found: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self.launches: dict[str, list[JobSpec]] = {}
        self.generations: dict[str, int] = {}  # each live coordinator's generation
        self.reserved: set[tuple[str, int]] = set()  # names of coordinators killed outside Ray
        # A driver steps in the thread that asked (a sync loop, a test): one at a time.
        self._stepping = threading.RLock()
        self._started: list[PSCoordinator] = []  # parameter-server drivers started

    # ClusterClient ----------------------------------------------------------------------
    @property
    def embedded(self) -> bool:
        return self._embedded

    @property
    def address(self) -> str:
        return "local" if self._embedded else "127.0.0.1:6379"

    def connect(self) -> None:
        self.connected = True

    def close(self) -> None:
        self.connected = False

    def ping(self) -> bool:
        return self.connected and not self.unavailable

    def _check(self, op: str, job_id: str = "") -> None:
        self.calls.append((op, job_id))
        if self.unavailable:
            raise ClusterUnavailable("fake Ray is down")

    def _coordinator(self, job_id: str) -> JobControl:
        c = self.coordinators.get(job_id)
        if c is None:
            raise CoordinatorGone(f"The actor died: dynabatch-job-{job_id}")
        return c

    def launch(self, job_id: str, spec: JobSpec, generation: int = 0) -> None:
        self._check("launch", job_id)
        if self.launch_error is not None:
            raise self.launch_error
        if job_id in self.coordinators or (job_id, generation) in self.reserved:
            raise RayCallError(
                f"actor name dynabatch-job-{job_id} (generation {generation}) is already taken"
            )
        self.generations[job_id] = generation
        self.launches.setdefault(job_id, []).append(spec)
        # As launch_coordinator: resume=True, so a job with a checkpoint goes on from it.
        if spec.protocol.name == "ps":
            self.coordinators[job_id] = self._ps_coordinator(job_id, spec)
        else:
            self.coordinators[job_id] = self._sync_coordinator(job_id, spec)

    def _sync_coordinator(self, job_id: str, spec: JobSpec) -> Coordinator:
        clock = _ServiceClock()
        gradients = None
        if self.real_gradients:
            from dynabatch.scheduler.sim.gradients import GradientEngine

            gradients = GradientEngine(spec, 0.0)
            data = DataInfo(
                gradients.name,
                gradients.n_train,
                gradients.n_test,
                gradients.input_shape,
                gradients.num_classes,
            )
        else:
            data = DataInfo(
                f"{spec.dataset.name} (timing only)", self.steps_per_epoch * spec.global_batch, 0
            )
        runtime = SimRuntime(
            spec,
            _sim_cluster(self.node_ids, self.hold),
            clock=clock,
            data=data,
            gradients=gradients,
        )
        return Coordinator(job_id, spec, resume=True, runtime=runtime, clock=clock)

    def _ps_coordinator(self, job_id: str, spec: JobSpec) -> PSCoordinator:
        """The parameter-server driver over the simulator's (real gradients, in process):
        its core is the server's, which the simulated runtime holds, as ``simulate`` builds
        it."""
        clock = _ServiceClock()
        nodes = _sim_cluster(self.node_ids, False).nodes
        events = [(0.0, Fail(len(nodes)))] if self.hold else []
        data = load_dataset(spec.dataset, seed=spec.seed)
        runtime = SimPSRuntime(
            spec, data, nodes, lambda i, n: (n.a_s, n.c_s), events=events, clock=clock
        )
        core = build_core(spec, len(data.y_train))
        return PSCoordinator(job_id, spec, resume=True, runtime=runtime, core=core, clock=clock)

    def find(self, job_id: str, generation: int = 0) -> bool:
        self._check("find", job_id)
        if job_id in self.coordinators and self.generations.get(job_id) == generation:
            self.found.append(job_id)
            return True
        return False

    def snapshot(self, job_id: str) -> JobSnapshot:
        self._check("snapshot", job_id)
        c = self._coordinator(job_id)
        if self.auto_advance:
            self._step(c)
        return c.snapshot()

    def history(self, job_id: str, since: int = 0) -> list[EpochRecord]:
        self._check("history", job_id)
        return self._coordinator(job_id).history(since)

    def logs(self, job_id: str, since: int = 0) -> list[LogLine]:
        self._check("logs", job_id)
        return self._coordinator(job_id).logs(since)

    def cancel(self, job_id: str, reason: str) -> JobSnapshot:
        self._check("cancel", job_id)
        return self._coordinator(job_id).cancel(reason)

    def scale(self, job_id: str, workers: int) -> JobSnapshot:
        self._check("scale", job_id)
        return self._membership(self._coordinator(job_id).scale, workers)

    def drain(self, job_id: str, worker: str) -> JobSnapshot:
        self._check("drain", job_id)
        return self._membership(self._coordinator(job_id).drain, worker)

    @staticmethod
    def _membership(call: Callable[[Any], JobSnapshot], arg: Any) -> JobSnapshot:
        """As RayClusterClient translates the driver's errors: KeyError (no such worker) and
        ValueError (the last worker, a bad size) are the caller's mistakes."""
        try:
            return call(arg)
        except KeyError as err:
            raise WorkerNotFound(str(err.args[0])) from None
        except InvalidTransition:
            raise
        except ValueError as err:
            raise JobConflict(str(err)) from None

    def model_files(self, job_id: str) -> dict[str, bytes] | None:
        self._check("model_files", job_id)
        return self._coordinator(job_id).model_files()

    def release(self, job_id: str) -> None:
        self._check("release", job_id)
        self.released.append(job_id)
        self.coordinators.pop(job_id, None)

    def nodes(self) -> list[ClusterNode]:
        self._check("nodes")
        return [
            ClusterNode(
                node_id=n,
                address=f"10.0.0.{i + 1}",
                hostname=f"node{i}",
                head=i == 0,
                resources={"CPU": 2.0, "memory": 2.0**31},
                available={"CPU": 1.0},
            )
            for i, n in enumerate(self.node_ids)
        ]

    def scheduling(self, settings: object) -> object | None:
        """``self.scheduler`` (None unless a test sets one): with none, each job starts at
        once, as with the cluster scheduler off."""
        return self.scheduler

    # Test controls ----------------------------------------------------------------------
    def kill(self, job_id: str, *, keep_name: bool = False) -> None:
        """The coordinator actor dies (node lost, OOM...), its workers with it. ``keep_name``:
        its process was killed outside Ray, and its name stays taken."""
        if self.coordinators.pop(job_id, None) is not None and keep_name:
            self.reserved.add((job_id, self.generations.get(job_id, 0)))

    def advance(self, job_id: str, steps: int = 1) -> None:
        """``steps`` step boundaries of the job's driver."""
        c = self.coordinators[job_id]
        for _ in range(steps):
            self._step(c)

    def _step(self, c: JobControl) -> None:
        with self._stepping:
            if c.state.is_terminal:
                return
            if isinstance(c, PSCoordinator) and c not in self._started:
                self._started.append(c)
                c.start()  # its run() starts the server and learners, then steps
                return
            c.step()


# ======================================================================================
# The simulator's runtime, set up as FakeRuntime's cluster: drives the real Coordinator.


def sim_runtime(
    spec: JobSpec,
    *,
    n_train: int,
    nodes: int = 3,
    speeds: dict[int, float] | None = None,
    overhead_s: float = 0.001,
    gradients: Any = None,
    clock: SimClock | None = None,
    runtime: type[SimRuntime] = SimRuntime,
    start_s: float = 0.0,
    events: list[dict] | None = None,
) -> SimRuntime:
    """A :class:`SimRuntime` over ``nodes`` nodes named ``node00``, ``node01``...: node ``i``
    takes ``overhead_s + b / speeds.get(i, 1000.0)`` seconds for a share of ``b`` samples
    (as FakeRuntime's worker of ordinal ``i``, which the driver places on node ``i``). No
    all-reduce, regroup or detection cost, no noise, and a worker or a spare is up ``start_s``
    after it was started, so a test's figures are the compute alone; the data is ``n_train``
    samples and 100 held out (``gradients``: the simulator's model replicas, :class:`Lineages`
    or the real gradient engine; None for timing only). Node ``i`` is the one node of class
    ``node{i:02d}``: a fault names it ``{"class": "node02", "index": 0}``. ``runtime``: the
    class to build, a test's subclass of :class:`SimRuntime` (a defective runtime, say).
    ``events``: the cluster file's ``events:`` (a node that fails or joins at a time or at
    an (epoch, step), as ``{"epoch": 1, "step": 6, "fail": {"class": "node01", "index": 0}}``;
    a node that joins is named ``node01-00001``, the second of its class)."""
    speeds = speeds or {}
    classes = [
        {
            "name": f"node{i:02d}",
            "count": 1,
            "a_ms": overhead_s * 1e3,
            "c_ms_per_sample": 1e3 / speeds.get(i, 1000.0),
        }
        for i in range(nodes)
    ]
    cluster = SimulatedCluster(
        parse_cluster(
            {
                "classes": classes,
                "allreduce": {"alpha_ms": 0.0, "beta_ms_per_mb": 0.0},
                "recovery": {"detect_s": 0.0, "regroup_s": 0.0, "start_s": start_s},
                "events": events or [],
            }
        )
    )
    for node, cls in zip(cluster.nodes, classes, strict=True):
        node.node_id = cls["name"]  # as FakeRuntime names its nodes
    return runtime(
        spec,
        cluster,
        clock=clock or SimClock(1.7e9),
        data=DataInfo("fake", n_train, 100),
        gradients=gradients,
    )


class Lineages:
    """The simulator's model replicas for tests (:class:`~dynabatch.scheduler.sim.replicas.
    Replicas`): each worker's "weights" are the list of the (epoch, step) updates it applied,
    in order, so a test reads off the final model whether every step was applied exactly
    once. A step's mean loss is ``loss_of(epoch, step)`` (default 1.0); an ISGD extra
    iteration multiplies it by ``isgd_decay``. A worker's evaluation accuracy is the share
    of 100 steps its lineage holds; ``scored`` keeps each shard scored (worker, lineage)."""

    model_bytes = 0

    def __init__(self, loss_of: Callable[[int, int], float] | None = None, isgd_decay: float = 0.5):
        self.loss_of = loss_of
        self.isgd_decay = isgd_decay
        self._lineages: dict[str, list[tuple[int, int]]] = {}
        self.scored: list[tuple[str, tuple[tuple[int, int], ...]]] = []

    def lineage(self, worker: str) -> list[tuple[int, int]]:
        """The steps ``worker`` applied (a killed worker's too, as it left them)."""
        return list(self._lineages.get(worker, ()))

    def step(self, seed, epoch, dataset_size, shares, rule=None, caps=None, *, workers=()):
        step = shares[0].step
        for w in workers:
            self._lineages.setdefault(w, []).append((epoch, step))
        loss = self.loss_of(epoch, step) if self.loss_of else 1.0
        flagged, extra, psi = rule is not None and rule.flagged(loss), 0, loss
        while flagged and rule.more(psi, extra):
            # As dynabatch.actors.optim.isgd_extras: one update, then a pass gives the loss.
            extra += 1
            psi = loss * self.isgd_decay**extra
        return StepOutcome([loss * sp.own_size for sp in shares], loss, flagged, extra)

    def state(self, worker: str) -> dict:
        return {"lineage": [list(x) for x in self.lineage(worker)]}

    def load_state(self, state: dict | None, members) -> None:
        src = (
            [tuple(x) for x in state["lineage"]] if state is not None else self.lineage(members[0])
        )
        for w in members:
            self._lineages[w] = list(src)

    def eval_sums(self, worker: str, lo: int, hi: int) -> dict[str, float]:
        lineage = self.lineage(worker)
        self.scored.append((worker, tuple(lineage)))
        n = float(hi - lo)
        return {"n": n, "loss": n, "accuracy": min(1.0, len(lineage) / 100) * n}

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["n"], 1.0)
        return {"loss": sums["loss"] / n, "accuracy": sums["accuracy"] / n}


def edit_steps(
    outcomes: list[WorkerOutcome], edit: Callable[[StepTelemetry], StepTelemetry]
) -> list[WorkerOutcome]:
    """``outcomes`` with each reported step replaced by ``edit(step)`` (a test runtime's
    change to what the workers report)."""
    return [
        o
        if o.result is None
        else WorkerOutcome(
            o.worker,
            o.result.model_copy(update={"steps": [edit(s) for s in o.result.steps]}),
            o.lost,
        )
        for o in outcomes
    ]


class TimedSimRuntime(SimRuntime):
    """The simulator's runtime whose workers also time what Ray's workers time and the
    simulator leaves out: each step's whole time by the worker's clock (``step_s``), and the
    seconds a shard of an evaluation takes (a sample scored ``EVAL_SPEEDUP`` times faster
    than trained, the shards side by side)."""

    def _train(self, plans: dict[str, SegmentPlan], grace_s: float) -> list[WorkerOutcome]:
        return edit_steps(
            super()._train(plans, grace_s),
            lambda s: s.model_copy(update={"step_s": s.compute_s + s.wait_s}),
        )

    def _evaluate(self, shards: dict[str, tuple[int, int]]) -> list[ShardResult]:
        took = {
            w: (hi - lo) * self.workers[w].node.c_s / EVAL_SPEEDUP
            for w, (lo, hi) in shards.items()
            if w in self.workers
        }
        out = [
            ShardResult(r.worker, r.sums, took.get(r.worker, 0.0), r.error, r.lost)
            for r in super()._evaluate(shards)
        ]
        self.clock.sleep(max(took.values(), default=0.0))
        return out


# ======================================================================================
# A fake runtime: drives the real Coordinator (its machines and its driver code) without
# Ray, with faults injected at any point of a segment, a regroup or a checkpoint.


class FakeClock:
    """Virtual time: advances only when told (segments take their modelled time)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def time(self) -> float:
        return 1.7e9 + self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


class FakeWorker:
    """A worker whose 'model' is the list of (epoch, step) it applied, in order: a test
    reads off the final model whether every step was applied exactly once."""

    def __init__(self, worker_id: str, ordinal: int, node: str, speed: float):
        self.worker_id = worker_id
        self.ordinal = ordinal
        self.node = node
        self.speed = speed  # samples per second
        self.lineage: list[tuple[int, int]] = []
        self.alive = True


@dataclass
class Fault:
    """``kind``: die | error | straggle | hang | lose_result (the segment completes, its
    result is lost, the worker dies one step into the next), at (epoch, step) for
    ``worker``; or
    die_in_regroup / die_in_checkpoint / die_in_eval at the ``nth`` such call; or
    eval_error: every evaluation of ``worker``'s shard raises ``error`` (a metric that
    passed the load-time check but fails on real batches; the worker stays up); or
    oom: from (epoch, step) on, ``worker`` runs out of memory on any micro-batch of more
    than ``batch`` samples (its share cut by the plan's ``micro_cap``)."""

    kind: str
    worker: str
    epoch: int = 0
    step: int = 0
    nth: int = 1
    seconds: float = 0.0
    batch: int = 0
    done: bool = False
    error: str = "metrics.0: 'mae' failed on this dataset and model (ValueError: bad shape)"


@dataclass
class _EvalCall:
    """An evaluation submitted to the fake workers; ``results`` once it ran."""

    shards: dict[str, tuple[int, int]]
    results: list[ShardResult] | None = None
    delivered: bool = False


# A fake worker scores test samples this many times faster than it trains them.
EVAL_SPEEDUP = 4.0


class FakeRuntime:
    def __init__(self, spec: JobSpec, *, n_train: int, nodes: int = 3,
                 speeds: dict[int, float] | None = None, overhead_s: float = 0.001,
                 clock: FakeClock | None = None, uneven_failure: bool = False,
                 loss_of=None, isgd_decay: float = 0.5):
        self.spec = spec
        # Mean loss of step (epoch, step) (default 1.0); an ISGD extra iteration multiplies
        # it by isgd_decay. Every plan run is recorded in `plans`.
        self.loss_of = loss_of
        self.isgd_decay = isgd_decay
        self._rule = None  # ISGD's rule of the step being applied
        self._charting = False
        self.plans: list[dict[str, SegmentPlan]] = []
        # Submitted, not yet run: segments (plans) and evaluations, in order. As actors
        # run their calls in order, collecting one runs every call submitted before it.
        self._pending: list[dict[str, SegmentPlan] | _EvalCall] = []
        self._ran_early: dict[int, list[WorkerOutcome]] = {}
        self.n_train = n_train
        self.node_ids = [f"node{i:02d}" for i in range(nodes)]
        self.speeds = speeds or {}
        self.overhead_s = overhead_s
        self.clock = clock or FakeClock()
        self.uneven_failure = uneven_failure  # survivors at a failure differ by one step
        self.workers: dict[str, FakeWorker] = {}
        self.starting: list[str] = []
        # Start-up and spares. A fresh worker is up start_s (virtual) after
        # its spawn, a spare too; an adopted spare is up as soon as the spare is. Faults
        # (worker = the node): spare_dies (found by lost_spares), spare_dies_silently (once
        # up: found when it is adopted). Which spawns adopted a spare, which started fresh,
        # and every spare started and stopped, are recorded.
        self.start_s = 0.0
        self._ready_at: dict[str, float] = {}
        self.spares: dict[str, float] = {}  # node -> virtual time its spare is up
        self.spares_started: list[str] = []
        self.spares_stopped: list[str] = []
        self.adopted: list[str] = []
        self.fresh: list[str] = []
        self.faults: list[Fault] = []
        self.calls: dict[str, int] = {"regroup": 0, "checkpoint": 0, "evaluate": 0,
                                      "segments": 0}
        self.killed: list[str] = []
        self.final_lineages: dict[str, list[tuple[int, int]]] = {}
        # Per evaluation run: each shard's worker and the lineage ("weights") it scored.
        self.evaluated: list[dict[str, tuple[tuple[int, int], ...]]] = []
        # As real workers: after a failed segment every member has left the group, so a
        # segment queued behind it cannot train until the next regroup.
        self._group_broken = False
        self.submitted = 0
        # Plan updates: asked for, applied; how many steps of a queued
        # segment the workers are taken to have started when one arrives.
        self.updates: list = []
        self.updates_applied: list = []
        self.update_started = 0
        # Called with the method's name at the start of every Runtime call (a test cancels
        # the job from it, say, as another thread would).
        self.on_call: Callable[[str], None] | None = None

    def _called(self, name: str) -> None:
        if self.on_call is not None:
            self.on_call(name)

    # --- test controls --------------------------------------------------------------
    def inject(self, kind: str, worker: str, **kw) -> Fault:
        f = Fault(kind, worker, **kw)
        self.faults.append(f)
        return f

    def remove_node(self, node: str) -> None:
        self.node_ids.remove(node)
        for w in self.workers.values():
            if w.node == node:
                w.alive = False

    def add_node(self, node: str) -> None:
        self.node_ids.append(node)

    # --- Runtime ---------------------------------------------------------------------
    def load_data(self) -> DataInfo:
        self._called("load_data")
        return DataInfo("fake", self.n_train, 100)

    def nodes(self) -> list[NodeInfo]:
        self._called("nodes")
        busy = {w.node for w in self.workers.values() if w.alive}
        return [NodeInfo(n, cpus=1.0, free=n not in busy) for n in self.node_ids]

    def spawn(self, s: Spawn) -> None:
        self._called("spawn")
        w = FakeWorker(s.worker_id, s.ordinal, s.node_id, self.speeds.get(s.ordinal, 1000.0))
        self.workers[s.worker_id] = w
        now = self.clock.now()
        if s.adopt and s.node_id in self.spares:
            self.adopted.append(s.worker_id)
            self._ready_at[s.worker_id] = max(now, self.spares.pop(s.node_id))
            if self._counted_fault("spare_dies_silently", s.node_id):
                w.alive = False
        else:
            self.fresh.append(s.worker_id)
            self._ready_at[s.worker_id] = now + self.start_s
        self.starting.append(s.worker_id)

    def poll_started(self, timeout_s: float) -> list[Started]:
        self._called("poll_started")
        now = self.clock.now()
        if self.starting and all(self._ready_at[w] > now for w in self.starting):
            self.clock.sleep(min(timeout_s, min(self._ready_at[w] for w in self.starting) - now))
        elif not self.starting:
            self.clock.sleep(timeout_s)
        ready = [w for w in self.starting if self._ready_at[w] <= self.clock.now()]
        self.starting = [w for w in self.starting if w not in ready]
        return [Started(w) if self.workers[w].alive else Started(w, "node lost")
                for w in ready]

    def kill(self, worker: str) -> None:
        w = self.workers.pop(worker, None)
        if w is not None:
            self.final_lineages[worker] = list(w.lineage)
            self.killed.append(worker)
        if worker in self.starting:
            self.starting.remove(worker)
        self._ready_at.pop(worker, None)

    def start_spare(self, node_id: str) -> None:
        self.spares[node_id] = self.clock.now() + self.start_s
        self.spares_started.append(node_id)

    def stop_spare(self, node_id: str) -> None:
        if self.spares.pop(node_id, None) is not None:
            self.spares_stopped.append(node_id)

    def lost_spares(self) -> list[tuple[str, str]]:
        lost = [(n, "node lost") if n not in self.node_ids else (n, "spare process died")
                for n in list(self.spares)
                if n not in self.node_ids or self._counted_fault("spare_dies", n)]
        for n, _ in lost:
            del self.spares[n]
        return lost

    def _fault(self, kind: str, worker: str, epoch: int, step: int) -> Fault | None:
        for f in self.faults:
            if (f.kind == kind and f.worker == worker and not f.done
                    and (epoch, step) >= (f.epoch, f.step)):
                if kind not in ("error", "oom"):  # these repeat on every step
                    f.done = True
                return f
        return None

    def _counted_fault(self, kind: str, worker: str) -> bool:
        for f in self.faults:
            if f.kind == kind and f.worker == worker and not f.done:
                f.nth -= 1
                if f.nth <= 0:
                    f.done = True
                    return True
        return False

    def _run_segment(self, plans: dict[str, SegmentPlan], grace_s: float
                     ) -> list[WorkerOutcome]:
        self._called("run_segment")
        self.calls["segments"] += 1
        self.plans.append(plans)
        names = list(plans)
        k = len(next(iter(plans.values())).steps)
        steps: dict[str, list[StepTelemetry]] = {w: [] for w in names}
        gone: dict[str, str] = {}
        errors: dict[str, tuple[str, str, float]] = {}
        oom_batch: dict[str, int] = {}
        isgd = plans[names[0]].isgd  # ISGD's chart: the workers keep it step by step
        for j in range(k):
            sps = {w: plans[w].steps[j] for w in names}
            epoch = plans[names[0]].epoch
            step = sps[names[0]].step
            self._rule = isgd.rule() if isgd is not None else None
            self._charting = isgd is not None
            compute = {w: self.overhead_s + sps[w].own_size / self.workers[w].speed
                       for w in names if w in self.workers}
            for w in names:
                if w not in self.workers or not self.workers[w].alive:
                    gone[w] = "died: worker process died or node lost"
                elif self._fault("die", w, epoch, step):
                    self.workers[w].alive = False
                    gone[w] = "died: worker process died or node lost"
                elif self._fault("hang", w, epoch, step):
                    gone[w] = "hung: no answer after its peers failed"
                elif self._fault("error", w, epoch, step):
                    errors[w] = ("compute", f"InjectedFault: at epoch {epoch} step {step}",
                                 compute[w])
                elif f := self._fault("straggle", w, epoch, step):
                    errors[w] = ("peer", "DistBackendError: timed out", f.seconds)
                elif ((f := self._fault("oom", w, epoch, step)) and (m := largest_micro(
                        sps[w].own_size, plans[w].micro_cap)) > f.batch):
                    errors[w] = ("oom", f"OutOfMemoryError: CUDA out of memory ({m} samples)",
                                 compute[w])
                    oom_batch[w] = m
            if gone or errors:
                self._group_broken = True
                longest = max(compute.values(), default=0.0)
                self.clock.sleep(longest + self.spec.collective_timeout_s)
                survivors = [w for w in names if w not in gone]
                if self.uneven_failure and survivors and not errors:
                    # The first survivor's all-reduce finished before the peer broke off.
                    lucky = survivors[0]
                    steps[lucky].append(self._apply(lucky, epoch, sps, compute, names, 0.0,
                                                    plans[lucky].micro_cap))
                    survivors = survivors[1:]
                out = []
                for w in names:
                    if w in gone:
                        out.append(WorkerOutcome(w, lost=gone[w]))
                        continue
                    kind, msg, took = errors.get(
                        w, ("peer", "DistBackendError: connection closed by peer", compute[w]))
                    out.append(WorkerOutcome(w, result=SegmentResult(
                        worker=w, steps=steps[w], error=msg, error_kind=kind,
                        failed_compute_s=took, oom_batch=oom_batch.get(w))))
                return out
            t = max(compute.values())
            self.clock.sleep(t)
            for w in names:
                steps[w].append(self._apply(w, epoch, sps, compute, names, t - compute[w],
                                            plans[w].micro_cap))
            if isgd is not None:
                isgd = isgd.after(steps[names[0]][-1].isgd_loss)
        out = []
        last = plans[names[0]].steps[-1].step if k else 0
        for w in names:
            if k and self._fault("lose_result", w, plans[names[0]].epoch, last):
                # Every collective of the segment completed, but the worker's result is
                # lost with its node, which dies one step into the next segment: a segment
                # already sent ahead runs now, with it, as on the real workers.
                self.faults.append(Fault("die", w, plans[names[0]].epoch, last + 2))
                while self._pending:
                    self._execute(self._pending.pop(0), grace_s)
                out.append(WorkerOutcome(w, lost="died: worker process died or node lost"))
            else:
                out.append(WorkerOutcome(w, result=SegmentResult(worker=w, steps=steps[w])))
        return out

    # --- segments sent ahead ---------------------------------------------------------
    def submit_segment(self, plans: dict[str, SegmentPlan]) -> dict[str, SegmentPlan]:
        self._called("submit_segment")
        self.submitted += 1
        self._pending.append(plans)
        return plans  # runs when collected, after every segment submitted before it

    def collect_segment(self, plans: dict[str, SegmentPlan], grace_s: float
                        ) -> list[WorkerOutcome]:
        self._run_before(plans, grace_s)
        self._pending = [p for p in self._pending if p is not plans]
        if id(plans) in self._ran_early:
            return self._ran_early.pop(id(plans))
        return self._run_queued(plans, grace_s)

    def update_segment(self, update, timeout_s: float) -> bool:
        """A queued segment holding ``update.at_step`` has not started
        (segments run when collected), so the update applies to it, unless the workers are
        taken to have started ``update_started`` of its steps already (a test control) or
        it ran early. Every update asked for is recorded in ``updates``."""
        from dynabatch.scheduler.core.sync.update import updated_plans

        self.updates.append(update)
        for item in self._pending:
            if isinstance(item, _EvalCall) or id(item) in self._ran_early:
                continue
            seg = next(iter(item.values()))
            if not seg.updates:  # as a real worker: it claims no step, so sees no update
                continue
            if seg.epoch != update.epoch or not any(
                    sp.step == update.at_step for sp in seg.steps):
                continue
            if update.at_step < seg.steps[0].step + self.update_started:
                return False
            item.update(updated_plans(item, update))
            self.updates_applied.append(update)
            return True
        return False

    def _run_before(self, item, grace_s: float = 0.0) -> None:
        """Run every call submitted before ``item``, in order."""
        while self._pending and self._pending[0] is not item:
            self._execute(self._pending.pop(0), grace_s)

    def _execute(self, item, grace_s: float) -> None:
        if isinstance(item, _EvalCall):
            if item.results is None:
                self._evaluate(item)
        elif id(item) not in self._ran_early:
            self._ran_early[id(item)] = self._run_queued(item, grace_s)

    def _run_queued(self, plans: dict[str, SegmentPlan], grace_s: float) -> list[WorkerOutcome]:
        if not self._group_broken:
            return self._run_segment(plans, grace_s)
        self.calls["segments"] += 1
        return [WorkerOutcome(w, lost="died: worker process died or node lost")
                if w not in self.workers or not self.workers[w].alive
                else WorkerOutcome(w, result=SegmentResult(
                    worker=w, steps=[], error="not in a group", error_kind="peer",
                    failed_compute_s=0.0))
                for w in plans]

    def _apply(self, w, epoch, sps, compute, names, wait, cap=None) -> StepTelemetry:
        """Worker ``w`` completes a step whose all-reduce summed every member's share."""
        sp = sps[w]
        counts = np.zeros(sp.size, dtype=np.int64)
        for other in names:
            o = sps[other]
            counts[o.own_start - o.start:o.own_start - o.start + o.own_size] += 1
        self.workers[w].lineage.append((epoch, sp.step))
        loss = self.loss_of(epoch, sp.step) if self.loss_of else 1.0
        rule = self._rule
        flagged, extra = rule is not None and rule.flagged(loss), 0
        psi = loss
        while flagged and rule.more(psi, extra):
            # As dynabatch.actors.optim.isgd_extras: one update, then a pass gives the loss to
            # check.
            extra += 1
            psi = loss * self.isgd_decay ** extra
        return StepTelemetry(
            worker=w, epoch=epoch, step=sp.step, batch=sp.own_size, samples=sp.own_size,
            compute_s=compute[w], wait_s=wait, loss_sum=loss * sp.own_size,
            start=sp.own_start, step_start=sp.start, step_size=sp.size,
            coverage=encode_counts(counts), flagged=flagged, extra_iters=extra,
            isgd_loss=loss if self._charting else None,
            micro_cap=cap, micro_batches=max(1, len(micro_ranges(sp.own_size, cap))),
        )

    def regroup(self, generation, members, state, timeout_s) -> RegroupResult:
        self._called("regroup")
        self.calls["regroup"] += 1
        lost = {w: "lost while joining the group: died" for w in members
                if w not in self.workers or not self.workers[w].alive
                or self._counted_fault("die_in_regroup", w)}
        for w in lost:
            if w in self.workers:
                self.workers[w].alive = False
        if lost:
            # As with gloo: the live members' rendezvous fails with the dead one.
            return RegroupResult(lost, "; ".join(f"{w}: rendezvous timed out"
                                                 for w in members if w not in lost) or None)
        self._group_broken = False
        src = self.workers[members[0]]
        if state is not None:
            src.lineage = [tuple(x) for x in state["lineage"]]
        for w in members[1:]:
            self.workers[w].lineage = list(src.lineage)
        return RegroupResult({})

    # --- evaluation: each worker's shard, queued like a segment ------------------------
    def submit_evaluation(self, shards: dict[str, tuple[int, int]]) -> _EvalCall:
        self._called("submit_evaluation")
        call = _EvalCall(dict(shards))
        self._pending.append(call)
        return call

    def poll_evaluation(self, call: _EvalCall, timeout_s: float) -> list[ShardResult]:
        """What ran already; waiting (``timeout_s`` > 0) runs it, and what is before it."""
        self._called("poll_evaluation")
        if call.results is None:
            if timeout_s <= 0:
                return []
            self._run_before(call)
            self._pending = [p for p in self._pending if p is not call]
            self._evaluate(call)
        if call.delivered:
            return []
        call.delivered = True
        return list(call.results)

    def _evaluate(self, call: _EvalCall) -> None:
        """Each worker scores its shard of the weights it holds now; its "accuracy" is the
        share of 100 steps its lineage holds. The shards run side by side."""
        self.calls["evaluate"] += 1
        out, scored, longest = [], {}, 0.0
        for w, (lo, hi) in call.shards.items():
            fw = self.workers.get(w)
            if fw is None or not fw.alive or self._counted_fault("die_in_eval", w):
                if fw is not None:
                    fw.alive = False
                out.append(ShardResult(w, error="worker process died or node lost", lost=True))
                continue
            n = hi - lo
            seconds = n / (fw.speed * EVAL_SPEEDUP)
            if bad := next((f for f in self.faults if f.kind == "eval_error"
                            and f.worker == w), None):
                longest = max(longest, seconds)  # it raised once its shard was scored
                out.append(ShardResult(w, error=bad.error, seconds=seconds))
                continue
            longest = max(longest, seconds)
            acc = min(1.0, len(fw.lineage) / 100)
            out.append(ShardResult(w, {"n": float(n), "loss": float(n), "accuracy": acc * n},
                                   seconds))
            scored[w] = tuple(fw.lineage)
        self.clock.sleep(longest)
        self.evaluated.append(scored)
        call.results = out

    def finish_evaluation(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["n"], 1.0)
        return {"loss": sums["loss"] / n, "accuracy": sums["accuracy"] / n}

    def fetch_state(self, worker: str, timeout_s: float) -> dict:
        self._called("fetch_state")
        self.calls["checkpoint"] += 1
        self._check_call("die_in_checkpoint", worker)
        return {"lineage": [list(x) for x in self.workers[worker].lineage]}

    def _check_call(self, kind: str, worker: str) -> None:
        w = self.workers.get(worker)
        if w is None or not w.alive or self._counted_fault(kind, worker):
            if w is not None:
                w.alive = False
            raise WorkerCallError(worker, "worker process died or node lost", lost=True)

    def lineage(self, worker: str) -> list[tuple[int, int]]:
        w = self.workers.get(worker)
        return list(w.lineage) if w else self.final_lineages[worker]

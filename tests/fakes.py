"""Test doubles without Ray: :class:`FakeCluster`, the service's cluster, and the builders
that put the real coordinator on the simulator's runtime for the coordinator's own tests
(:func:`sim_runtime`, :func:`sim_job`, the model replicas :class:`Lineages`). There is no
fake runtime: faults come from the simulator's fault script, nodes fail and join as the
simulated cluster's events, so what a test sees is what ``dynabatch simulate`` does.

:class:`FakeCluster` is an in-memory :class:`dynabatch.service.ray_client.RayClusterClient`
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
from typing import Any

from dynabatch.actors.contracts import StepTelemetry
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.scheduler.control import JobControl
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.core.lifecycle import InvalidTransition
from dynabatch.scheduler.ps.driver import PSCoordinator, build_core
from dynabatch.scheduler.runtime.seam import (
    DataInfo,
    ShardResult,
)
from dynabatch.scheduler.sim.cluster_spec import parse_cluster
from dynabatch.scheduler.sim.cost_model import SimulatedCluster
from dynabatch.scheduler.sim.ps_runtime import SimPSRuntime
from dynabatch.scheduler.sim.replicas import StepOutcome
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sim.timeline import SimClock
from dynabatch.scheduler.sync.coordinator import Coordinator
from dynabatch.scheduler.telemetry import (
    EpochRecord,
    JobSnapshot,
    LogLine,
)
from dynabatch.service.cluster_client import NodeStatus
from dynabatch.service.service_errors import (
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
    """The service's cluster client, as ``RayClusterClient``, over the simulator (see the
    module docstring).

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
        self.scheduler: object | None = None  # a fake RayScheduling (service.scheduling)
        self.unavailable = False
        self.connected = False
        self.released: list[str] = []
        self.found: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self.launches: dict[str, list[JobSpec]] = {}
        self.generations: dict[str, int] = {}  # each live coordinator's generation
        self.followed: dict[str, int] = {}  # the generation the client's calls go to
        self.reserved: set[tuple[str, int]] = set()  # names of coordinators killed outside Ray
        # A driver steps in the thread that asked (a sync loop, a test): one at a time.
        self._stepping = threading.RLock()
        self._started: list[PSCoordinator] = []  # parameter-server drivers started

    # the cluster client -----------------------------------------------------------------
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

    def reachable(self) -> bool:
        return True

    def _check(self, op: str, job_id: str = "") -> None:
        self.calls.append((op, job_id))
        if self.unavailable:
            raise ClusterUnavailable("fake Ray is down")

    def _coordinator(self, job_id: str) -> JobControl:
        c = self.coordinators.get(job_id)
        if c is None:
            raise CoordinatorGone(f"The actor died: dynabatch-job-{job_id}")
        if self.generations.get(job_id) != self.followed.get(job_id, 0):
            # As Ray's client: its calls go to the generation it launched or found last.
            raise CoordinatorGone(f"no coordinator actor for job {job_id}")
        return c

    def launch(self, job_id: str, spec: JobSpec, generation: int = 0, *,
               client: bool = True) -> None:
        """``client``: the service's own launch, which its later calls follow; False: the
        cluster scheduler's (in its actor: the service finds it by name)."""
        self._check("launch", job_id)
        if self.launch_error is not None:
            raise self.launch_error
        if job_id in self.coordinators or (job_id, generation) in self.reserved:
            raise RayCallError(
                f"actor name dynabatch-job-{job_id} (generation {generation}) is already taken"
            )
        self.generations[job_id] = generation
        if client:
            self.followed[job_id] = generation
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
                n_validation=gradients.n_validation,
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
        data = load_dataset(spec.dataset, seed=spec.seed)
        runtime = SimPSRuntime(spec, data, _sim_cluster(self.node_ids, self.hold), clock=clock)
        core = build_core(spec, len(data.y_train))
        return PSCoordinator(job_id, spec, resume=True, runtime=runtime, core=core, clock=clock)

    def find(self, job_id: str, generation: int = 0) -> bool:
        self._check("find", job_id)
        self.followed[job_id] = generation
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

    def nodes(self) -> list[NodeStatus]:
        self._check("nodes")
        return [
            NodeStatus(
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
# The simulator's runtime over a small test cluster: drives the real Coordinator.


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
    eval_ms_per_sample: float = 0.0,
) -> SimRuntime:
    """A :class:`SimRuntime` over ``nodes`` nodes named ``node00``, ``node01``...: node ``i``
    takes ``overhead_s + b / speeds.get(i, 1000.0)`` seconds for a share of ``b`` samples
    (the worker of ordinal ``i``, which the driver places on node ``i``). No
    all-reduce, regroup or detection cost, no noise, and a worker or a spare is up ``start_s``
    after it was started, so a test's figures are the compute alone; the data is ``n_train``
    samples and 100 held out (``gradients``: the simulator's model replicas, :class:`Lineages`
    or the real gradient engine; None for timing only). Node ``i`` is the one node of class
    ``node{i:02d}``: a fault names it ``{"class": "node02", "index": 0}``. ``runtime``: the
    class to build, a test's subclass of :class:`SimRuntime` (a defective runtime, say).
    ``events``: the cluster file's ``events:`` (a node that fails or joins at a time or at
    an (epoch, step), as ``{"epoch": 1, "step": 6, "fail": {"class": "node01", "index": 0}}``;
    a node that joins is named ``node01-00001``, the second of its class).
    ``eval_ms_per_sample``: what scoring a held-out sample costs every node (0: free)."""
    speeds = speeds or {}
    classes = [
        {
            "name": f"node{i:02d}",
            "count": 1,
            "a_ms": overhead_s * 1e3,
            "c_ms_per_sample": 1e3 / speeds.get(i, 1000.0),
            "eval_ms_per_sample": eval_ms_per_sample,
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
        node.node_id = cls["name"]  # short names that tests and fault scripts read
    rt = runtime(
        spec, cluster, clock=clock or SimClock(1.7e9), data=DataInfo("fake", n_train, 100),
        gradients=gradients,
    )
    rt.record.keep_plans = True  # the tests read the plans each segment trained
    return rt


def sim_job(
    spec: JobSpec, *faults: Any, n_train: int = 1000, **cluster: Any
) -> tuple[Coordinator, Any, Lineages]:
    """The real :class:`Coordinator` on :func:`sim_runtime`'s cluster (``n_train`` samples;
    ``cluster``: its ``nodes``, ``speeds``, ``events``, ``start_s``, ``runtime``...), with
    the fault script ``faults`` (:class:`~dynabatch.scheduler.sim.cluster_spec.Fault`) armed
    and :class:`Lineages` as the workers' model replicas: returns (coordinator, runtime,
    lineages). A test changes the cluster between two steps of the driver with the
    runtime's ``happen`` (a node fails or joins now)."""
    lineages = Lineages()
    rt = sim_runtime(spec, n_train=n_train, gradients=lineages, **cluster)
    for f in faults:
        rt.inject(f)
    return Coordinator("job", spec, runtime=rt, clock=rt.clock), rt, lineages


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

    def eval_sums(self, worker: str, lo: int, hi: int, split: str = "test") -> dict[str, float]:
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


# A worker scores held-out samples this many times faster than it trains them.
EVAL_SPEEDUP = 4.0


class TimedSimRuntime(SimRuntime):
    """The simulator's runtime whose workers also time their evaluation shards, which the
    simulator scores for free: a shard takes its samples' training time divided by
    ``EVAL_SPEEDUP``, the shards side by side. (Each step's ``step_s`` is the simulator's
    own.)"""

    def _evaluate(self, shards: dict[str, tuple[int, int]], split: str = "test"
                  ) -> list[ShardResult]:
        took = {
            w: (hi - lo) * self.workers[w].node.c_s / EVAL_SPEEDUP
            for w, (lo, hi) in shards.items()
            if w in self.workers
        }
        out = [
            ShardResult(r.worker, r.sums, took.get(r.worker, 0.0), r.error, r.lost)
            for r in super()._evaluate(shards, split)
        ]
        self.clock.sleep(max(took.values(), default=0.0))
        return out


def reduced_steps(reducer: Any) -> list[Any]:
    """Each :class:`~dynabatch.actors.reducer.Reduced` that ``reducer`` finishes from now on,
    in order (a worker's step returns only its telemetry)."""
    seen: list[Any] = []
    finish = reducer.finish

    def finishing(*args: Any, **kwargs: Any) -> Any:
        seen.append(finish(*args, **kwargs))
        return seen[-1]

    reducer.finish = finishing
    return seen


def evaluate(obj: Any, model: Any, x: Any, y: Any, device: Any, batch: int = 1024) -> dict:
    """``{"loss": ..., <metric>: ...}`` of ``model`` over all of ``(x, y)``: an
    :class:`~dynabatch.actors.workloads.objective.Objective`'s sums over one shard, finished
    (what a job's evaluation does over every worker's shard)."""
    return obj.finish(obj.eval_sums(model, x, y, 0, len(y), device, batch))

"""The driver of a parameter-server job (``protocol: {name: ps}``), on Ray and in the
simulator alike.

:class:`PSCoordinator` has the coordinator's public interface, so the service launches and
polls it like the synchronous one. It is the executor of the pure
:class:`~dynabatch.scheduler.core.ps.engine.PSEngine`: it turns what its
:class:`~dynabatch.scheduler.runtime.ps_seam.PSRuntime` reports (Ray's, or the simulator's
:class:`~dynabatch.scheduler.sim.ps_runtime.SimPSRuntime`) and the queued requests into the
engine's events, carries out the commands it returns, and publishes the job's state. The
training's brain, :class:`~dynabatch.scheduler.core.ps.machine.PSCore`, lives in the server.
At the job's end (and at a cancel, once an epoch was trained) the server's final weights go
out as the trained model through :meth:`~dynabatch.scheduler.control.JobControl.publish_model`.
"""

from __future__ import annotations

import logging
from typing import Any

from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.control import Assign, Drain, JobControl, Request, Scale
from dynabatch.scheduler.core.membership import NodeAssignment
from dynabatch.scheduler.core.ps.batch_policy import JiConfig, PerfAwareBatches
from dynabatch.scheduler.core.ps.engine import (
    Ended,
    EngineState,
    PSEngine,
    Starting,
    job_state,
    learners,
)
from dynabatch.scheduler.core.ps.machine import PSCore
from dynabatch.scheduler.core.ps.messages import (
    AssignRequested,
    Command,
    DataLoaded,
    DrainRequested,
    DriverFailed,
    EpochSeen,
    Event,
    ExportModel,
    Kill,
    Leave,
    ListNodes,
    Log,
    NodeAdded,
    NodesListed,
    Note,
    Polled,
    RecordEpoch,
    ScaleRequested,
    Sleep,
    SpawnLearner,
    StartServer,
)
from dynabatch.scheduler.core.ps.rudra import PSConfig
from dynabatch.scheduler.runtime.ps_seam import NodeJoined, PSRuntime
from dynabatch.scheduler.runtime.seam import Clock, GroupReport, GroupReports
from dynabatch.scheduler.telemetry import (
    EpochRecord,
    JobSnapshot,
    PSStatus,
    PSWorkerStatus,
    WorkerEpochStats,
    WorkerStatus,
)

log = logging.getLogger("dynabatch.ps")

POLL_S = 0.25  # how long a step waits for the learners' exits


def first_batch(spec: JobSpec) -> int:
    """μ, a learner's batch until the server re-plans it (and a learner's it has not met
    yet): μλ is the global batch."""
    return max(1, spec.global_batch // (spec.initial_workers or 1))


def build_core(spec: JobSpec, dataset_size: int) -> PSCore:
    p = spec.protocol
    b0 = first_batch(spec)
    # b_min = b0/4: v_i = b_i/t_i under-rates a learner whose fixed per-push cost dominates
    # at a small batch, which shrinks its batch further; on Ray (digits MLP) b_min = 1 let
    # three of four learners collapse to 1 sample. The floor stops that feedback.
    ji = (
        JiConfig(
            b0=b0,
            b_min=max(1, b0 // 4),
            b_max=4 * b0,
            every_pushes=p.replan_pushes,
            scale_lr=p.scale_lr,
        )
        if p.batch == "perf_aware"
        else None
    )
    return PSCore(
        PSConfig(p.mode, p.n, p.lr_staleness, p.max_staleness, p.on_stale),
        dataset_size=dataset_size,
        epochs=spec.epochs,
        seed=spec.seed,
        batches=PerfAwareBatches(b0, ji),
    )


def dataset_problem(spec: JobSpec, ds: Any) -> str | None:
    """A loaded dataset the parameter server cannot train (one line naming the field): a
    user loader's targets are only known once it ran (built-ins are refused at submit)."""
    if ds.targets != "classes":
        return (
            f"dataset.name: protocol ps trains classification (class labels) only; "
            f"{spec.dataset.name!r} has {ds.targets} targets"
        )
    return None


def ps_status(spec: JobSpec, snap: dict[str, Any] | None) -> PSStatus:
    """The server's snapshot as the typed view REST, metrics and the CLI share. Pushes per
    second is the server's rolling rate (the last 10 s), not a lifetime average. Before its
    first snapshot, a server that has applied nothing: a parameter-server job's view always
    says it is one."""
    snap = snap or {"version": 0, "applied": 0, "refused": 0, "deferred": 0, "pushes": 0,
                    "workers": {}}
    return PSStatus(
        mode=spec.protocol.mode,
        version=snap["version"],
        applied=snap["applied"],
        refused=snap["refused"],
        deferred=snap["deferred"],
        pushes=snap["pushes"],
        pushes_per_s=snap.get("pushes_per_s", 0.0),
        workers=[PSWorkerStatus(worker=w, **v) for w, v in sorted(snap["workers"].items())],
    )


class PSCoordinator(JobControl):
    """``runtime``: where the server and learners run (default: Ray). ``core``: the job's core
    (default: :func:`build_core` from the spec; experiments pass their own)."""

    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        resume: bool = True,
        *,
        runtime: PSRuntime | None = None,
        core: PSCore | None = None,
        clock: Clock | None = None,
        reports: GroupReports | None = None,
    ):
        """``reports``: where the job tells the cluster scheduler its learners as they
        change under an assignment (Ray's scheduler actor with Ray's runtime)."""
        if runtime is None:
            from dynabatch.scheduler.runtime.ray_ps import RayPSRuntime
            from dynabatch.scheduler.runtime.ray_runtime import RayGroupReports

            runtime = RayPSRuntime(spec, self._follow_actor_output, clock)
            reports = reports or RayGroupReports()
        self.reports = reports
        super().__init__(job_id, spec, clock or runtime.clock)
        self.runtime = runtime
        self.core = core
        self.engine = PSEngine(spec.initial_workers, spec.worker_wait_timeout_s)
        # Where the job is, with its learners: the engine's state once a step's commands
        # are carried out (the job's public state is derived from it).
        self.engine_state: EngineState = Starting()
        self._snap: dict[str, Any] | None = None
        # (input shape, class count) of the model, once the data is loaded: its export.
        self.model_shape: tuple[tuple[int, ...], int] | None = None

    # ------------------------------------------------------------------ public interface
    @property
    def server_stats(self) -> dict[str, Any] | None:
        """The server's last raw snapshot (``started_s``, ``elapsed_s``, ``puts``, ...)."""
        with self.lock:
            return self._snap

    def run(self) -> JobSnapshot:
        try:
            if self.start():
                while self.step():
                    pass
        finally:
            self.shutdown()
        return self.snapshot()

    def start(self) -> bool:
        """Load the data, start the server and the first learners; False if the job ended."""
        return self._guarded(self._start)

    def step(self) -> bool:
        """One control-loop step (requests, learners' exits, epochs); False when terminal."""
        if self.state.is_terminal:
            return False
        return self._guarded(self._step)

    def _guarded(self, fn: Any) -> bool:
        from dynabatch.actors.workloads import WorkloadError

        try:
            return fn()
        except WorkloadError as err:  # the data or model cannot be used: its own message
            failed = DriverFailed(str(err))
        except Exception as err:  # the job fails with the reason; the actor stays up
            log.exception("ps job %s failed", self.job_id)
            failed = DriverFailed(f"internal error: {type(err).__name__}: {err}")
        self._feed(failed)
        return False

    def snapshot(self) -> JobSnapshot:
        with self.lock:
            snap = self._snap
            ps = ps_status(self.spec, snap)
            batch = {w.worker: w.batch for w in ps.workers}
            # The learners are the job's workers (one source of its members for every view);
            # one the server has not met yet gets the first batch when it does.
            mu = first_batch(self.spec)
            workers = [WorkerStatus(worker=w, node=n, rank=i, batch=batch.get(w, mu), partition=0)
                       for i, (w, n) in enumerate(sorted(learners(self.engine_state).items()))]
            return self._snapshot(
                epoch=snap["epoch"] if snap else 0, policy=f"ps-{self.spec.protocol.mode}",
                retried_samples_total=sum(r.retried_samples for r in self.records),
                workers=workers, ps=ps)

    def _member_ids(self) -> list[str]:
        with self.lock:
            return list(learners(self.engine_state))

    def _assignment_error(self, nodes: NodeAssignment) -> str | None:
        # Learners are independent (asynchronous or stale-synchronous updates to the
        # server): any number of at least one can train.
        return None

    def shutdown(self) -> None:
        self.runtime.shutdown()  # it stops every learner with the job

    # ------------------------------------------------------------------ the loop
    def _start(self) -> bool:
        self.started_at = self.clock.time()
        data = self.runtime.load_data()
        self._feed(DataLoaded(dataset_problem(self.spec, data), data))
        return not self.state.is_terminal

    def _step(self) -> bool:
        for r in self.take_requests():
            self._feed(self._requested(r))
        for x in self.runtime.wait(POLL_S):
            if self.state.is_terminal:  # a learner's own error failed the job
                continue
            if isinstance(x, NodeJoined):
                x = NodeAdded(x.node_id, self.assignment is not None, self.clock.now())
            self._feed(x)
        if self.state.is_terminal:
            return False
        snap = self.runtime.snapshot()
        with self.lock:
            self._snap = snap
        self._feed(self._polled(snap))
        return not self.state.is_terminal

    def _feed(self, event: Event | None) -> None:
        """Hand ``event`` to the engine, carry out its commands in order, then take its new
        state and publish the job's; a batch that asks the world (it ends with
        ``ListNodes``) is answered with the next event. A command that raises leaves the
        state as it was before the event (the caller feeds the failure)."""
        while event is not None:
            state, commands = self.engine.step(self.engine_state, event)
            event = None
            for command in commands:
                event = self._carry_out(command)
            with self.lock:  # other threads read the learners (drain: _member_ids)
                moved = learners(state) != learners(self.engine_state)
                self.engine_state = state
            if moved and self.reports is not None and self.assignment is not None:
                # As a synchronous job reports each group it forms: the scheduler's view
                # shows the learners at once, not at its next round's poll.
                self.reports.report(GroupReport.of(self.job_id, self.snapshot()))
            public = job_state(state)
            if public.is_terminal:
                self.finish(public, state.reason if isinstance(state, Ended) else None)
            elif public is not self.state:
                self.transition(public, None)

    def _carry_out(self, command: Command) -> Event | None:
        """One of the engine's commands, on the runtime and the job's records."""
        match command:
            case StartServer(learners, ds):
                self.model_shape = (tuple(ds.input_shape), int(ds.num_classes))
                if self.core is None:
                    self.core = build_core(self.spec, len(ds.y_train))
                self.runtime.start_server(self.core, learners)
            case ListNodes():
                nodes = tuple(n.node_id for n in self.runtime.nodes())
                return NodesListed(nodes, self.clock.now(), self.assignment)
            case Sleep(seconds):
                self.clock.sleep(seconds)
            case SpawnLearner(worker, ordinal, node):
                self.runtime.spawn(worker, ordinal, node)
            case Kill(worker):
                self.runtime.kill(worker)
            case Leave(worker):
                self.runtime.leave(worker)
            case Note(kind, worker, node, reason):
                self.record_event(kind, worker, node, reason)
            case Log(level, message):
                self.log(level, message)
            case RecordEpoch(epoch, wall_s):
                self._record_epoch(epoch.record, wall_s)
            case ExportModel(reason):
                self._export_model(reason)
            case _:
                raise TypeError(f"not a command of the parameter-server engine: {command!r}")
        return None

    def _export_model(self, reason: str) -> None:
        """The server's weights now as the job's trained model, at the epochs trained so
        far. A server that cannot be read is a WARNING in the job's log: the job ends as it
        was going to."""
        from dynabatch.actors.errors import first_line
        from dynabatch.actors.ps import model_state

        if self.model_shape is None:  # the data never loaded: nothing was trained
            return
        shape, classes = self.model_shape
        try:
            state = model_state(self.spec, shape, classes, self.runtime.final_weights())
        except Exception as err:  # a Ray error, a timeout: the training stands
            self.log("WARNING", f"model export ({reason}) skipped: the server's weights "
                     f"cannot be read ({first_line(err)})")
            return
        self.publish_model(input_shape=shape, num_classes=classes, state=state,
                           epoch=len(self.history()), reason=reason)

    # ------------------------------------------------------------------ events
    def _requested(self, r: Request) -> Event:
        match r:
            case Scale(workers):
                return ScaleRequested(workers)
            case Drain(worker):
                return DrainRequested(worker)
            case Assign(nodes):
                return AssignRequested(nodes, self.clock.now())
        raise TypeError(f"not a request: {r!r}")

    def _polled(self, snap: dict[str, Any]) -> Polled:
        """The server's snapshot as the engine's event (samples applied: pushes applied
        times the learner's batch now)."""
        epochs = tuple(
            EpochSeen(e["epoch"], e["t"], e["verified"], tuple(e["problems"]), e)
            for e in snap["epochs"]
        )
        workers = snap.get("workers", {})
        return Polled(
            now=self.clock.now(),
            started_s=snap.get("started_s"),
            epochs=epochs,
            finished=bool(snap["finished"]),
            applied=tuple((w, v.get("applied", 0) * v.get("batch", 0)) for w, v in workers.items()),
            cancel=self.cancel_reason,
        )

    # ------------------------------------------------------------------ records
    def _record_epoch(self, e: dict[str, Any], wall_s: float) -> None:
        snap = self._snap or {"workers": {}}
        workers = [
            WorkerEpochStats(
                worker=w,
                node="",
                batch=v["batch"],
                partition=e["samples_by_worker"].get(w, 0),
                steps=v["applied"],
                compute_s=0.0,
                wait_s=0.0,
                throughput=0.0,
            )
            for w, v in sorted(snap["workers"].items())
        ]
        rec = EpochRecord(
            epoch=e["epoch"],
            wall_s=wall_s,
            steps=e["version"],
            dataset_size=e["samples_applied"],
            samples_trained=e["samples_applied"],
            retried_samples=e["retried_samples"],
            verified=e["verified"],
            train_loss=e["train_loss"],
            test_loss=e["test_loss"],
            test_accuracy=e["test_accuracy"],
            utilization=0.0,
            compute_balance=0.0,
            policy=f"ps-{self.spec.protocol.mode}",
            emulated=self.spec.emulated,
            workers=workers,
        )
        with self.lock:
            self.records.append(rec)
        self.tracking.epoch(rec)
        self.log(
            "INFO",
            f"epoch {rec.epoch}: version {e['version']}, test loss "
            f"{e['test_loss']:.4f}, accuracy {e['test_accuracy']:.3f}, "
            f"verified={rec.verified}",
        )

"""The driver of a parameter-server job (``protocol: {name: ps}``), on Ray and in the
simulator alike.

:class:`PSCoordinator` has the coordinator's public interface (``run``, ``step``,
``snapshot``, ``history``, ``logs``, ``cancel``, ``scale``, ``drain``, ``shutdown``), so the
service launches and polls it like the synchronous one
(:mod:`dynabatch.scheduler.runtime.launch`). The job's brain is the pure
:class:`~dynabatch.scheduler.core.ps.machine.PSCore`, which lives in the server behind a
:class:`~dynabatch.scheduler.runtime.ps_seam.PSRuntime`: Ray's
(:class:`~dynabatch.scheduler.runtime.ray_ps.RayPSRuntime`, the default) or the simulator's
(:class:`~dynabatch.scheduler.sim.ps_runtime.SimPSRuntime`, which runs this same code on a
virtual clock). This driver only starts learners and turns what happens to them into core
events:

* a learner whose ``run`` fails because its node or process died *leaves*: its in-flight
  gradient is dropped and its samples are re-queued; nobody regroups. A learner whose own
  code raised (a deterministic error, e.g. a workload that cannot train) fails the job with
  that error as the reason;
* ``scale`` up spawns learners that join, pull and start; ``scale`` down and ``drain`` kill
  learners (a scale-down the slowest first, by samples applied per second) and they
  leave, their in-flight samples re-queued; a node the runtime adds for the job (the
  simulator's cluster joins) gets a learner;
* ``protocol.shards: k`` runs k−1 shards beside the server, which holds slice 0 and the one
  core (the protocol is decided in one place only);
* at the job's end (and at a cancel, once an epoch was trained) the server's final weights
  go out as the trained model (:mod:`dynabatch.scheduler.ps.model`), by the synchronous job's own
  :func:`~dynabatch.scheduler.sync.artifacts.publish_model`: ``model.safetensors`` and
  ``manifest.json``, kept for download and written to ``artifacts.dir`` when set.
"""

from __future__ import annotations

import logging
from typing import Any

from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.control import Assign, Drain, JobControl, Scale
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.membership import NodeAssignment, slowest_first
from dynabatch.scheduler.core.ps.batch_policy import JiConfig, PerfAwareBatches
from dynabatch.scheduler.core.ps.machine import PSCore
from dynabatch.scheduler.core.ps.protocol import PSConfig
from dynabatch.scheduler.ps.model import export_model
from dynabatch.scheduler.runtime.ps_seam import LearnerExit, NodeJoined, PSRuntime
from dynabatch.scheduler.runtime.seam import Clock
from dynabatch.scheduler.telemetry import (
    EpochRecord,
    JobSnapshot,
    PSStatus,
    PSWorkerStatus,
    WorkerEpochStats,
)

log = logging.getLogger("dynabatch.ps")

POLL_S = 0.25
NODE_POLL_S = 0.5


def base_batch(spec: JobSpec) -> int:
    """μ = global_batch // workers: each learner's batch, so μλ = global_batch."""
    return max(1, spec.global_batch // (spec.initial_workers or 1))


def ps_config(spec: JobSpec) -> PSConfig:
    p = spec.protocol
    return PSConfig(p.mode, p.n, p.lr_staleness, p.max_staleness, p.on_stale)


def build_core(spec: JobSpec, dataset_size: int) -> PSCore:
    p = spec.protocol
    b0 = base_batch(spec)
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
        ps_config(spec),
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


def ps_status(spec: JobSpec, snap: dict[str, Any]) -> PSStatus:
    """The server's snapshot as the typed view REST, metrics and the CLI share. Pushes per
    second is the server's rolling rate (the last 10 s), not a lifetime average."""
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
    """``final_train_loss``: after the last epoch, evaluate the final weights on the whole
    training set (:attr:`final_train_loss`; benchmarks compare Ray and the simulator on it).
    ``runtime``: where the server and learners run (default: Ray). ``core``: the job's core
    (default: :func:`build_core` from the spec; experiments pass their own)."""

    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        resume: bool = True,
        *,
        final_train_loss: bool = False,
        runtime: PSRuntime | None = None,
        core: PSCore | None = None,
        clock: Clock | None = None,
    ):
        if runtime is None:
            from dynabatch.scheduler.runtime.ray_ps import RayPSRuntime

            runtime = RayPSRuntime(spec, self._follow_actor_output, clock)
        super().__init__(job_id, spec, clock or runtime.clock)
        self.runtime = runtime
        self.core = core
        self._learners: dict[str, str] = {}  # id → node
        self._next = 0
        self._nodes: list[Any] = []
        self._snap: dict[str, Any] | None = None
        self._seen_epochs = 0
        self._last_t: float | None = None
        self._want_final_loss = final_train_loss
        self.final_train_loss: float | None = None
        # (input shape, class count) of the model, once the data is loaded: its export.
        self.model_shape: tuple[tuple[int, ...], int] | None = None

    # ------------------------------------------------------------------ public interface
    @property
    def server_stats(self) -> dict[str, Any] | None:
        """The server's last raw snapshot (``started_s``, ``elapsed_s``, ``puts``, ...)."""
        with self._lock:
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
            self._finish(JobState.FAILED, str(err))
        except Exception as err:  # the job fails with the reason; the actor stays up
            log.exception("ps job %s failed", self.job_id)
            self._finish(JobState.FAILED, f"internal error: {type(err).__name__}: {err}")
        return False

    def snapshot(self) -> JobSnapshot:
        with self._lock:
            snap = self._snap
            last = self._history[-1] if self._history else None
            events = self._event_counts()
            return JobSnapshot(
                job_id=self.job_id,
                name=self.spec.name,
                state=self.state,
                reason=self.reason,
                epoch=snap["epoch"] if snap else 0,
                epochs=self.spec.epochs,
                policy=f"ps-{self.spec.protocol.mode}",
                emulated=self.spec.emulated,
                train_loss=last.train_loss if last else None,
                test_accuracy=last.test_accuracy if last else None,
                test_metrics=last.scores if last else {},
                epochs_completed=len(self._history),
                epoch_durations_s=[r.wall_s for r in self._history],
                worker_events=events,
                retried_samples_total=sum(r.retried_samples for r in self._history),
                started_at=self.started_at,
                finished_at=self.finished_at,
                ps=ps_status(self.spec, snap) if snap else None,
            )

    def _member_ids(self) -> list[str]:
        return list(self._learners)

    def _assignment_error(self, nodes: NodeAssignment) -> str | None:
        # Learners are independent (asynchronous or stale-synchronous updates to the
        # server): any number of at least one can train.
        return None

    def shutdown(self) -> None:
        self._learners.clear()
        self.runtime.shutdown()

    # ------------------------------------------------------------------ the loop
    def _start(self) -> bool:
        s = self.spec
        self.started_at = self.clock.time()
        ds = self.runtime.load_data()
        problem = dataset_problem(s, ds)
        if problem:
            self._finish(JobState.FAILED, problem)
            return False
        self.model_shape = (tuple(ds.input_shape), int(ds.num_classes))
        if self.core is None:
            self.core = build_core(s, len(ds.y_train))
        self.runtime.start_server(self.core, s.initial_workers or 0)
        nodes = self.runtime.nodes()
        deadline = self.clock.now() + s.worker_wait_timeout_s
        while not nodes and self.clock.now() < deadline:
            self.clock.sleep(NODE_POLL_S)
            nodes = self.runtime.nodes()
        if not nodes:
            self._finish(JobState.FAILED, "no eligible node for a learner")
            return False
        self._nodes = nodes
        if self.assignment is not None:  # granted by the cluster scheduler before the start
            self._place(self.assignment)  # (its queued Assign then finds nothing to do)
        else:
            for i in range(s.initial_workers or len(nodes)):
                self._spawn(nodes[i % len(nodes)].node_id)
        self._transition(JobState.RUNNING, None)
        return True

    def _step(self) -> bool:
        self._serve_requests()
        for x in self.runtime.wait(POLL_S):
            if isinstance(x, NodeJoined):
                if self.assignment is None:  # assigned, it grows onto no other node
                    self._spawn(x.node_id)
            elif x.worker not in self._learners:
                continue
            elif x.error is None:
                self._learners.pop(x.worker)  # finished normally
            elif not x.lost:  # its code raised: every learner would; the job fails
                self._log("ERROR", f"learner {x.worker} failed: {x.error}")
                self._finish(JobState.FAILED, x.error)
                return False
            else:
                self._lose(x)  # its actor or node died: no regroup
        snap = self.runtime.snapshot()
        with self._lock:
            self._snap = snap
        if self._last_t is None and snap.get("started_s") is not None:
            self._last_t = snap["started_s"]  # the first epoch is timed from the start barrier
        for e in snap["epochs"][self._seen_epochs :]:
            self._record_epoch(e, e["t"] - (self._last_t or 0.0))
            self._last_t = e["t"]
            if not e["verified"]:
                self._finish(
                    JobState.FAILED,
                    f"epoch {e['epoch']} not exactly once: " + "; ".join(e["problems"][:3]),
                )
                return False
        self._seen_epochs = len(snap["epochs"])
        if snap["finished"]:
            if self._want_final_loss:
                self.final_train_loss = self.runtime.train_loss()
            export_model(self, "end")
            self._finish(JobState.SUCCEEDED, None)
            return False
        if self._cancel:
            if self._history:  # it trained something: its model goes out
                export_model(self, "cancel")
            self._finish(JobState.CANCELLED, self._cancel)
            return False
        if not self._learners:
            self._finish(JobState.FAILED, "every learner was lost")
            return False
        return True

    def _spawn(self, node_id: str) -> str:
        w = f"w{self._next}"
        ordinal = self._next
        self._next += 1
        self.runtime.spawn(w, ordinal, node_id)
        with self._lock:
            self._learners[w] = node_id
        self._event("join", w, node_id, "joined")
        return w

    def _lose(self, x: LearnerExit) -> None:
        node = self._learners.pop(x.worker)
        self.runtime.leave(x.worker)
        self._event("failure", x.worker, node, x.error or "lost")

    def _serve_requests(self) -> None:
        for r in self._take_requests():
            if isinstance(r, Assign):
                self._place(r.nodes)
            elif isinstance(r, Drain) and r.worker in self._learners:
                self._remove(r.worker, "drained")
            elif isinstance(r, Scale):
                self._nodes = self.runtime.nodes() or self._nodes
                while len(self._learners) < r.workers:
                    self._spawn(self._nodes[self._next % len(self._nodes)].node_id)
                extra = max(0, len(self._learners) - r.workers)
                for w in self._slowest_first()[:extra]:
                    self._remove(w, f"scaled down to {r.workers}")

    def _place(self, a: NodeAssignment) -> None:
        """Learners on exactly the assignment's slots: on each node the slowest beyond its
        slots leave (all of them on a node no longer assigned), then empty slots get new
        learners. A leaving learner's in-flight samples are re-queued, as on a drain."""
        keep: dict[str, int] = {}
        for w in reversed(self._slowest_first()):  # the fastest first keep their slots
            node = self._learners[w]
            if keep.get(node, 0) < a.get(node):
                keep[node] = keep.get(node, 0) + 1
            else:
                self._remove(w, "assigned elsewhere")
        for node, k in a.slots:
            for _ in range(k - keep.get(node, 0)):
                self._spawn(node)

    def _slowest_first(self) -> list[str]:
        """Learners in the order a scale-down removes them: by samples applied per second
        since each joined, the slowest first (one with none applied yet first of all)."""
        now = self.clock.time()
        joined = {e.worker: e.time for e in self.events if e.kind == "join"}
        stats = (self._snap or {}).get("workers", {})
        speeds = {}
        for w in self._learners:
            v, age = stats.get(w), now - joined.get(w, now)
            if v and age > 0:
                speeds[w] = v.get("applied", 0) * v.get("batch", 0) / age
        return slowest_first([(w, _ordinal(w)) for w in self._learners], speeds)

    def _remove(self, w: str, why: str) -> None:
        """Stop learner ``w``: it leaves, its in-flight samples are re-queued."""
        with self._lock:
            node = self._learners.pop(w)
        self.runtime.kill(w)
        self.runtime.leave(w)
        self._event("leave", w, node, why)

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
        with self._lock:
            self._history.append(rec)
        self.tracking.epoch(rec)
        self._log(
            "INFO",
            f"epoch {rec.epoch}: version {e['version']}, test loss "
            f"{e['test_loss']:.4f}, accuracy {e['test_accuracy']:.3f}, "
            f"verified={rec.verified}",
        )


def _ordinal(worker: str) -> int:
    return int(worker.lstrip("w") or 0)

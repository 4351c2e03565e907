"""The Ray driver of a parameter-server job (``protocol: {name: ps}``).

:class:`PSCoordinator` has the coordinator's public interface (``run``, ``snapshot``,
``history``, ``logs``, ``cancel``, ``scale``, ``drain``, ``shutdown``), so the service
launches and polls it like the synchronous one (:mod:`dynabatch.scheduler.runtime.launch`). The
job's brain is
the pure :class:`~dynabatch.scheduler.core.ps.machine.PSCore`, which lives inside the server actor
(:class:`dynabatch.actors.ps.ParameterServer`); the simulator (:mod:`dynabatch.scheduler.sim.ps`)
drives the same
core. This driver only starts actors and turns what happens to them into core events:

* a learner whose ``run`` fails because its node or process died *leaves*: its in-flight
  gradient is dropped and its samples are re-queued; nobody regroups. A learner whose own
  code raised (a deterministic error, e.g. a workload that cannot train) fails the job with
  that error as the reason;
* ``scale`` up spawns learners that join, pull and start; ``scale`` down and ``drain`` kill
  learners (the newest first) and they leave, their in-flight samples re-queued;
* ``protocol.shards: k`` starts k−1 :class:`~dynabatch.actors.ps.ParamShard` actors beside the
server,
  which holds slice 0 and the one core (the protocol is decided in one place only).

Every remote call has a timeout.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.control import JobControl
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.ps.batch_policy import JiConfig, PerfAwareBatches
from dynabatch.scheduler.core.ps.machine import PSCore
from dynabatch.scheduler.core.ps.protocol import PSConfig
from dynabatch.scheduler.telemetry import (
    EpochRecord,
    JobSnapshot,
    PSStatus,
    PSWorkerStatus,
    WorkerEpochStats,
)

log = logging.getLogger("dynabatch.ps")

POLL_S = 0.25
CALL_TIMEOUT_S = 30.0
# A new actor's first call also waits for its process to start and import torch (tens of
# seconds on a loaded 2-core machine).
START_TIMEOUT_S = 180.0


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
    ji = (JiConfig(b0=b0, b_min=max(1, b0 // 4), b_max=4 * b0, every_pushes=p.replan_pushes,
                   scale_lr=p.scale_lr) if p.batch == "perf_aware" else None)
    return PSCore(ps_config(spec), dataset_size=dataset_size, epochs=spec.epochs,
                  seed=spec.seed, batches=PerfAwareBatches(b0, ji))


def dataset_problem(spec: JobSpec, ds: Any) -> str | None:
    """A loaded dataset the parameter server cannot train (one line naming the field): a
    user loader's targets are only known once it ran (built-ins are refused at submit)."""
    if ds.targets != "classes":
        return (f"dataset.name: protocol ps trains classification (class labels) only; "
                f"{spec.dataset.name!r} has {ds.targets} targets")
    return None


def ps_status(spec: JobSpec, snap: dict[str, Any]) -> PSStatus:
    """The server's snapshot as the typed view REST, metrics and the CLI share. Pushes per
    second is the server's rolling rate (the last 10 s), not a lifetime average."""
    return PSStatus(
        mode=spec.protocol.mode, version=snap["version"], applied=snap["applied"],
        refused=snap["refused"], deferred=snap["deferred"], pushes=snap["pushes"],
        pushes_per_s=snap.get("pushes_per_s", 0.0),
        workers=[PSWorkerStatus(worker=w, **v) for w, v in sorted(snap["workers"].items())],
    )


class PSCoordinator(JobControl):
    """``final_train_loss``: after the last epoch, evaluate the final weights on the whole
    training set (:attr:`final_train_loss`), as the simulator does (benchmarks compare the
    two drivers on it)."""

    def __init__(self, job_id: str, spec: JobSpec, resume: bool = True, *,
                 final_train_loss: bool = False):
        super().__init__(job_id, spec)
        self._server: Any = None
        self._shards: list[Any] = []
        self._bounds: tuple[tuple[int, int], ...] | None = None
        self._learners: dict[str, tuple[Any, Any, str]] = {}  # id → (handle, run ref, node)
        self._next = 0
        self._snap: dict[str, Any] | None = None
        self._data: dict[str, Any] = {}
        self._ds: Any = None
        self._want_final_loss = final_train_loss
        self.final_train_loss: float | None = None

    # ------------------------------------------------------------------ public interface
    @property
    def server_stats(self) -> dict[str, Any] | None:
        """The server's last raw snapshot (``started_s``, ``elapsed_s``, ``puts``, ...)."""
        with self._lock:
            return self._snap

    def run(self) -> JobSnapshot:
        from dynabatch.actors.workloads import WorkloadError

        try:
            self._run()
        except WorkloadError as err:  # the data or model cannot be used: its own message
            self._finish(JobState.FAILED, str(err))
        except Exception as err:  # the job fails with the reason; the actor stays up
            log.exception("ps job %s failed", self.job_id)
            self._finish(JobState.FAILED, f"internal error: {type(err).__name__}: {err}")
        finally:
            self.shutdown()
        return self.snapshot()

    def snapshot(self) -> JobSnapshot:
        with self._lock:
            snap = self._snap
            last = self._history[-1] if self._history else None
            events = self._event_counts()
            return JobSnapshot(
                job_id=self.job_id, name=self.spec.name, state=self.state, reason=self.reason,
                epoch=snap["epoch"] if snap else 0, epochs=self.spec.epochs,
                policy=f"ps-{self.spec.protocol.mode}", emulated=self.spec.emulated,
                train_loss=last.train_loss if last else None,
                test_accuracy=last.test_accuracy if last else None,
                epochs_completed=len(self._history),
                epoch_durations_s=[r.wall_s for r in self._history], worker_events=events,
                retried_samples_total=sum(r.retried_samples for r in self._history),
                started_at=self.started_at, finished_at=self.finished_at,
                ps=ps_status(self.spec, snap) if snap else None,
            )

    def _member_ids(self) -> list[str]:
        return list(self._learners)

    def shutdown(self) -> None:
        import ray

        for handle, _, _ in list(self._learners.values()):
            ray.kill(handle, no_restart=True)
        self._learners.clear()
        if self._server is not None:
            ray.kill(self._server, no_restart=True)
            self._server = None
        for shard in self._shards:
            ray.kill(shard, no_restart=True)
        self._shards = []

    def kill_learner(self, worker: str) -> None:
        """Fault injection for tests and benchmarks: the learner's process dies."""
        import ray

        ray.kill(self._learners[worker][0], no_restart=True)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        import ray
        from dynabatch.actors.ps import ParameterServer, ParamShard, param_count, shard_bounds
        from dynabatch.actors.workloads.datasets import load_dataset
        from dynabatch.scheduler.runtime.pool import eligible_nodes

        s = self.spec
        self.started_at = self.clock.time()
        output = self._follow_actor_output()  # this driver's, the server's, each learner's
        ds = load_dataset(s.dataset, seed=s.seed)
        problem = dataset_problem(s, ds)
        if problem:
            self._finish(JobState.FAILED, problem)
            return
        self._data = {"x_train": ray.put(ds.x_train), "y_train": ray.put(ds.y_train),
                      "input_shape": tuple(ds.input_shape), "num_classes": ds.num_classes}
        self._ds = ds
        core = build_core(s, len(ds.y_train))
        shape = tuple(ds.input_shape)
        self._bounds = shard_bounds(param_count(s, shape, ds.num_classes), s.protocol.shards)
        # The server and its shards run on the head node, beside the coordinator, never on
        # a learner's node: losing a learner's node must cost that learner only, not the
        # job's parameters.
        head = {"node:__internal_head__": 0.001}
        self._shards = [
            ray.remote(ParamShard).options(num_cpus=0, max_restarts=0, resources=head).remote(
                s, shape, ds.num_classes, b) for b in self._bounds[1:]]
        self._server = ray.remote(ParameterServer).options(
            num_cpus=0, max_restarts=0, max_concurrency=1000, resources=head,
        ).remote(s, core, shape, ds.num_classes, ds.x_test, ds.y_test, self._shards,
                 self._bounds, start_learners=s.initial_workers or 0,
                 start_timeout_s=max(60.0, s.worker_wait_timeout_s),
                 call_timeout_s=CALL_TIMEOUT_S)
        output.watch("server", self._server.actor_id.remote())
        for i, shard in enumerate(self._shards, start=1):
            output.watch(f"shard{i}", shard.actor_id.remote())
        ray.get([h.actor_id.remote() for h in (self._server, *self._shards)],
                timeout=START_TIMEOUT_S)  # up (the later calls get the short timeout)
        nodes = eligible_nodes(s)
        deadline = time.monotonic() + s.worker_wait_timeout_s
        while not nodes and time.monotonic() < deadline:
            time.sleep(0.5)
            nodes = eligible_nodes(s)
        if not nodes:
            self._finish(JobState.FAILED, "no eligible node for a learner")
            return
        for i in range(s.initial_workers or len(nodes)):
            self._spawn(nodes[i % len(nodes)].node_id)
        self._transition(JobState.RUNNING, None)
        seen_epochs = 0
        last_t: float | None = None
        while True:
            self._serve_requests(nodes)
            refs = {ref: w for w, (_, ref, _) in self._learners.items()}
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=POLL_S)
            for ref in done:
                w = refs[ref]
                try:
                    ray.get(ref, timeout=CALL_TIMEOUT_S)
                    self._learners.pop(w)  # finished normally
                except Exception as err:
                    own = _own_error(err)
                    if own is not None:  # its code raised: every learner would; the job fails
                        self._log("ERROR", f"learner {w} failed: {own}")
                        self._finish(JobState.FAILED, own)
                        return
                    self._lose(w, _first_line(err))  # its actor or node died: no regroup
            snap = ray.get(self._server.snapshot.remote(), timeout=CALL_TIMEOUT_S)
            with self._lock:
                self._snap = snap
            if last_t is None and snap.get("started_s") is not None:
                last_t = snap["started_s"]  # the first epoch is timed from the start barrier
            for e in snap["epochs"][seen_epochs:]:
                self._record_epoch(e, e["t"] - (last_t or 0.0))
                last_t = e["t"]
                if not e["verified"]:
                    self._finish(JobState.FAILED, f"epoch {e['epoch']} not exactly once: "
                                 + "; ".join(e["problems"][:3]))
                    return
            seen_epochs = len(snap["epochs"])
            if snap["finished"]:
                if self._want_final_loss:
                    self._evaluate_final()
                self._finish(JobState.SUCCEEDED, None)
                return
            if self._cancel:
                self._finish(JobState.CANCELLED, self._cancel)
                return
            if not self._learners:
                self._finish(JobState.FAILED, "every learner was lost")
                return

    def _spawn(self, node_id: str) -> str:
        import ray
        from dynabatch.actors.ps import Learner
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        s = self.spec
        w = f"w{self._next}"
        ordinal = self._next
        self._next += 1
        handle = ray.remote(Learner).options(
            num_cpus=s.worker_cpus, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(w, ordinal, s, self._data["x_train"], self._data["y_train"],
                 self._data["input_shape"], self._data["num_classes"])
        if self.output is not None:  # asked before run(), which holds the actor to the end
            self.output.watch(w, handle.actor_id.remote())
        ray.get(self._server.join.remote(w), timeout=CALL_TIMEOUT_S)
        ref = handle.run.remote(self._server, self._shards, self._bounds, CALL_TIMEOUT_S)
        with self._lock:
            self._learners[w] = (handle, ref, node_id)
        self._event("join", w, node_id, "joined")
        return w

    def _lose(self, w: str, why: str) -> None:
        import ray

        _, _, node = self._learners.pop(w)
        if self.output is not None:  # a dead learner's last lines, its traceback
            self.output.unwatch(w)
        ray.get(self._server.leave.remote(w), timeout=CALL_TIMEOUT_S)
        self._event("failure", w, node, why)

    def _serve_requests(self, nodes: list[Any]) -> None:
        from dynabatch.scheduler.runtime.pool import eligible_nodes

        for kind, arg in self._take_requests():
            if kind == "drain" and arg in self._learners:
                self._remove(arg, "drained")
            elif kind == "scale":
                nodes[:] = eligible_nodes(self.spec) or nodes
                while len(self._learners) < arg:
                    self._spawn(nodes[self._next % len(nodes)].node_id)
                for w in sorted(self._learners, key=_ordinal)[arg:]:  # the newest go first
                    self._remove(w, f"scaled down to {arg}")

    def _remove(self, w: str, why: str) -> None:
        """Stop learner ``w``: it leaves, its in-flight samples are re-queued."""
        import ray

        handle, _, node = self._learners.pop(w)
        ray.kill(handle, no_restart=True)
        if self.output is not None:
            self.output.unwatch(w)
        ray.get(self._server.leave.remote(w), timeout=CALL_TIMEOUT_S)
        self._event("leave", w, node, why)

    def _evaluate_final(self) -> None:
        """The full training-set loss of the final weights (the simulator's ``final_loss``)."""
        import ray
        from dynabatch.actors.ps import ParamStore

        ds = self._ds
        _, flat = ray.get(self._server.pull.remote(), timeout=CALL_TIMEOUT_S)
        store = ParamStore(self.spec, tuple(ds.input_shape), ds.num_classes)
        self.final_train_loss = store.evaluate(ds.x_train, ds.y_train, flat)[0]

    # ------------------------------------------------------------------ records
    def _record_epoch(self, e: dict[str, Any], wall_s: float) -> None:
        snap = self._snap or {"workers": {}}
        workers = [
            WorkerEpochStats(worker=w, node="", batch=v["batch"],
                             partition=e["samples_by_worker"].get(w, 0), steps=v["applied"],
                             compute_s=0.0, wait_s=0.0, throughput=0.0)
            for w, v in sorted(snap["workers"].items())
        ]
        rec = EpochRecord(
            epoch=e["epoch"], wall_s=wall_s, steps=e["version"],
            dataset_size=e["samples_applied"], samples_trained=e["samples_applied"],
            retried_samples=e["retried_samples"], verified=e["verified"],
            train_loss=e["train_loss"], test_loss=e["test_loss"],
            test_accuracy=e["test_accuracy"], utilization=0.0, compute_balance=0.0,
            policy=f"ps-{self.spec.protocol.mode}", emulated=self.spec.emulated,
            workers=workers,
        )
        with self._lock:
            self._history.append(rec)
        self._log("INFO", f"epoch {rec.epoch}: version {e['version']}, test loss "
                  f"{e['test_loss']:.4f}, accuracy {e['test_accuracy']:.3f}, "
                  f"verified={rec.verified}")


def _ordinal(worker: str) -> int:
    return int(worker.lstrip("w") or 0)


def _own_error(err: BaseException) -> str | None:
    """The message of an error the learner's own code raised (None when its actor, node or
    a remote call failed: Ray's errors, which mean it is lost). A ``WorkloadError`` names
    the spec field, so its message is the reason as it is."""
    from dynabatch.actors.workloads import WorkloadError
    from ray.exceptions import RayError, RayTaskError

    cause = err.cause if isinstance(err, RayTaskError) else None
    if cause is None or isinstance(cause, RayError | TimeoutError):
        return None
    if isinstance(cause, WorkloadError):
        return _first_line(cause)
    return f"{type(cause).__name__}: {_first_line(cause)}"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]

"""The scheduler of one job: a thin loop of gather, decide, apply.

The control loop advances in *segments* of consecutive steps. At every segment boundary
(a step boundary) it can:

* re-plan the rest of the epoch: split the epoch's not-yet-trained samples over the
  current workers with new batch sizes (rebalance, worker joined, left or failed);
* change membership: re-form the process group with a fresh store (a new generation),
  broadcasting model and optimizer state from a member that has it.

Sample order is a seeded permutation per epoch and step s always trains
``order[s·B : s·B + B]``, so the sequence of global batches is that of one-process SGD
with batch B whatever the allocation or the membership.

The class is plain; ``scheduler.launch`` applies ``ray.remote``. ``run()`` loops ``step()``
until the job is terminal, and the other public methods are safe to call from other
threads while it runs (the actor is threaded).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from actors.worker import SegmentPlan
from scheduler.checkpoint import load_checkpoint, save_checkpoint
from scheduler.model import StepTimeStats, fit
from scheduler.policy import Allocation, Decision, WorkerTelemetry, make_policy
from scheduler.pool import eligible_nodes, spawn_worker
from scheduler.state import InvalidTransition, JobState
from scheduler.telemetry import (
    EpochRecord,
    JobSnapshot,
    LogLine,
    MembershipEvent,
    SegmentResult,
    StepTelemetry,
    WorkerEpochStats,
    WorkerStatus,
)
from service.spec import JobSpec

log = logging.getLogger("dynabatch.scheduler")

# Older observations fade by this factor per new one, so the step-time model follows a
# worker whose speed changes.
STATS_DECAY = 0.9
# A segment whose mean compute is off the model by more than this factor is a change of
# speed (a disturbance), not noise: the worker's model restarts from the new observations.
SURPRISE = 1.5
MAX_SEGMENT_STEPS = 8
NODE_POLL_S = 1.0


class _JobEnded(Exception):
    """Raised after the job has been moved to a terminal state, to unwind the step."""


@dataclass
class Member:
    worker_id: str
    ordinal: int
    node: str
    handle: Any
    capacity: float
    stats: StepTimeStats = field(default_factory=StepTimeStats)
    window_samples: int = 0
    window_compute: float = 0.0
    epoch_samples: int = 0
    epoch_compute: float = 0.0
    epoch_wait: float = 0.0
    epoch_steps: int = 0
    compute_per_step: float = 0.0
    wait_per_step: float = 0.0
    slowdown: float = 1.0
    observed_steps: int = 0

    def telemetry(self, cap: int | None) -> WorkerTelemetry:
        return WorkerTelemetry(
            worker=self.worker_id,
            batch=0,
            samples=self.window_samples,
            compute_s=self.window_compute,
            cap=cap,
            capacity=self.capacity,
            stats=self.stats,
        )


@dataclass
class _Pending:
    member: Member
    ready: Any
    since: float


class Coordinator:
    def __init__(self, job_id: str, spec: JobSpec | dict, *, resume: bool = True):
        self.job_id = job_id
        self.spec = spec if isinstance(spec, JobSpec) else JobSpec.model_validate(spec)
        self._lock = threading.RLock()
        self.state = JobState.PENDING
        self.reason: str | None = "starting workers"
        self.epoch = 0
        self.step_in_epoch = 0
        self.generation = 0
        self.members: list[Member] = []
        self._pending: list[_Pending] = []
        self._next_ordinal = 0
        self._history: list[EpochRecord] = []
        self._logs: deque[LogLine] = deque(maxlen=5000)
        self._log_seq = 0
        self.events: list[MembershipEvent] = []
        self.rebalances_total = 0
        self.regroup_seconds_total = 0.0
        self.retried_samples_total = 0
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._cancel: str | None = None
        self._drain: set[str] = set()
        self._target: int | None = self.spec.initial_workers
        self._max = self.spec.max_workers or (self.spec.initial_workers or 10**6)
        self._min = self.spec.min_workers or 1
        self._last_node_poll = 0.0
        self._below_min_since: float | None = None
        self._data: dict[str, Any] | None = None
        self.allocation: Allocation | None = None
        self._plan_offset = 0  # order position where the allocation starts
        self._plan_step0 = 0  # epoch step where the allocation starts
        self._order: np.ndarray | None = None
        self._ep: dict[str, Any] = {}
        self._recent_steps: deque[list[StepTelemetry]] = deque(maxlen=2000)
        self._indices: dict[int, list[int]] = {}
        self._resume_state: dict[str, Any] | None = None
        policy_opts = {}
        if self.spec.policy == "affine" and self.spec.rebalance.mode == "adaptive":
            policy_opts["min_gain"] = self.spec.rebalance.threshold
        self.policy = make_policy(self.spec.policy, **policy_opts)
        if resume and self.spec.checkpoint.dir:
            self._restore(load_checkpoint(self.spec.checkpoint.dir, job_id))

    # ---------------------------------------------------------------- public interface
    def run(self) -> JobSnapshot:
        while self.step():
            pass
        return self.snapshot()

    def step(self) -> bool:
        """One control-loop step; False once the job is terminal."""
        try:
            return self._step()
        except _JobEnded:
            return False
        except Exception as err:  # the job fails with the reason; the actor stays up
            log.exception("job %s failed", self.job_id)
            self._finish(JobState.FAILED, f"internal error: {type(err).__name__}: {err}")
            return False

    def snapshot(self) -> JobSnapshot:
        with self._lock:
            alloc = self.allocation
            workers = []
            for rank, m in enumerate(self.members):
                batch = part = 0
                if alloc and m.worker_id in alloc.workers:
                    i = alloc.index(m.worker_id)
                    batch = alloc.batches[i]
                    part = m.epoch_samples + alloc.partitions[i] - self._planned_done(i)
                workers.append(
                    WorkerStatus(
                        worker=m.worker_id,
                        node=m.node,
                        rank=rank,
                        batch=batch,
                        partition=part,
                        throughput=(
                            m.window_samples / m.window_compute
                            if m.window_compute
                            else (batch / m.compute_per_step if m.compute_per_step else 0.0)
                        ),
                        compute_s_per_step=m.compute_per_step,
                        wait_s_per_step=m.wait_per_step,
                        slowdown=m.slowdown,
                    )
                )
            last = self._history[-1] if self._history else None
            events: dict[str, int] = {}
            for e in self.events:
                key = f"{e.kind}:{e.reason}"
                events[key] = events.get(key, 0) + 1
            return JobSnapshot(
                job_id=self.job_id,
                name=self.spec.name,
                state=self.state,
                reason=self.reason,
                epoch=self.epoch,
                step=self.step_in_epoch,
                steps_per_epoch=self._steps_per_epoch(),
                epochs=self.spec.epochs,
                generation=self.generation,
                policy=self.spec.policy,
                emulated=self.spec.emulated,
                workers=workers,
                train_loss=last.train_loss if last else None,
                test_accuracy=last.test_accuracy if last else None,
                utilization=last.utilization if last else None,
                compute_balance=last.compute_balance if last else None,
                rebalances_total=self.rebalances_total,
                epochs_completed=len(self._history),
                epoch_durations_s=[r.wall_s for r in self._history],
                worker_events=events,
                regroup_seconds_total=self.regroup_seconds_total,
                retried_samples_total=self.retried_samples_total,
                started_at=self.started_at,
                finished_at=self.finished_at,
            )

    def history(self, since: int = 0) -> list[EpochRecord]:
        with self._lock:
            return [r for r in self._history if r.epoch >= since]

    def logs(self, since: int = 0) -> list[LogLine]:
        with self._lock:
            return [line for line in self._logs if line.seq >= since]

    def membership_events(self) -> list[MembershipEvent]:
        with self._lock:
            return list(self.events)

    def recent_steps(self) -> list[list[StepTelemetry]]:
        """Per-step telemetry of recent steps (benchmarks read per-step balance here)."""
        with self._lock:
            return list(self._recent_steps)

    def trained_indices(self, epoch: int) -> list[int]:
        with self._lock:
            return list(self._indices.get(epoch, []))

    def cancel(self, reason: str = "cancelled by user") -> JobSnapshot:
        with self._lock:
            if self.state.is_terminal:
                raise InvalidTransition(self.state, JobState.CANCELLED)
            self._cancel = reason
        return self.snapshot()

    def scale(self, workers: int) -> JobSnapshot:
        if workers < 1:
            raise ValueError("workers: must be at least 1")
        with self._lock:
            if self.state.is_terminal:
                raise InvalidTransition(self.state, JobState.RUNNING)
            # An explicit size: neither more (growth onto free nodes) nor fewer.
            self._target = workers
            self._max = workers
            self._min = min(self._min, workers)
            self._log("INFO", f"scale requested: {workers} workers")
            for m in self.members[workers:]:
                self._drain.add(m.worker_id)
        return self.snapshot()

    def drain(self, worker: str) -> JobSnapshot:
        with self._lock:
            if worker not in {m.worker_id for m in self.members}:
                raise KeyError(f"worker {worker!r} is not a member of job {self.job_id}")
            if len(self.members) - len(self._drain) <= 1:
                raise ValueError("cannot drain the last worker")
            self._drain.add(worker)
            self._target = max(1, len(self.members) - len(self._drain))
            self._max = self._target
            self._log("INFO", f"drain requested for {worker}")
        return self.snapshot()

    def shutdown(self) -> None:
        for m in self.members:
            self._kill(m)
        for p in self._pending:
            self._kill(p.member)

    # ---------------------------------------------------------------- the loop
    def _step(self) -> bool:
        if self.state.is_terminal:
            return False
        if self._cancel is not None:
            self._checkpoint(reason="cancel")
            self._finish(JobState.CANCELLED, self._cancel)
            return False
        if self._data is None:
            self._load_data()
        if not self._reconcile_membership():
            return not self.state.is_terminal
        if self._order is None:
            self._begin_epoch()
        result = self._train_segment()
        if result and self.step_in_epoch >= self._steps_per_epoch():
            self._end_epoch()
        elif result:
            self._maybe_rebalance()
        return not self.state.is_terminal

    # ---------------------------------------------------------------- data and epochs
    def _load_data(self) -> None:
        from service.workloads import WorkloadError
        from service.workloads.datasets import load_dataset
        from service.workloads.models import build_model

        t0 = time.perf_counter()
        try:
            ds = load_dataset(self.spec.dataset, seed=self.spec.seed)
            # Fail here, with the field named, rather than inside every worker's constructor.
            build_model(self.spec.model, tuple(ds.input_shape), ds.num_classes)
        except WorkloadError as err:
            self._finish(JobState.FAILED, str(err))
            raise _JobEnded from None
        self._data = {
            "x_train": ray.put(ds.x_train),
            "y_train": ray.put(ds.y_train),
            "x_test": ray.put(ds.x_test),
            "y_test": ray.put(ds.y_test),
            "input_shape": tuple(ds.input_shape),
            "num_classes": ds.num_classes,
            "n_train": len(ds.y_train),
        }
        self._log(
            "INFO",
            f"loaded {ds.name}: {len(ds.y_train)} train, {len(ds.y_test)} test "
            f"samples in {time.perf_counter() - t0:.2f}s",
        )

    def _steps_per_epoch(self) -> int:
        if not self._data:
            return 0
        return -(-self._data["n_train"] // self.spec.global_batch)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.spec.seed, epoch])
        return rng.permutation(self._data["n_train"])

    def _begin_epoch(self) -> None:
        self._order = self._epoch_order(self.epoch)
        self._ep = {
            "t0": time.perf_counter(),
            "wall": 0.0,
            "worker_seconds": 0.0,
            "loss_sum": 0.0,
            "samples": 0,
            "retried": 0,
            "rebalances": 0,
            "gen0": self.generation,
        }
        for m in self.members:
            m.epoch_samples = m.epoch_compute = m.epoch_wait = 0
            m.epoch_steps = 0
        if self.spec.record_indices:
            self._indices[self.epoch] = []
        start = self.step_in_epoch * self.spec.global_batch
        self._replan(start, why="epoch start")

    def _replan(self, start: int, why: str, force: bool = False) -> Decision:
        n = self._data["n_train"]
        current = self.allocation
        tel = [m.telemetry(self.spec.max_batch) for m in self.members]
        decision = self.policy.decide(tel, self.spec.global_batch, n - start, current)
        if (
            decision.rebalanced
            or force
            or current is None
            or current.workers != decision.allocation.workers
            or self._plan_offset != start
        ):
            self.allocation = decision.allocation
            self._plan_offset = start
            self._plan_step0 = self.step_in_epoch
        if decision.rebalanced:
            self.rebalances_total += 1
            self._ep["rebalances"] = self._ep.get("rebalances", 0) + 1
            self._log(
                "INFO",
                f"rebalance ({why}): batches {dict(zip(decision.allocation.workers, decision.allocation.batches, strict=True))}"  # noqa: E501
                f" — {decision.reason}",
            )
        for m in self.members:  # DBS measures the window since its last decision
            m.window_samples, m.window_compute = 0, 0.0
        return decision

    def _planned_done(self, i: int) -> int:
        """Samples worker i has trained under the current allocation so far."""
        alloc = self.allocation
        done_steps = self.step_in_epoch - self._plan_step0
        if done_steps <= 0:
            return 0
        full = min(done_steps, alloc.steps - 1)
        total = full * alloc.batches[i]
        if done_steps >= alloc.steps:
            total += alloc.step_shares(alloc.steps - 1)[i]
        return total

    def _segment_length(self) -> int:
        remaining = self._steps_per_epoch() - self.step_in_epoch
        mode = self.spec.rebalance
        k = {"epoch": MAX_SEGMENT_STEPS, "steps": mode.every_steps, "adaptive": mode.check_steps}[
            mode.mode
        ]
        if mode.mode == "steps":
            # Land on multiples of K so "every K steps" means what it says.
            k = k - (self.step_in_epoch % k)
        return max(1, min(k, remaining, MAX_SEGMENT_STEPS if mode.mode == "epoch" else k))

    # ---------------------------------------------------------------- training
    def _train_segment(self) -> bool:
        alloc = self.allocation
        k = self._segment_length()
        local0 = self.step_in_epoch - self._plan_step0
        ranges = alloc.worker_ranges(local0, k)
        step_batches = tuple(alloc.step_batch(local0 + j) for j in range(k))
        plans = []
        for i, _m in enumerate(self.members):
            idx = tuple(
                self._order[self._plan_offset + a : self._plan_offset + b] for a, b in ranges[i]
            )
            plans.append(SegmentPlan(self.epoch, self.step_in_epoch, step_batches, idx))
        t0 = time.perf_counter()
        refs = [m.handle.run_segment.remote(p) for m, p in zip(self.members, plans, strict=True)]
        results, dead, hung = self._gather(refs)
        wall = time.perf_counter() - t0
        ok = [r for r in results if r is not None]
        done = (
            min((len(r.steps) for r in ok), default=0)
            if not dead and not hung and all(r.error is None for r in ok)
            else max((len(r.steps) for r in ok), default=0)
        )
        failed = bool(dead or hung or any(r.error for r in ok))
        with self._lock:
            self._account(results, done, step_batches, wall)
            self.step_in_epoch += done
        if failed:
            in_flight = step_batches[done] if done < k else 0
            self.retried_samples_total += in_flight
            self._ep["retried"] += in_flight
            reasons = {m.worker_id: "worker process died or node lost" for m in dead}
            reasons.update({m.worker_id: "hung past the collective timeout" for m in hung})
            errors = [r.error for r in ok if r.error]
            self._log(
                "WARNING",
                f"step {self.step_in_epoch} failed ({'; '.join(errors[:1]) or 'lost workers'}); "
                f"lost {sorted(reasons) or 'none'}; retrying over survivors",
            )
            for m in list(self.members):
                if m.worker_id in reasons:
                    self._remove(m, "failure", reasons[m.worker_id])
            # Survivors that got further hold the newest state: make one of them rank 0.
            progress = {r.worker: len(r.steps) for r in ok}
            self.members.sort(key=lambda m: -progress.get(m.worker_id, 0))
            self._membership_dirty = True
            return False
        return True

    def _gather(
        self, refs: list[Any]
    ) -> tuple[list[SegmentResult | None], list[Member], list[Member]]:
        """Wait for a segment; tell dead workers (actor died) from hung ones (no answer
        long after a peer gave up on the collective)."""
        pending = list(refs)
        first_failure: float | None = None
        grace = self.spec.collective_timeout_s + 5.0
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            if first_failure is None and done:
                for r in done:
                    try:
                        res = ray.get(r)
                        if res.error:
                            first_failure = time.monotonic()
                    except RayError:
                        first_failure = time.monotonic()
            if pending and first_failure is not None and time.monotonic() - first_failure > grace:
                break
        results: list[SegmentResult | None] = []
        dead: list[Member] = []
        hung: list[Member] = []
        for m, ref in zip(self.members, refs, strict=True):
            if ref in pending:
                hung.append(m)
                results.append(None)
                continue
            try:
                results.append(ray.get(ref))
            except RayActorError:
                dead.append(m)
                results.append(None)
            except RayError as err:
                self._log("WARNING", f"{m.worker_id} failed: {str(err).splitlines()[0]}")
                dead.append(m)
                results.append(None)
        return results, dead, hung

    def _account(
        self,
        results: list[SegmentResult | None],
        done: int,
        step_batches: tuple[int, ...],
        wall: float,
    ) -> None:
        """Fold a segment's telemetry into the model statistics and the epoch totals."""
        present = [(m, r) for m, r in zip(self.members, results, strict=True) if r is not None]
        steps_by_index: list[list[StepTelemetry]] = [[] for _ in range(done)]
        for m, r in present:
            steps = r.steps[:done]
            if not steps:
                continue
            for j, st in enumerate(steps):
                steps_by_index[j].append(st)
            self._observe(m, steps)
            m.window_samples += sum(s.samples for s in steps)
            m.window_compute += sum(s.compute_s for s in steps)
            m.epoch_samples += sum(s.samples for s in steps)
            m.epoch_compute += sum(s.compute_s for s in steps)
            m.epoch_wait += sum(s.wait_s for s in steps)
            m.epoch_steps += len(steps)
            m.compute_per_step = sum(s.compute_s for s in steps) / len(steps)
            m.wait_per_step = sum(s.wait_s for s in steps) / len(steps)
            m.slowdown = steps[-1].slowdown
            self._ep["loss_sum"] += sum(s.loss_sum for s in steps)
            if r.indices is not None and self.epoch in self._indices:
                self._indices[self.epoch].extend(r.indices[: sum(s.samples for s in steps)])
        for row in steps_by_index:
            self._recent_steps.append(row)
        self._ep["samples"] += sum(step_batches[:done])
        if done:
            frac = done / len(step_batches)
            self._ep["wall"] += wall * frac
            self._ep["worker_seconds"] += wall * frac * len(self.members)

    def _observe(self, m: Member, steps: list[StepTelemetry]) -> None:
        first = m.observed_steps == 0
        m.observed_steps += len(steps)
        if first:
            steps = steps[1:]  # a newcomer's first step still pays one-off costs
        obs = [(s.samples, s.compute_s) for s in steps if s.samples > 0]
        if not obs:
            return
        f = fit(m.stats)
        if f is not None and len(obs) >= 1:
            mean_b = sum(b for b, _ in obs) / len(obs)
            mean_t = sum(t for _, t in obs) / len(obs)
            pred = f.predict(mean_b)
            if pred > 0 and not (1 / SURPRISE <= mean_t / pred <= SURPRISE):
                # The worker changed speed: forget the old model.
                m.stats = StepTimeStats()
                m.window_samples, m.window_compute = 0, 0.0
        for b, t in obs:
            m.stats = m.stats.add(b, t, STATS_DECAY)

    def _maybe_rebalance(self) -> None:
        mode = self.spec.rebalance.mode
        if mode == "epoch":
            return
        if mode == "steps" and self.step_in_epoch % self.spec.rebalance.every_steps:
            return
        self._replan(self.step_in_epoch * self.spec.global_batch, why=f"{mode} check")

    def _end_epoch(self) -> None:
        ep = self._ep
        test_loss = acc = None
        if self.members:
            try:
                test_loss, acc = ray.get(
                    self.members[0].handle.evaluate.remote(
                        self._data["x_test"], self._data["y_test"]
                    ),
                    timeout=600,
                )
            except (RayError, GetTimeoutError) as err:
                self._log("WARNING", f"evaluation failed: {str(err).splitlines()[0]}")
        full = [m for m in self.members if m.epoch_steps == self._steps_per_epoch()] or [
            m for m in self.members if m.epoch_steps
        ]
        computes = [m.epoch_compute for m in full]
        balance = (
            (sum(computes) / len(computes)) / max(computes) if computes and max(computes) else 0.0
        )
        total_compute = sum(m.epoch_compute for m in self.members)
        util = total_compute / ep["worker_seconds"] if ep["worker_seconds"] else 0.0
        alloc = self.allocation
        record = EpochRecord(
            epoch=self.epoch,
            wall_s=ep["wall"],
            steps=self._steps_per_epoch(),
            dataset_size=self._data["n_train"],
            samples_trained=ep["samples"],
            retried_samples=ep["retried"],
            train_loss=ep["loss_sum"] / max(ep["samples"], 1),
            test_loss=test_loss,
            test_accuracy=acc,
            utilization=min(util, 1.0),
            compute_balance=balance,
            rebalances=ep["rebalances"],
            generation=self.generation,
            policy=self.spec.policy,
            emulated=self.spec.emulated,
            workers=[
                WorkerEpochStats(
                    worker=m.worker_id,
                    node=m.node,
                    batch=alloc.batches[alloc.index(m.worker_id)]
                    if alloc and m.worker_id in alloc.workers
                    else 0,
                    partition=m.epoch_samples,
                    steps=m.epoch_steps,
                    compute_s=m.epoch_compute,
                    wait_s=m.epoch_wait,
                    throughput=m.epoch_samples / m.epoch_compute if m.epoch_compute else 0.0,
                    slowdown=m.slowdown,
                )
                for m in self.members
            ],
        )
        with self._lock:
            self._history.append(record)
            self._log(
                "INFO",
                f"epoch {self.epoch}: {record.wall_s:.2f}s, loss "
                f"{record.train_loss:.4f}, acc {acc if acc is None else round(acc, 4)}, "
                f"balance {balance:.3f}, utilization {record.utilization:.3f}",
            )
            self.epoch += 1
            self.step_in_epoch = 0
            self._order = None
        if self.epoch % self.spec.checkpoint.every_epochs == 0 or self.epoch == self.spec.epochs:
            self._checkpoint(reason="epoch")
        if self.epoch >= self.spec.epochs:
            self._finish(JobState.SUCCEEDED, None)
        else:
            self._begin_epoch()

    # ---------------------------------------------------------------- membership
    _membership_dirty = False

    def _target_count(self, nodes: int, starting: bool = False) -> int:
        """How many workers to have: the requested number at the start, then also one per
        free eligible node (a node that joined) up to max_workers."""
        if self._target is None:
            return max(1, min(nodes, self._max))
        if starting:
            return max(1, min(self._target, self._max))
        return max(1, min(max(self._target, nodes), self._max))

    def _reconcile_membership(self) -> bool:
        """Apply joins, drains and losses at a step boundary. True when ready to train."""
        changed = self._membership_dirty
        # Graceful drains.
        for m in list(self.members):
            if m.worker_id in self._drain:
                self._drain.discard(m.worker_id)
                self._remove(m, "leave", "drained")
                changed = True
        # Newcomers whose actors are up.
        changed |= self._adopt_ready()
        now = time.monotonic()
        starting = not self.members and self.generation == 0 and self.state == JobState.PENDING
        if now - self._last_node_poll >= NODE_POLL_S or starting or changed:
            self._last_node_poll = now
            self._spawn_missing(starting)
        if starting:
            # First start: wait for the whole initial membership (or give up at the timeout).
            self._await_initial()
            changed = True
        if len(self.members) < self._min:
            return self._wait_for_min()
        self._below_min_since = None
        if changed or self.generation == 0:
            self._regroup()
            if self.allocation is not None and self._order is not None:
                self._replan(
                    self.step_in_epoch * self.spec.global_batch, why="membership", force=True
                )
        if self.state == JobState.PENDING:
            self._transition(JobState.RUNNING, None)
        return True

    def _spawn_missing(self, starting: bool) -> None:
        nodes = eligible_nodes(self.spec)
        if not nodes:
            if starting:
                self.reason = f"waiting for resources: {self._no_node_hint()}"
            return
        want = self._target_count(len(nodes), starting)
        have = len(self.members) + len(self._pending)
        if have >= want:
            return
        used = {m.node for m in self.members} | {p.member.node for p in self._pending}
        free = [n for n in nodes if n.node_id not in used]
        # One worker per node; share nodes only at the first start on a small cluster
        # (a laptop running every worker on one node).
        choices = free if (free or not starting) else []
        if starting and len(free) < want - have:
            choices = free + [nodes[i % len(nodes)] for i in range(want - have - len(free))]
        for node in choices[: want - have]:
            ordinal = self._next_ordinal
            self._next_ordinal += 1
            wid = f"w{ordinal}"
            handle = spawn_worker(self.spec, wid, ordinal, node.node_id, self._data)
            member = Member(wid, ordinal, node.node_id, handle, node.capacity)
            self._pending.append(_Pending(member, handle.info.remote(), time.monotonic()))
            self._log("INFO", f"starting worker {wid} on node {node.node_id[:12]}")

    def _no_node_hint(self) -> str:
        need = f"worker_cpus={self.spec.worker_cpus:g}, worker_gpus={self.spec.worker_gpus:g}"
        if self.spec.node_resource:
            need += f", node_resource={self.spec.node_resource!r}"
        return f"no alive node offers {need}"

    def _adopt_ready(self) -> bool:
        changed = False
        for p in list(self._pending):
            done, _ = ray.wait([p.ready], timeout=0)
            if not done:
                continue
            self._pending.remove(p)
            try:
                ray.get(p.ready)
            except RayError as err:
                self._log(
                    "WARNING",
                    f"worker {p.member.worker_id} failed to start: {str(err).splitlines()[0]}",
                )
                continue
            if len(self.members) >= self._max:
                self._kill(p.member)
                continue
            self.members.append(p.member)
            self._event("join", p.member, "node available")
            changed = True
        return changed

    def _await_initial(self) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        while self._pending and time.monotonic() < deadline and self._cancel is None:
            n_nodes = len(eligible_nodes(self.spec))
            self.reason = (
                f"waiting for resources: {len(self._pending)} of "
                f"{len(self._pending) + len(self.members)} workers not started yet "
                f"({n_nodes} eligible nodes; other jobs may hold their CPUs)"
            )
            ray.wait([p.ready for p in self._pending], num_returns=len(self._pending), timeout=0.5)
            self._adopt_ready()
            if not self._pending and len(self.members) < self._target_count(n_nodes, True):
                self._spawn_missing(starting=True)
        for p in self._pending:  # could not be placed in time
            self._log(
                "WARNING",
                f"worker {p.member.worker_id} could not start in "
                f"{self.spec.start_timeout_s:.0f}s",
            )
            self._kill(p.member)
        self._pending.clear()

    def _wait_for_min(self) -> bool:
        now = time.monotonic()
        if self._below_min_since is None:
            self._below_min_since = now
            self._log("WARNING", f"{len(self.members)} workers, below min_workers={self._min}")
        waited = now - self._below_min_since
        # Never started: the job may be queued behind others, so it waits longer.
        limit = self.spec.start_timeout_s if self.generation == 0 else \
            self.spec.worker_wait_timeout_s
        hint = "" if eligible_nodes(self.spec) else f": {self._no_node_hint()}"
        reason = (
            f"waiting for nodes: {len(self.members)} of min_workers={self._min} workers "
            f"({waited:.0f}s of {limit:.0f}s){hint}"
        )
        if waited >= limit:
            self._finish(
                JobState.FAILED,
                f"only {len(self.members)} workers available, below min_workers="
                f"{self._min}, after waiting {limit:.0f}s{hint}",
            )
            return False
        if self.state == JobState.RUNNING:
            self._transition(JobState.PENDING, reason)
        self.reason = reason
        self._spawn_missing(starting=False)
        time.sleep(0.2)
        return False

    def _regroup(self) -> None:
        t0 = time.perf_counter()
        self.generation += 1
        world = len(self.members)
        if self._resume_state is not None:
            ray.get(self.members[0].handle.load_state.remote(self._resume_state["weights"]))
            self._resume_state = None
        rv = ray.get(self.members[0].handle.open_store.remote(self.generation, world))
        refs = [m.handle.join.remote(rv, rank, 0) for rank, m in enumerate(self.members)]
        try:
            ray.get(refs, timeout=self.spec.collective_timeout_s + 30)
        except (RayError, GetTimeoutError) as err:
            # A member died while joining: drop the ones that did not answer and retry.
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for m, ref in zip(list(self.members), refs, strict=True):
                try:
                    if ref not in ready:
                        raise RayError("no answer")
                    ray.get(ref)
                except RayError:
                    self._remove(m, "failure", "failed while joining the group")
            self._log("WARNING", f"regroup failed ({str(err).splitlines()[0]}); retrying")
            if self.members:
                return self._regroup()
            return None
        dt = time.perf_counter() - t0
        self.regroup_seconds_total += dt
        self._membership_dirty = False
        self._log(
            "INFO",
            f"generation {self.generation}: {world} workers "
            f"{[m.worker_id for m in self.members]} (formed in {dt:.2f}s)",
        )
        return None

    def _remove(self, m: Member, kind: str, reason: str) -> None:
        with self._lock:
            if m in self.members:
                self.members.remove(m)
            self._event(kind, m, reason)
        self._kill(m)
        self._membership_dirty = True

    def _kill(self, m: Member) -> None:
        with contextlib.suppress(Exception):
            ray.kill(m.handle, no_restart=True)

    def _event(self, kind: str, m: Member, reason: str) -> None:
        self.events.append(
            MembershipEvent(
                time=time.time(),
                kind=kind,
                worker=m.worker_id,
                node=m.node,
                reason=reason,
                generation=self.generation,
            )
        )
        self._log(
            "INFO" if kind != "failure" else "WARNING", f"worker {m.worker_id} {kind}: {reason}"
        )

    # ---------------------------------------------------------------- lifecycle
    def _transition(self, new: JobState, reason: str | None) -> None:
        with self._lock:
            if not self.state.can_become(new):
                raise InvalidTransition(self.state, new)
            self.state = new
            self.reason = reason
            if new == JobState.RUNNING and self.started_at is None:
                self.started_at = time.time()
            self._log("INFO", f"state {new.value}" + (f": {reason}" if reason else ""))

    def _finish(self, state: JobState, reason: str | None) -> None:
        with self._lock:
            if self.state.is_terminal:
                return
            self._transition(state, reason)
            self.finished_at = time.time()
        self.shutdown()

    def _log(self, level: str, message: str) -> None:
        with self._lock:
            self._logs.append(
                LogLine(seq=self._log_seq, time=time.time(), level=level, message=message)
            )
            self._log_seq += 1
        log.log(logging.getLevelName(level), "[%s] %s", self.job_id, message)

    # ---------------------------------------------------------------- checkpoints
    def _checkpoint(self, reason: str) -> None:
        if not self.spec.checkpoint.dir or not self.members:
            return
        try:
            weights = ray.get(self.members[0].handle.state.remote(), timeout=120)
        except (RayError, GetTimeoutError) as err:
            self._log("WARNING", f"checkpoint skipped: {str(err).splitlines()[0]}")
            return
        alloc = self.allocation
        payload = {
            "job_id": self.job_id,
            "spec": self.spec.model_dump(mode="json"),
            "epoch": self.epoch,
            "step": self.step_in_epoch,
            "weights": weights,
            "plan": None
            if alloc is None
            else {
                "workers": alloc.workers,
                "batches": alloc.batches,
                "offset": self._plan_offset,
                "step0": self._plan_step0,
            },
            "rng": {"numpy_seed": [self.spec.seed, self.epoch]},
            "history": [r.model_dump(mode="json") for r in self._history],
            "counters": {
                "rebalances_total": self.rebalances_total,
                "retried_samples_total": self.retried_samples_total,
                "next_ordinal": self._next_ordinal,
            },
            "time": time.time(),
            "reason": reason,
        }
        path = save_checkpoint(self.spec.checkpoint.dir, self.job_id, payload)
        self._log(
            "INFO", f"checkpoint ({reason}) at epoch {self.epoch} step {self.step_in_epoch}: {path}"
        )

    def _restore(self, ckpt: dict[str, Any] | None) -> None:
        if not ckpt:
            return
        self.epoch = ckpt["epoch"]
        self.step_in_epoch = ckpt["step"]
        self._history = [EpochRecord.model_validate(r) for r in ckpt["history"]]
        c = ckpt["counters"]
        self.rebalances_total = c["rebalances_total"]
        self.retried_samples_total = c["retried_samples_total"]
        self._resume_state = {"weights": ckpt["weights"], "plan": ckpt["plan"]}
        self._log(
            "INFO", f"resuming from checkpoint at epoch {self.epoch} step {self.step_in_epoch}"
        )

"""The scheduler of one job: a thin driver of pure machines over a runtime.

The decisions live in pure machines (no ray, no torch, no clock), each in its module:

* :class:`~scheduler.protocols.sync.SyncProtocol`: where the epoch stands and which
  positions each worker trains next (synchronous DBS);
* the policy (``scheduler.policy``): batch sizes from telemetry;
* :class:`~scheduler.tracker.Tracker`: the per-worker telemetry the policy and reports use;
* :class:`~scheduler.ledger.Ledger`: which samples the workers *reported* trained; verified
  exactly once at every epoch's end;
* :class:`~scheduler.membership.Membership`: who is in, who holds the current state, what
  to spawn or evict;
* :mod:`scheduler.failures`: what a failed segment means, and when to stop retrying.

This class feeds them events and executes their decisions on a :class:`Runtime`: Ray
actors in production (``scheduler.ray_runtime``), in-process fakes with injected faults
in unit tests.

No bubbles. When the next segment trains under the same allocation (same epoch, no
re-plan due, nothing asked of the membership), it is sent to the workers before the
current one's results are read (a :class:`~scheduler.runtime.PipelinedRuntime` queues it
behind the one in flight), so workers go from segment to segment without waiting for the
coordinator. Only one segment is ahead at a time; it is committed like any other once the
one before it was. Membership changes, cancellation and checkpoints wait for the boundary
at which nothing is in flight; if the segment before it failed, the one ahead cannot have
trained (its workers left the group) and is collected and discarded.

``step()`` is one pass of the control loop; ``run()`` loops it until the job
is terminal. The other public methods may be called from other threads while it runs (the
actor is threaded): requests are queued and applied at the next step boundary.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from actors.contracts import StepTelemetry
from actors.spec import MAX_WORKERS, JobSpec
from scheduler.control import JobControl, JobEnded
from scheduler.failures import Failure, RetryBudget, WorkerOutcome, classify
from scheduler.ledger import Ledger
from scheduler.membership import Change, Membership
from scheduler.policy import make_policy
from scheduler.protocols.sync import Position, RebalanceRule, SyncProtocol
from scheduler.regime import Regime
from scheduler.runtime import (
    Clock,
    DataInfo,
    Runtime,
    WorkerCallError,
    pipelined,
)
from scheduler.state import JobState
from scheduler.telemetry import (
    EpochRecord,
    JobSnapshot,
    StepBreakdown,
    WorkerEpochStats,
    WorkerStatus,
)
from scheduler.tracker import Tracker

log = logging.getLogger("dynabatch.scheduler")

NODE_POLL_S = 1.0
EVAL_TIMEOUT_S = 600.0
STATE_TIMEOUT_S = 120.0


@dataclass
class _Ahead:
    """A segment sent before the previous one's results were read."""

    position: Position
    plans: dict[str, Any]
    ticket: Any
    sent: float


_PHASES = ("gather_s", "forward_s", "backward_s", "wait_s", "optimizer_s", "overlap_s",
           "micro_batches")


@dataclass
class _EpochTotals:
    started: float = 0.0
    wall: float = 0.0
    worker_seconds: float = 0.0
    loss_sum: float = 0.0
    loss_samples: int = 0
    rebalances: int = 0
    # Per committed step: the workers' mean phase times. ``busy``: per segment, the
    # longest time a worker spent in its steps (the rest of the epoch's wall time is the
    # scheduler's: dispatch, results, ledger, planning, regroups, evaluation).
    phases: dict[str, float] | None = None
    busy: float = 0.0
    steps: int = 0

    def add_step(self, reports: list[StepTelemetry]) -> None:
        if not reports:
            return
        if self.phases is None:
            self.phases = dict.fromkeys(_PHASES, 0.0)
        for k in _PHASES:
            self.phases[k] += sum(getattr(r, k) for r in reports) / len(reports)
        self.steps += 1

    def add_segment(self, results: list[Any], done: int) -> None:
        self.busy += max((sum(s.step_s for s in r.steps[:done]) for r in results), default=0.0)

    def breakdown(self, elapsed: float, evaluation: float) -> StepBreakdown | None:
        if not self.steps or self.phases is None:
            return None
        n = self.steps
        ph = {k: v / n for k, v in self.phases.items()}
        return StepBreakdown(
            gather_s=ph["gather_s"], forward_s=ph["forward_s"], backward_s=ph["backward_s"],
            allreduce_wait_s=ph["wait_s"], optimizer_s=ph["optimizer_s"],
            overlap_s=ph["overlap_s"], micro_batches=ph["micro_batches"],
            coordinator_s=max(0.0, elapsed - evaluation - self.busy) / n,
            evaluation_s=evaluation / n,
        )


class Coordinator(JobControl):
    def __init__(
        self,
        job_id: str,
        spec: JobSpec | dict,
        *,
        resume: bool = True,
        runtime: Runtime | None = None,
        clock: Clock | None = None,
    ):
        super().__init__(job_id, spec if isinstance(spec, JobSpec)
                         else JobSpec.model_validate(spec), clock)
        if runtime is None:
            from scheduler.ray_runtime import RayRuntime

            runtime = RayRuntime(self.spec)
        self.runtime = runtime
        self.reason = "starting workers"
        s = self.spec
        self.membership = Membership(
            workers=s.initial_workers, min_workers=s.min_workers, max_workers=s.max_workers,
            # The smallest batch the schedule trains bounds the group's size.
            global_batch=s.batch_range[0], max_batch=s.max_batch, max_possible=MAX_WORKERS,
        )
        self.regime = Regime(s)  # the global batch, LR, ISGD and goodput of every step
        self._restored_batch: int | None = None
        self.tracker = Tracker()
        self.ledger = Ledger()
        self.budget = RetryBudget(s.max_retries)
        policy_opts = {}
        if s.policy == "affine" and s.rebalance.mode == "adaptive":
            policy_opts["min_gain"] = s.rebalance.threshold
        self.policy = make_policy(s.policy, **policy_opts)
        self.protocol: SyncProtocol | None = None
        self.data: DataInfo | None = None
        self._position = Position(0, 0)  # where to start once the data is loaded
        # Benchmarks read per-step balance here; bounded (each row holds one report per worker).
        self._recent_steps: deque[list[StepTelemetry]] = deque(maxlen=512)
        self._ep: _EpochTotals | None = None
        self.rebalances_total = 0
        self.regroup_seconds_total = 0.0
        self.retried_samples_total = 0
        self._last_node_poll = -1e18
        self._below_min_since: float | None = None
        self._regroup_failures = 0
        self._resume_state: dict[str, Any] | None = None
        self._pipe = pipelined(self.runtime)
        self._ahead: _Ahead | None = None
        self._last_collect = -1e18
        self.segments_sent_ahead = 0
        if resume and s.checkpoint.dir:
            # Lazily: checkpoints need torch, and a simulated job (no checkpoints) does not.
            from scheduler.checkpoint import CheckpointError, load_checkpoint

            try:
                ckpt = load_checkpoint(s.checkpoint.dir, job_id)
            except CheckpointError as err:
                self._fail_now(str(err))
            else:
                if ckpt:
                    self._restore(ckpt, why="resuming")

    # ---------------------------------------------------------------- compatibility views
    @property
    def epoch(self) -> int:
        return self.protocol.epoch if self.protocol else self._position.epoch

    @property
    def step_in_epoch(self) -> int:
        return self.protocol.step if self.protocol else self._position.step

    @property
    def generation(self) -> int:
        return self.membership.generation

    @property
    def members(self):
        return list(self.membership.members)

    # ---------------------------------------------------------------- public interface
    def run(self) -> JobSnapshot:
        while self.step():
            pass
        return self.snapshot()

    def step(self) -> bool:
        """One control-loop step; False once the job is terminal."""
        try:
            return self._step()
        except JobEnded:
            return False
        except Exception as err:  # the job fails with the reason; the actor stays up
            log.exception("job %s failed", self.job_id)
            self._finish(JobState.FAILED, f"internal error: {type(err).__name__}: {err}")
            return False

    def snapshot(self) -> JobSnapshot:
        with self._lock:
            alloc = self.protocol.allocation if self.protocol else None
            batch_of = dict(zip(alloc.workers, alloc.batches, strict=True)) if alloc else {}
            workers = []
            for rank, m in enumerate(self.membership.members):
                t = self.tracker.workers.get(m.worker_id)
                batch = part = 0
                if m.worker_id in batch_of:
                    batch = batch_of[m.worker_id]
                    part = (t.epoch_samples if t else 0) + self.protocol.planned_remaining(
                        m.worker_id)
                workers.append(WorkerStatus(
                    worker=m.worker_id, node=m.node, rank=rank, batch=batch, partition=part,
                    throughput=(t.throughput or (batch / t.compute_per_step
                                                 if t.compute_per_step else 0.0)) if t else 0.0,
                    compute_s_per_step=t.compute_per_step if t else 0.0,
                    wait_s_per_step=t.wait_per_step if t else 0.0,
                    slowdown=t.slowdown if t else 1.0,
                ))
            last = self._history[-1] if self._history else None
            events = self._event_counts()
            p = self.protocol
            regime = self.regime.live(
                self.epoch, self.step_in_epoch,
                p.global_batch if p else self.regime.batch_for(self.epoch),
                p.steps_per_epoch if p else 1)
            return JobSnapshot(
                **regime, job_id=self.job_id, name=self.spec.name, state=self.state,
                reason=self.reason,
                epoch=self.epoch, step=self.step_in_epoch,
                steps_per_epoch=self.protocol.steps_per_epoch if self.protocol else 0,
                epochs=self.spec.epochs, generation=self.generation, policy=self.spec.policy,
                emulated=self.spec.emulated, workers=workers,
                train_loss=last.train_loss if last else None,
                test_accuracy=last.test_accuracy if last else None,
                utilization=last.utilization if last else None,
                compute_balance=last.compute_balance if last else None,
                rebalances_total=self.rebalances_total, epochs_completed=len(self._history),
                epoch_durations_s=[r.wall_s for r in self._history], worker_events=events,
                regroup_seconds_total=self.regroup_seconds_total,
                retried_samples_total=self.retried_samples_total,
                step_breakdown=last.breakdown if last else None,
                started_at=self.started_at, finished_at=self.finished_at,
            )

    def recent_steps(self) -> list[list[StepTelemetry]]:
        """Per-step telemetry of recent steps (benchmarks read per-step balance here)."""
        with self._lock:
            return list(self._recent_steps)

    def _member_ids(self) -> list[str]:
        return self.membership.worker_ids

    def shutdown(self) -> None:
        # Every spawned worker is a member or pending until it is killed.
        for w in list(self.membership.members) + list(self.membership.pending.values()):
            self.runtime.kill(w.worker_id)

    # ---------------------------------------------------------------- the loop
    def _step(self) -> bool:
        if self.state.is_terminal:
            return False
        if self._cancel is not None:
            if self._ahead is not None:
                # The checkpoint must hold what was trained, and an epoch it completed ends.
                self._drain_ahead(commit=True)
                if self.protocol.epoch_complete and self._ep is not None:
                    self._end_epoch()
                if self.state.is_terminal:
                    return False
            self._checkpoint(reason="cancel")
            self._finish(JobState.CANCELLED, self._cancel)
            return False
        if self.protocol is None:
            self._load_data()
        # With a segment in flight, membership changes wait for the next boundary.
        if self._ahead is None and not self._reconcile_membership():
            return not self.state.is_terminal
        p = self.protocol
        if p.epoch >= self.spec.epochs:
            self._maybe_succeed()
            return not self.state.is_terminal
        if self._ep is None:
            self._begin_epoch()
            self._replan("epoch start")
        ok = self._train_segment()
        if p.epoch_complete:
            self._end_epoch()
        elif ok and p.due_check():
            self._replan(f"{self.spec.rebalance.mode} check")
        return not self.state.is_terminal

    # ---------------------------------------------------------------- data and epochs
    def _load_data(self) -> None:
        from actors.workloads import WorkloadError

        t0 = self.clock.now()
        try:
            self.data = self.runtime.load_data()
        except WorkloadError as err:
            self._fail_now(str(err))
        d = self.data
        s = self.spec
        batch = self._restored_batch or self.regime.batch_for(self._position.epoch)
        self.protocol = SyncProtocol(
            global_batch=batch, dataset_size=d.n_train, seed=s.seed,
            rule=RebalanceRule(s.rebalance.mode, s.rebalance.every_steps,
                               s.rebalance.check_steps),
            position=self._position,
        )
        if self.ledger.epoch != self.protocol.epoch:
            self.ledger.begin_epoch(self.protocol.epoch, d.n_train)
        self._log("INFO", f"loaded {d.name}: {d.n_train} train, {d.n_test} test samples "
                          f"in {self.clock.now() - t0:.2f}s")

    def _begin_epoch(self) -> None:
        p = self.protocol
        if p.step == 0:
            batch = self.regime.batch_for(p.epoch)
            if batch != p.global_batch:
                self._log("INFO", f"epoch {p.epoch}: global batch {p.global_batch} -> {batch}")
                p.resize(batch)
        self._ep = _EpochTotals(started=self.clock.now())
        self.tracker.begin_epoch()
        if self.ledger.epoch != self.protocol.epoch:
            self.ledger.begin_epoch(self.protocol.epoch, self.protocol.dataset_size)

    def _replan(self, why: str) -> None:
        p = self.protocol
        workers = self.membership.worker_ids
        decision = p.replan(self.policy, self.tracker.telemetry(workers, self.spec.max_batch))
        self.tracker.decided()
        if decision is not None and decision.rebalanced:
            self.rebalances_total += 1
            self._ep.rebalances += 1
            a = decision.allocation
            self._log("INFO", f"rebalance ({why}): batches "
                              f"{dict(zip(a.workers, a.batches, strict=True))} — {decision.reason}")

    def _grace_s(self) -> float:
        return self.spec.collective_timeout_s + 5.0

    def _can_send_ahead(self, plans: dict[str, Any]) -> bool:
        if self._pipe is None or self._cancel is not None:
            return False
        m = self.membership
        with self._lock:
            requests = bool(self._requests)
        steps = len(next(iter(plans.values())).steps)
        return (not requests and not m.pending and not m.dirty
                and self.regime.can_stamp_ahead
                and self.protocol.next_boundary_keeps_plan(steps))

    def _drain_ahead(self, commit: bool) -> None:
        """Collect the segment in flight: commit it (``commit``), or discard it after a
        failure of the one before it."""
        ahead = self._ahead
        if ahead is None:
            return
        if commit and ahead.position == self.protocol.position:
            self._train_segment()
            return
        self._ahead = None
        outcomes = self._pipe.collect_segment(ahead.ticket, self._grace_s())
        trained = [o.worker for o in outcomes if o.result is not None and o.result.steps]
        if trained:  # cannot happen: the group broke at the failure before it
            self._log("ERROR", f"a segment sent ahead trained on {trained} after the one "
                               "before it failed; their state is not the committed one")
            for w in trained:
                self._remove(w, "failure", "trained past a failed segment")

    def _train_segment(self) -> bool:
        """Run one segment; commit what the state holder completed. True when it all ran."""
        p = self.protocol
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.position == p.position:
            plans, ticket, t0 = ahead.plans, ahead.ticket, ahead.sent
        else:
            if ahead is not None:  # defensive: a segment ahead always starts here
                self._ahead = ahead
                self._drain_ahead(commit=False)
            plans = self.regime.stamp(p.plan_segment(), p.steps_per_epoch)
            if not plans:
                return True
            t0 = self.clock.now()
            ticket = self._pipe.submit_segment(plans) if self._pipe else None
        start = p.position
        if ticket is not None and self._can_send_ahead(plans):
            steps = len(next(iter(plans.values())).steps)
            nxt = self.regime.stamp(p.plan_segment(at=p.step + steps), p.steps_per_epoch)
            self._ahead = _Ahead(Position(p.epoch, p.step + steps), nxt,
                                 self._pipe.submit_segment(nxt), self.clock.now())
            self.segments_sent_ahead += 1
        if ticket is None:
            outcomes = self.runtime.run_segment(plans, grace_s=self._grace_s())
        else:
            outcomes = self._pipe.collect_segment(ticket, self._grace_s())
        return self._commit_segment(plans, outcomes, start, t0)

    def _commit_segment(self, plans: dict, outcomes: list[WorkerOutcome], start: Position,
                        t0: float, charge: bool = True) -> bool:
        """Commit what the state holders completed of a segment; handle its failure. True
        when it all ran. ``charge``: count a failure against the retry budget (not for a
        segment sent ahead, whose failure is the one already counted)."""
        p = self.protocol
        # A segment sent ahead started on the workers when the one before it ended.
        now = self.clock.now()
        wall = now - max(t0, self._last_collect)
        self._last_collect = now
        failure = classify(outcomes, self.spec.collective_timeout_s)
        results = [o.result for o in outcomes if o.result is not None]
        for r in results:  # the workers' own output (user prints), into the job log
            for line in r.output:
                self._log("INFO", f"{r.worker} {line}")
        done = max((len(r.steps) for r in results), default=0)
        with self._lock:
            for j in range(done):
                reports = [r.steps[j] for r in results if len(r.steps) > j]
                self.ledger.commit(reports)
                self.regime.observe(reports)
                self._recent_steps.append(reports)
                self._ep.add_step(reports)
                for rep in reports:
                    self._ep.loss_sum += rep.loss_sum
                    self._ep.loss_samples += rep.samples
            self._ep.add_segment(results, done)
            for r in results:
                self.tracker.observe(r.worker, r.steps)
            planned = len(next(iter(plans.values())).steps)
            if done:
                frac = done / planned
                self._ep.wall += wall * frac
                self._ep.worker_seconds += wall * frac * len(plans)
            p.advance(done)
            self.membership.progressed(
                {r.worker: Position(start.epoch, start.step + len(r.steps)) for r in results}
            )
        if failure is None:
            self.budget.succeeded()
            return True
        # Lost and hung workers are removed (killed) first, so what they had queued ahead
        # answers at once instead of after another grace period.
        self._segment_failed(failure, outcomes, plans, charge, partial=done < planned)
        self._absorb_ahead()
        return False

    def _absorb_ahead(self) -> None:
        """After a failed segment, the one sent ahead. Usually it could not train: the
        failure broke the group and its workers refuse it. But a segment can "fail" after
        every collective of it completed, when a worker's result is lost with its node
        (a result too large to travel inline lives in that node's object store). Its peers
        then went on, in lockstep with it, into the segment ahead: what they completed
        there is committed like any segment (the all-reduced coverage proves it); the
        rest is discarded."""
        ahead = self._ahead
        if ahead is None:
            return
        if ahead.position != self.protocol.position:
            self._drain_ahead(commit=False)
            return
        self._ahead = None
        outcomes = self._pipe.collect_segment(ahead.ticket, self._grace_s())
        if any(o.result is not None and o.result.steps for o in outcomes):
            self._log("INFO", f"committing what the segment ahead trained after step "
                              f"{self.protocol.step} of epoch {self.protocol.epoch}")
            self._commit_segment(ahead.plans, outcomes, ahead.position, ahead.sent,
                                 charge=False)

    def _segment_failed(self, failure: Failure, outcomes: list[WorkerOutcome],
                        plans: dict, charge: bool = True, partial: bool = True) -> None:
        p = self.protocol
        # A step was in flight unless every survivor completed the whole segment (a lost
        # worker's result went with its node after the segment's collectives completed).
        if partial and not p.epoch_complete:
            in_flight = p.step_size(p.step)
            self.ledger.retry(in_flight)
            self.retried_samples_total += in_flight
        self._log("WARNING", f"step {p.step} of epoch {p.epoch} failed: {failure.summary}")
        for w, why in failure.lost.items():
            self._remove(w, "failure", why)
        for w, why in failure.stragglers.items():
            self._remove(w, "evict", f"straggler: {why}")
        # Whoever is left broke off the collective: the group must be formed again.
        self.membership.dirty = True
        verdict = self.budget.failed(p.position, failure) if charge else None
        if verdict is not None:
            self._fail_now(verdict)

    def _end_epoch(self) -> None:
        p = self.protocol
        v = self.ledger.verify()
        if not v.verified:
            self._fail_now(f"epoch {p.epoch}: exactly-once check of the workers' reports "
                           f"failed: {v.reason}")
        test_loss = acc = None
        t_eval = self.clock.now()
        scores: dict[str, float] = {}
        for holder in self.membership.holders():
            try:
                scores = dict(self.runtime.evaluate(holder.worker_id, EVAL_TIMEOUT_S) or {})
                test_loss, acc = scores.pop("loss", None), scores.get("accuracy")
                break
            except WorkerCallError as err:
                self._log("WARNING", f"evaluation failed: {err}")
                if err.lost:
                    self._remove(err.worker, "failure", "lost during evaluation")
        evaluation = self.clock.now() - t_eval
        ep = self._ep
        elapsed = self.clock.now() - ep.started
        tracks = {w: self.tracker.workers[w] for w in self.membership.worker_ids
                  if w in self.tracker.workers}
        full = [t for t in tracks.values() if t.epoch_steps == p.steps_per_epoch] or [
            t for t in tracks.values() if t.epoch_steps]
        computes = [t.epoch_compute for t in full]
        balance = (sum(computes) / len(computes)) / max(computes) if computes and max(
            computes) else 0.0
        util = (sum(t.epoch_compute for t in tracks.values()) / ep.worker_seconds
                if ep.worker_seconds else 0.0)
        alloc = p.allocation
        batch_of = dict(zip(alloc.workers, alloc.batches, strict=True)) if alloc else {}
        node_of = {m.worker_id: m.node for m in self.membership.members}
        regime = self.regime.end_epoch(p.epoch, p.global_batch, p.steps_per_epoch, ep.wall)
        record = EpochRecord(**regime,
            epoch=p.epoch, wall_s=ep.wall, steps=p.steps_per_epoch, dataset_size=v.dataset_size,
            samples_trained=v.samples_trained, retried_samples=v.retried_samples,
            verified=v.verified, train_loss=ep.loss_sum / max(ep.loss_samples, 1),
            test_loss=test_loss, test_accuracy=acc, test_metrics=scores, utilization=min(util, 1.0),
            compute_balance=balance, rebalances=ep.rebalances, generation=self.generation,
            policy=self.spec.policy, emulated=self.spec.emulated,
            elapsed_s=elapsed, evaluation_s=evaluation,
            breakdown=ep.breakdown(elapsed, evaluation),
            workers=[
                WorkerEpochStats(
                    worker=w, node=node_of[w], batch=batch_of.get(w, 0),
                    partition=v.samples_by_worker.get(w, 0), steps=t.epoch_steps,
                    compute_s=t.epoch_compute, wait_s=t.epoch_wait,
                    throughput=t.epoch_samples / t.epoch_compute if t.epoch_compute else 0.0,
                    slowdown=t.slowdown,
                )
                for w, t in tracks.items()
            ],
        )
        with self._lock:
            self._history.append(record)
            shown = acc if acc is None else round(acc, 4)
            self._log("INFO", f"epoch {p.epoch}: {record.wall_s:.2f}s, loss "
                              f"{record.train_loss:.4f}, acc {shown}, balance {balance:.3f}, "
                              f"utilization {record.utilization:.3f}, "
                              f"{v.samples_trained} samples verified exactly once")
            p.next_epoch()
            self._ep = None
        if p.epoch % self.spec.checkpoint.every_epochs == 0 or p.epoch == self.spec.epochs:
            self._checkpoint(reason="epoch")
        self._maybe_succeed()

    def _maybe_succeed(self) -> None:
        """Done once every epoch is trained and a member still holds the final state; if
        the last holder was lost (in the final evaluation or checkpoint), the next step's
        regroup restores the last checkpoint and trains on, or fails with the reason."""
        if self.protocol.epoch >= self.spec.epochs and self.membership.holders():
            self._finish(JobState.SUCCEEDED, None)

    # ---------------------------------------------------------------- membership
    def _apply_requests(self) -> bool:
        changed = False
        for kind, arg in self._take_requests():
            try:
                if kind == "scale":
                    self.membership.request_scale(arg)
                else:
                    self.membership.request_drain(arg)
            except (KeyError, ValueError) as err:
                self._log("WARNING", f"{kind} {arg} not applied: {err}")
        for change in self.membership.apply_drains():
            self._changed(change)
            self.runtime.kill(change.worker)
            changed = True
        return changed

    def _reconcile_membership(self) -> bool:
        """Apply requests, joins and losses at a step boundary. True when ready to train."""
        m = self.membership
        self._apply_requests()
        self._adopt_started(0.0)
        starting = not m.members and m.generation == 0 and self.state == JobState.PENDING
        now = self.clock.now()
        if now - self._last_node_poll >= NODE_POLL_S or starting or m.dirty:
            self._last_node_poll = now
            self._spawn_missing(starting)
        if starting:
            self._await_initial()
        shortfall = m.shortfall()
        if shortfall is not None:
            return self._wait_for_min(shortfall)
        self._below_min_since = None
        if m.dirty and not self._regroup():
            return False
        if self.state == JobState.PENDING:
            self._transition(JobState.RUNNING, None)
        return True

    def _spawn_missing(self, starting: bool) -> None:
        nodes = self.runtime.nodes()
        if not nodes and starting:
            self.reason = f"waiting for resources: {self._no_node_hint()}"
        for s in self.membership.spawns(nodes, starting, self.spec.gpus_on):
            self.tracker.add(s.worker_id, s.capacity)
            self.runtime.spawn(s)
            self._log("INFO", f"starting worker {s.worker_id} on node {s.node_id[:12]}"
                              + (" (GPU)" if s.gpus else ""))

    def _adopt_started(self, timeout_s: float) -> None:
        for st in self.runtime.poll_started(timeout_s):
            if st.error is not None:
                self.membership.start_failed(st.worker)
                self.tracker.remove(st.worker)
                self._log("WARNING", f"worker {st.worker} failed to start: {st.error}")
                continue
            change = self.membership.started(st.worker)
            if change is None:
                self.tracker.remove(st.worker)
                self.runtime.kill(st.worker)
            else:
                self._changed(change)

    def _await_initial(self) -> None:
        m = self.membership
        deadline = self.clock.now() + self.spec.start_timeout_s
        while m.pending and self.clock.now() < deadline and self._cancel is None:
            self.reason = (
                f"waiting for resources: {len(m.pending)} of {len(m.pending) + len(m.members)}"
                f" workers not started yet ({len(self.runtime.nodes())} eligible nodes; other "
                "jobs may hold their CPUs)"
            )
            self._adopt_started(0.5)
            if not m.pending:
                self._spawn_missing(starting=True)
        for w in list(m.pending):  # could not be placed in time
            self._log("WARNING", f"worker {w} could not start in "
                                 f"{self.spec.start_timeout_s:.0f}s")
            m.start_failed(w)
            self.tracker.remove(w)
            self.runtime.kill(w)

    def _wait_for_min(self, shortfall: str) -> bool:
        now = self.clock.now()
        if self._below_min_since is None:
            self._below_min_since = now
            self._log("WARNING", f"cannot train: {shortfall}")
        waited = now - self._below_min_since
        # Never started: the job may be queued behind others, so it waits longer.
        limit = (self.spec.start_timeout_s if self.generation == 0
                 else self.spec.worker_wait_timeout_s)
        hint = "" if self.runtime.nodes() else f": {self._no_node_hint()}"
        if waited >= limit:
            self._fail_now(f"only {shortfall} available after waiting {limit:.0f}s{hint}")
        reason = f"waiting for nodes: {shortfall} ({waited:.0f}s of {limit:.0f}s){hint}"
        if self.state == JobState.RUNNING:
            self._transition(JobState.PENDING, reason)
        self.reason = reason
        self._spawn_missing(starting=False)
        self.clock.sleep(0.2)
        return False

    def _no_node_hint(self) -> str:
        g = self.spec.worker_gpus
        gpus = g if g == "auto" else f"{g:g}"
        need = f"worker_cpus={self.spec.worker_cpus:g}, worker_gpus={gpus}"
        if self.spec.node_resource:
            need += f", node_resource={self.spec.node_resource!r}"
        return f"no alive node offers {need}"

    def _regroup(self) -> bool:
        """Form a new generation. False when it failed (the next step tries again)."""
        m = self.membership
        plan = m.regroup_plan()
        state = None
        if plan.needs_state:
            if self._resume_state is None:
                self._rollback()  # sets _resume_state, or ends the job
                plan = m.regroup_plan()
            state = self._resume_state
        t0 = self.clock.now()
        result = self.runtime.regroup(m.generation + 1, plan.members, state,
                                      self.spec.collective_timeout_s + 30)
        if not result.ok:
            for w, why in result.lost.items():
                self._remove(w, "failure", why)
            why = "; ".join([*result.lost.values(), *([result.error] if result.error else [])])
            self._log("WARNING", f"regroup failed ({why}); retrying")
            self._regroup_failures += 1
            if not result.lost and self._regroup_failures > self.spec.max_retries + 1:
                self._fail_now(f"the group could not be formed {self._regroup_failures} times "
                               f"in a row: {why}")
            return False
        self._regroup_failures = 0
        m.regrouped(plan.members)
        self._resume_state = None  # only now: a failed join must be able to load it again
        dt = self.clock.now() - t0
        self.regroup_seconds_total += dt
        self._log("INFO", f"generation {m.generation}: {len(plan.members)} workers "
                          f"{list(plan.members)} (formed in {dt:.2f}s)")
        # Mid-epoch: re-split what is left over the new group (an epoch that has not begun
        # re-plans when it begins).
        if self._ep is not None and not self.protocol.epoch_complete:
            self._replan("membership")
        return True

    def _remove(self, worker: str, kind: str, reason: str) -> None:
        with self._lock:
            change = self.membership.remove(worker, kind, reason)
        self.tracker.remove(worker)
        self.runtime.kill(worker)
        if change is not None:
            self._changed(change)

    def _changed(self, c: Change) -> None:
        self._event(c.kind, c.worker, c.node, c.reason, self.generation)

    # ---------------------------------------------------------------- checkpoints
    def _checkpoint(self, reason: str) -> None:
        if not self.spec.checkpoint.dir:
            return
        weights = self._resume_state  # restored but not yet loaded into a group
        for holder in [] if weights is not None else self.membership.holders():
            try:
                weights = self.runtime.fetch_state(holder.worker_id, STATE_TIMEOUT_S)
                break
            except WorkerCallError as err:
                self._log("WARNING", f"checkpoint: {err}")
                if err.lost:
                    self._remove(err.worker, "failure", "lost during a checkpoint")
        if weights is None:
            self._log("WARNING", f"checkpoint ({reason}) skipped: no worker holds the state")
            return
        pos = self.protocol.position if self.protocol else self._position
        payload = {
            "job_id": self.job_id,
            "spec": self.spec.model_dump(mode="json"),
            "epoch": pos.epoch,
            "step": pos.step,
            "weights": weights,
            "ledger": self.ledger.to_state(),
            # The schedule's position: the batch trained there and the regime's state (ISGD
            # chart, noise estimate, goodput's batch); the LR follows from them.
            "schedule": {"epoch": pos.epoch, "step": pos.step,
                         "global_batch": (self.protocol.global_batch if self.protocol
                                          else self._restored_batch
                                          or self.regime.batch_for(pos.epoch)),
                         "regime": self.regime.to_state()},
            "history": [r.model_dump(mode="json") for r in self._history],
            "counters": {
                "rebalances_total": self.rebalances_total,
                "retried_samples_total": self.retried_samples_total,
                "next_ordinal": self.membership.next_ordinal,
            },
            "time": self.clock.time(),
            "reason": reason,
        }
        from scheduler.checkpoint import save_checkpoint

        path = save_checkpoint(self.spec.checkpoint.dir, self.job_id, payload)
        self._log("INFO", f"checkpoint ({reason}) at epoch {pos.epoch} step {pos.step}: {path}")

    def _restore(self, ckpt: dict[str, Any], why: str) -> None:
        pos = Position(ckpt["epoch"], ckpt["step"])
        with self._lock:
            self._position = pos
            self._history = [EpochRecord.model_validate(r) for r in ckpt["history"]]
            c = ckpt["counters"]
            self.rebalances_total = c["rebalances_total"]
            self.retried_samples_total = c["retried_samples_total"]
            m = self.membership
            m.next_ordinal = max(m.next_ordinal, c.get("next_ordinal", 0))
            m.restored(pos)
            self.ledger = Ledger.from_state(ckpt.get("ledger") or {})
            self._resume_state = ckpt["weights"]
            sched = ckpt.get("schedule") or {}
            self.regime.load_state(sched.get("regime") or {})
            self._restored_batch = sched.get("global_batch")
            if self.protocol is not None:
                self.protocol.rewind(pos, self._restored_batch
                                     or self.regime.batch_for(pos.epoch))
                self._ep = None
        self._log("INFO" if why == "resuming" else "WARNING",
                  f"{why} from checkpoint at epoch {pos.epoch} step {pos.step}")

    def _rollback(self) -> None:
        """No member holds the committed state: load the last checkpoint, or fail."""
        lost = ("every worker holding the current model state was lost "
                f"(committed at epoch {self.membership.committed.epoch} "
                f"step {self.membership.committed.step})")
        ckpt = None
        if self.spec.checkpoint.dir:
            from scheduler.checkpoint import CheckpointError, load_checkpoint

            try:
                ckpt = load_checkpoint(self.spec.checkpoint.dir, self.job_id)
            except CheckpointError as err:
                self._fail_now(f"{lost}, and the checkpoint cannot be loaded: {err}")
        if not ckpt:
            self._fail_now(f"{lost}, and there is no checkpoint to restore (set checkpoint.dir)"
                           "; not continuing from freshly initialised weights")
        self._restore(ckpt, why=f"{lost}; rolling back")

"""The scheduler of one job: a thin driver of pure machines over a runtime.

The decisions live in pure machines (no ray, no torch, no clock), each in its module:

* :class:`~dynabatch.scheduler.core.sync.protocol.SyncProtocol`: where the epoch stands and which
  positions each worker trains next (synchronous DBS);
* the policy (``dynabatch.scheduler.core.sync.policy``): batch sizes from telemetry;
* :class:`~dynabatch.scheduler.core.sync.tracker.Tracker`: the per-worker telemetry the policy and
reports use;
* :class:`~dynabatch.scheduler.core.ledger.Ledger`: which samples the workers *reported* trained;
verified
  exactly once at every epoch's end;
* :class:`~dynabatch.scheduler.core.membership.Membership`: who is in, who holds the current state,
what
  to spawn or evict;
* :mod:`dynabatch.scheduler.core.failures`: what a failed segment means, and when to stop retrying.

This class feeds them events and executes their decisions on a :class:`Runtime`: Ray
actors in production (``dynabatch.scheduler.runtime.ray_runtime``), in-process fakes with injected
faults
in unit tests.

No bubbles. One segment is always in flight: the next segment is sent to the workers
before the current one's results are read (a
:class:`~dynabatch.scheduler.runtime.seam.PipelinedRuntime`
queues it behind the one running), so workers go from segment to segment without waiting
for the coordinator. A re-plan does not stop it: the segment ahead keeps the allocation it
was planned under, and the new plan, decided from the telemetry on hand, takes effect at
the step after it (``SyncProtocol.replan(at=)``). Across an epoch's end (same global batch,
no checkpoint due) the epoch's evaluation is queued first, then the next epoch's first
segment: each holder scores its shard of the final weights and trains on
(``dynabatch.scheduler.sync.evaluation``); the record is published when the shards are in. What
needs
the group at rest waits for a boundary with nothing in flight: a worker that started and
joins, a scale or drain request, a checkpoint, cancellation, and the retry after a
failure. If the segment before it failed, the one ahead cannot have trained (its workers
left the group) and is collected and discarded.

``step()`` is one pass of the control loop; ``run()`` loops it until the job
is terminal. The other public methods may be called from other threads while it runs (the
actor is threaded): requests are queued and applied at the next step boundary.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from dynabatch.actors.contracts import StepTelemetry
from dynabatch.actors.spec import MAX_WORKERS, JobSpec
from dynabatch.scheduler.control import JobControl, JobEnded
from dynabatch.scheduler.core.failures import Failure, RetryBudget, WorkerOutcome, classify
from dynabatch.scheduler.core.ledger import Ledger
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.membership import Change, Membership
from dynabatch.scheduler.core.regime.regime import Regime
from dynabatch.scheduler.core.sync.policy import make_policy
from dynabatch.scheduler.core.sync.protocol import Position, RebalanceRule, SyncProtocol
from dynabatch.scheduler.core.sync.tracker import Tracker
from dynabatch.scheduler.runtime.seam import (
    Clock,
    DataInfo,
    Runtime,
    WorkerCallError,
    pipelined,
    sharded_evaluation,
    spare_capable,
)
from dynabatch.scheduler.sync.epoch_report import EpochTotals, build_record, summary, with_scores
from dynabatch.scheduler.sync.evaluation import EvalRound, Evaluations, split
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, WorkerStatus

log = logging.getLogger("dynabatch.scheduler")

# How often nodes are listed (every step boundary at most, and between segments sent
# ahead): a node that joins gets its worker or spare this soon. Listing costs two GCS
# calls of about a millisecond.
NODE_POLL_S = 0.2
# After adopting a spare at a boundary with nothing in flight, how long to wait for it to
# answer so that it joins this regroup rather than one segment later.
ADOPT_WAIT_S = 0.5
EVAL_TIMEOUT_S = 600.0
STATE_TIMEOUT_S = 120.0


@dataclass
class _Ahead:
    """A segment sent before the previous one's results were read."""

    position: Position
    plans: dict[str, Any]
    ticket: Any
    sent: float
    behind: EvalRound | None = None  # an evaluation queued on its workers just before it


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
            from dynabatch.scheduler.runtime.ray_runtime import RayRuntime

            # The workers' and this driver's own output, into the job log (dynabatch.actors.output).
            runtime = RayRuntime(self.spec, output=self._follow_actor_output())
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
        self._ep: EpochTotals | None = None
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
        self._retrying = False  # the last segment failed: its retry goes alone
        # Evaluations run on the holders between segments, collected as they arrive.
        sharded = sharded_evaluation(self.runtime, EVAL_TIMEOUT_S)
        self._evals = Evaluations(sharded, self.clock, EVAL_TIMEOUT_S)
        # An evaluation can be queued behind a segment in flight only by a runtime that
        # queues it (an adapted one scores at once).
        self._evals_queue = sharded is self.runtime
        self._next_behind: EvalRound | None = None  # queued before the next segment sent
        if resume and s.checkpoint.dir:
            # Lazily: checkpoints need torch, and a simulated job (no checkpoints) does not.
            from dynabatch.scheduler.checkpoint import CheckpointError, load_checkpoint

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
        # Every spawned worker is a member or pending until it is killed; spares too.
        for w in list(self.membership.members) + list(self.membership.pending.values()):
            self.runtime.kill(w.worker_id)
        spares = spare_capable(self.runtime)
        for node in self.membership.drop_spares():
            if spares is not None:
                spares.stop_spare(node)

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
            self._settle_evaluations()
            self._checkpoint(reason="cancel")
            self._finish(JobState.CANCELLED, self._cancel)
            return False
        if self.protocol is None:
            self._load_data()
        # With a segment in flight, membership changes wait for the next boundary.
        if self._ahead is not None:
            self._watch_membership()
        elif not self._reconcile_membership():
            return not self.state.is_terminal
        p = self.protocol
        if p.epoch >= self.spec.epochs:
            self._maybe_succeed()
            return not self.state.is_terminal
        if self._ep is None:
            self._begin_epoch()
            self._replan("epoch start", at=self._ahead_end())
        ok = self._train_segment()
        if p.epoch_complete:
            self._end_epoch()
        elif ok and p.due_check():
            self._replan(f"{self.spec.rebalance.mode} check", at=self._ahead_end())
        self._publish_ready()
        return not self.state.is_terminal

    def _watch_membership(self) -> None:
        """With a segment in flight: notice workers that came up (one that joins stops the
        sending ahead, so the next boundary has nothing in flight and regroups), and start
        workers on nodes that appeared. A worker still starting blocks nothing."""
        self._adopt_started(0.0)
        self._poll_nodes()

    # ---------------------------------------------------------------- data and epochs
    def _load_data(self) -> None:
        from dynabatch.actors.workloads import WorkloadError

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
        self._ep = EpochTotals(started=self.clock.now())
        self.tracker.begin_epoch()
        if self.ledger.epoch != self.protocol.epoch:
            self.ledger.begin_epoch(self.protocol.epoch, self.protocol.dataset_size)

    def _replan(self, why: str, at: int | None = None) -> None:
        """Re-plan the rest of the epoch from step ``at`` (default: now; a later step when
        a segment is in flight: it keeps the allocation it was sent with)."""
        p = self.protocol
        if at is not None and self.membership.dirty:
            return  # a worker joined or was lost: the boundary's regroup re-plans
        workers = self.membership.worker_ids
        decision = p.replan(self.policy, self.tracker.telemetry(workers, self.spec.max_batch),
                            at=at)
        if decision is None:
            return
        self.tracker.decided()
        if decision.rebalanced:
            self.rebalances_total += 1
            self._ep.rebalances += 1
            a = decision.allocation
            where = f" from step {at}" if at is not None and at != p.step else ""
            self._log("INFO", f"rebalance ({why}): batches "
                              f"{dict(zip(a.workers, a.batches, strict=True))}{where} — "
                              f"{decision.reason}")

    def _grace_s(self) -> float:
        return self.spec.collective_timeout_s + 5.0

    # ---------------------------------------------------------------- segments
    def _ahead_end(self) -> int | None:
        """The step after the segment in flight, when it lies in this epoch."""
        a = self._ahead
        if a is None or a.position.epoch != self.protocol.epoch:
            return None
        return a.position.step + len(next(iter(a.plans.values())).steps)

    def _can_send_ahead(self) -> bool:
        if self._pipe is None or self._cancel is not None or self._retrying:
            return False
        with self._lock:
            requests = bool(self._requests)
        return not requests and not self.membership.dirty and self.regime.can_stamp_ahead

    def _can_cross_epoch(self) -> bool:
        """Whether the next epoch's first segment can be planned before this one ends: it
        trains at the same global batch, under the allocation carried over, and no
        checkpoint (which reads the state with nothing in flight) is due in between.
        Goodput mode decides the next batch and its LR gain from the epoch's end."""
        p = self.protocol
        nxt = p.epoch + 1
        return (nxt < self.spec.epochs and self._evals_queue and self.regime.mode != "goodput"
                and self.regime.batch_for(nxt) == p.global_batch
                and not self._checkpoint_due(nxt))

    def _send_ahead(self, start: Position, plans: dict[str, Any]) -> None:
        """Send the segment after the one at ``start`` (already sent) before its results
        are read: in this epoch, or the next epoch's first, behind the epoch's evaluation."""
        if not self._can_send_ahead():
            return
        p = self.protocol
        end = start.step + len(next(iter(plans.values())).steps)
        behind = None
        if end < p.steps_per_epoch:
            pos = Position(p.epoch, end)
        elif self._can_cross_epoch():
            pos = Position(p.epoch + 1, 0)
            # Each of the segment's workers scores its shard of the epoch's final weights,
            # then trains on. Dropped if that segment fails (it is not the final state).
            behind = self._submit_evaluation(p.epoch, list(plans))
        else:
            return
        nxt = self.regime.stamp(p.plan_segment(at=pos), p.steps_per_epoch)
        self._ahead = _Ahead(pos, nxt, self._pipe.submit_segment(nxt), self.clock.now(),
                             behind)
        self.segments_sent_ahead += 1

    def _drain_ahead(self, commit: bool) -> None:
        """Collect the segment in flight: commit it (``commit``), or discard it after a
        failure of the one before it."""
        ahead = self._ahead
        if ahead is None:
            return
        if commit and ahead.position == self.protocol.position:
            if self._ep is None:  # sent ahead across the epoch's end, which has ended
                self._begin_epoch()
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
            plans, ticket, t0, behind = ahead.plans, ahead.ticket, ahead.sent, ahead.behind
        else:
            if ahead is not None:  # defensive: a segment ahead always starts here
                self._ahead = ahead
                self._drain_ahead(commit=False)
            plans = self.regime.stamp(p.plan_segment(), p.steps_per_epoch)
            if not plans:
                return True
            t0 = self.clock.now()
            behind, self._next_behind = self._next_behind, None
            ticket = self._pipe.submit_segment(plans) if self._pipe else None
        start = p.position
        if ticket is not None:
            self._send_ahead(start, plans)
        if ticket is None:
            outcomes = self.runtime.run_segment(plans, grace_s=self._grace_s())
        else:
            outcomes = self._pipe.collect_segment(ticket, self._grace_s())
        return self._commit_segment(plans, outcomes, start, t0, behind=behind)

    def _commit_segment(self, plans: dict, outcomes: list[WorkerOutcome], start: Position,
                        t0: float, charge: bool = True, behind: EvalRound | None = None
                        ) -> bool:
        """Commit what the state holders completed of a segment; handle its failure. True
        when it all ran. ``charge``: count a failure against the retry budget (not for a
        segment sent ahead, whose failure is the one already counted). ``behind``: an
        evaluation its workers ran just before it (its time is not the segment's)."""
        p = self.protocol
        # A segment sent ahead started on the workers when the one before it ended.
        now = self.clock.now()
        wall = now - max(t0, self._last_collect)
        self._last_collect = now
        evaluation = 0.0
        if behind is not None:
            self._evals.poll()  # its shards ran first, so they are in
            if behind.done:
                evaluation = min(wall, behind.critical_s)
                wall -= evaluation
        failure = classify(outcomes, self.spec.collective_timeout_s)
        results = [o.result for o in outcomes if o.result is not None]
        done = max((len(r.steps) for r in results), default=0)
        with self._lock:
            self._ep.evaluation += evaluation
            for j in range(done):
                reports = [r.steps[j] for r in results if len(r.steps) > j]
                self.ledger.commit(reports)
                self.regime.observe(reports)
                self._recent_steps.append(reports)
                self._ep.add_step(reports)
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
            self._retrying = False
            return True
        # Lost and hung workers are removed (killed) first, so what they had queued ahead
        # answers at once instead of after another grace period.
        self._segment_failed(failure, outcomes, plans, charge, partial=done < planned)
        if not p.epoch_complete:
            # An evaluation sent ahead of this epoch's end scored weights that are not the
            # epoch's final ones: the epoch is evaluated when it does end.
            self._evals.discard(p.epoch)
        self._absorb_ahead()
        return False

    def _absorb_ahead(self) -> None:
        """After a failed segment, the one sent ahead. Usually it could not train: the
        failure broke the group and its workers refuse it. But a segment can "fail" after
        every collective of it completed, when a worker's result is lost with its node
        (a result too large to travel inline lives in that node's object store). Its peers
        then went on, in lockstep with it, into the segment ahead: what they completed
        there is committed like any segment (the all-reduced coverage proves it); the
        rest is discarded. A segment ahead in the next epoch opens it once this one ends."""
        ahead = self._ahead
        if ahead is None:
            return
        p = self.protocol
        if p.epoch_complete and ahead.position == Position(p.epoch + 1, 0):
            self._end_epoch()
            self._begin_epoch()
        if ahead.position != p.position:
            self._drain_ahead(commit=False)
            return
        self._ahead = None
        outcomes = self._pipe.collect_segment(ahead.ticket, self._grace_s())
        if any(o.result is not None and o.result.steps for o in outcomes):
            self._log("INFO", f"committing what the segment ahead trained after step "
                              f"{p.step} of epoch {p.epoch}")
            self._commit_segment(ahead.plans, outcomes, ahead.position, ahead.sent,
                                 charge=False, behind=ahead.behind)

    def _segment_failed(self, failure: Failure, outcomes: list[WorkerOutcome],
                        plans: dict, charge: bool = True, partial: bool = True) -> None:
        p = self.protocol
        self._retrying = True
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

    # ---------------------------------------------------------------- epoch ends
    def _end_epoch(self) -> None:
        """Close the epoch: verify it, build its record, checkpoint when due, and have the
        holders evaluate it (unless that was sent ahead). The record is published when the
        evaluation is in (:meth:`_publish`)."""
        p = self.protocol
        v = self.ledger.verify()
        if not v.verified:
            self._fail_now(f"epoch {p.epoch}: exactly-once check of the workers' reports "
                           f"failed: {v.reason}")
        ep = self._ep
        alloc = p.allocation
        planned = set(alloc.workers) if alloc else set()
        tracks = {w: t for w in self.membership.worker_ids
                  if (t := self.tracker.workers.get(w)) is not None
                  and (t.epoch_steps or w in planned)}
        record = build_record(
            epoch=p.epoch, steps=p.steps_per_epoch, verification=v, totals=ep,
            elapsed=self.clock.now() - ep.started, tracks=tracks,
            nodes={m.worker_id: m.node for m in self.membership.members}, allocation=alloc,
            regime=self.regime.end_epoch(p.epoch, p.global_batch, p.steps_per_epoch, ep.wall),
            policy=self.spec.policy, emulated=self.spec.emulated, generation=self.generation)
        rnd = self._evals.unattached(p.epoch)
        if rnd is None:
            rnd = self._submit_evaluation(p.epoch,
                                          [m.worker_id for m in self.membership.holders()])
            self._next_behind = rnd
        rnd.record, rnd.extra = record, ep
        nxt = Position(p.epoch + 1, 0)
        if self._checkpoint_due(nxt.epoch):
            # The checkpoint holds the epoch's record, scores included: wait for them (the
            # slowest holder's shard), then read the state, with nothing in flight; the
            # job shows the next epoch once it is written.
            self._settle_evaluations()
            self._checkpoint(reason="epoch", position=nxt)
        with self._lock:
            p.next_epoch()
            self._ep = None
        self._publish_ready()
        self._maybe_succeed()

    def _checkpoint_due(self, epoch: int) -> bool:
        """Whether a checkpoint is taken when ``epoch`` begins (the one before it ended)."""
        every = self.spec.checkpoint.every_epochs
        return bool(self.spec.checkpoint.dir) and (epoch % every == 0
                                                   or epoch == self.spec.epochs)

    def _submit_evaluation(self, epoch: int, workers: list[str]) -> EvalRound:
        """Split the held-out set over ``workers`` in proportion to their measured
        throughput this epoch, and queue each its shard."""
        weights = {}
        for w in workers:
            t = self.tracker.workers.get(w)
            weights[w] = (t.epoch_samples / t.epoch_compute if t and t.epoch_compute
                          else (t.throughput if t else 0.0))
        return self._evals.submit(epoch, split(self.data.n_test if self.data else 0, weights))

    def _publish_ready(self) -> None:
        self._evals.poll()
        for rnd in self._evals.ready():
            self._publish(rnd)

    def _settle_evaluations(self) -> None:
        """Wait for the evaluations in flight (each up to its deadline) and publish them."""
        while self._evals.busy:
            ready = self._evals.settle()
            if not ready:
                break
            for rnd in ready:
                self._publish(rnd)

    def _publish(self, rnd: EvalRound) -> None:
        """An epoch's evaluation is in: its record joins the history, with the scores when
        every shard was scored."""
        for w, r in rnd.failures.items():
            self._log("WARNING", f"evaluation of epoch {rnd.epoch} on {w} failed: {r.error}")
            if r.lost:
                self._remove(w, "failure", "lost during evaluation")
        sums = rnd.sums()
        holders = [m.worker_id for m in self.membership.holders()]
        if sums is None and rnd.failures and rnd is self._next_behind and holders:
            # Nothing was sent behind it: the holders left still have the epoch's weights
            # and score the set again (at the job's end, say), so no scores are lost.
            self._log("INFO", f"epoch {rnd.epoch}: evaluating again on {holders}")
            again = self._submit_evaluation(rnd.epoch, holders)
            again.record, again.extra = rnd.record, rnd.extra
            again.waited_s = rnd.critical_s
            self._next_behind = again
            return
        scores = self._evals.runtime.finish_evaluation(sums) if sums is not None else None
        if scores is None and rnd.shards:
            self._log("WARNING", f"epoch {rnd.epoch}: no test scores (not every shard of "
                                 "the held-out set was scored)")
        record = with_scores(rnd.record, rnd.extra, scores, rnd)
        with self._lock:
            self._history.append(record)
            self._log("INFO", summary(record))

    def _finish(self, state: JobState, reason: str | None) -> None:
        if not self.state.is_terminal and self._evals.busy:
            # Ending otherwise than by success or cancellation (which wait for them):
            # the epochs whose evaluation is out keep their records, with the scores
            # that are in by now.
            self._next_behind = None
            self._evals.poll(timeout_s=1.0)
            for rnd in self._evals.close("the job ended before this shard was scored"):
                self._publish(rnd)
        super()._finish(state, reason)

    def _maybe_succeed(self) -> None:
        """Done once every epoch is trained, its evaluations are in, and a member still
        holds the final state; if the last holder was lost (in the final evaluation or
        checkpoint), the next step's regroup restores the last checkpoint and trains on,
        or fails with the reason."""
        if self.protocol.epoch >= self.spec.epochs and self.membership.holders():
            self._settle_evaluations()
            if self.membership.holders():
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
        drains = self.membership.apply_drains()
        if drains:
            self._settle_evaluations()  # a drained worker may still owe its shard of one
        for change in drains:
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

    def _poll_nodes(self) -> None:
        """While a segment is in flight: every ``NODE_POLL_S``, start workers on nodes that
        joined and tend the spares. They join at the next boundary."""
        now = self.clock.now()
        if now - self._last_node_poll >= NODE_POLL_S:
            self._last_node_poll = now
            self._spawn_missing(starting=False)

    def _spawn_missing(self, starting: bool) -> None:
        m = self.membership
        nodes = self.runtime.nodes()
        if not nodes and starting:
            self.reason = f"waiting for resources: {self._no_node_hint()}"
        spares = spare_capable(self.runtime)
        if spares is not None:
            for node, why in spares.lost_spares():
                m.spare_lost(node, why)
                self._log("WARNING", f"the spare worker on node {node[:12]} was lost before "
                                     f"it was adopted ({why}); that node gets no other spare")
        adopted = False
        for s in m.spawns(nodes, starting, self.spec.gpus_on):
            self.tracker.add(s.worker_id, s.capacity)
            self.runtime.spawn(s)
            adopted = adopted or s.adopt
            self._log("INFO", f"starting worker {s.worker_id} on node {s.node_id[:12]}"
                              + (" (GPU)" if s.gpus else "")
                              + (" (adopting its spare)" if s.adopt else ""))
        # Spares once the first workers are up (they would compete with their start-up).
        if spares is not None and not starting and not self.state.is_terminal:
            plan = m.spare_plan(nodes, self.spec.spares, self.spec.gpus_on)
            for node in plan.stop:
                spares.stop_spare(node)
            for node in plan.start:
                spares.start_spare(node)
                self._log("INFO", f"starting a spare worker on node {node[:12]}")
        if adopted and self._ahead is None:
            # Nothing in flight: the adopted spare answers in milliseconds, and joins the
            # group formed at this boundary.
            self._adopt_started(ADOPT_WAIT_S)

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
        self._next_behind = None  # an evaluation queued before the regroup ran before it
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
    def _checkpoint(self, reason: str, position: Position | None = None) -> None:
        """Save the job where it stands (or at ``position``: the epoch that just ended is
        saved as the start of the next)."""
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
        pos = position or (self.protocol.position if self.protocol else self._position)
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
        from dynabatch.scheduler.checkpoint import save_checkpoint

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
        # Records of epochs before it first: the checkpoint's history replaces them all.
        self._settle_evaluations()
        lost = ("every worker holding the current model state was lost "
                f"(committed at epoch {self.membership.committed.epoch} "
                f"step {self.membership.committed.step})")
        ckpt = None
        if self.spec.checkpoint.dir:
            from dynabatch.scheduler.checkpoint import CheckpointError, load_checkpoint

            try:
                ckpt = load_checkpoint(self.spec.checkpoint.dir, self.job_id)
            except CheckpointError as err:
                self._fail_now(f"{lost}, and the checkpoint cannot be loaded: {err}")
        if not ckpt:
            self._fail_now(f"{lost}, and there is no checkpoint to restore (set checkpoint.dir)"
                           "; not continuing from freshly initialised weights")
        self._restore(ckpt, why=f"{lost}; rolling back")

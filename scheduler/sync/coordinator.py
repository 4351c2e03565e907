"""The coordinator of one job: the step loop's executor, over pure machines and a runtime.

``step()`` is one step boundary: the pure reducer (:func:`~dynabatch.scheduler.core.sync.
loop.step`) decides it from what this executor tells it happened, and this executor carries
out its effects on its parts (``workforce``, ``pipeline``, ``roster``, ``epochs``,
``checkpoints``), over the job's pure machines (membership, regime, tracker, ledger and
protocol: each part is given those it uses) and a :class:`Runtime`: Ray actors in
production, the simulator's virtual clock in ``dynabatch simulate`` and the unit tests.
``run()`` loops it until the job is terminal. The other public methods may be called from
other threads while it runs (the actor is threaded): requests are queued and applied at
the next step boundary. ``docs/architecture.md`` ("The step loop") draws the whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dynabatch.actors.spec import MAX_WORKERS, JobSpec
from dynabatch.scheduler.control import JobControl
from dynabatch.scheduler.core.failures import FailurePolicy
from dynabatch.scheduler.core.ledger import Ledger
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.membership import Membership, NodeAssignment
from dynabatch.scheduler.core.regime.regime import Regime
from dynabatch.scheduler.core.sync.loop import (
    AbsorbAhead,
    AdoptStarted,
    ApplyDrains,
    AtRest,
    AwaitStarts,
    BeginEpoch,
    Boundary,
    Checkpoint,
    CommitInFlight,
    Concluded,
    Effect,
    EndEpoch,
    EndJob,
    EndStep,
    Evaluate,
    Event,
    Failed,
    GiveUpStarts,
    JudgeEpoch,
    LoadCheckpoint,
    LoadData,
    LoopConfig,
    LoopState,
    MembershipView,
    Memo,
    NextEpoch,
    Place,
    PlanSegment,
    PostPlanUpdate,
    PublishReady,
    Regroup,
    Replan,
    SaveModel,
    Seen,
    Settle,
    StartWorkers,
    StopWorkers,
    TakeRequests,
    TendSpares,
    TrainSegment,
    WaitForMinimum,
    Waiting,
    answer,
    public_state,
    step,
)
from dynabatch.scheduler.core.sync.policy import policy_for
from dynabatch.scheduler.core.sync.protocol import RebalanceRule, SyncProtocol
from dynabatch.scheduler.core.sync.tracker import Tracker
from dynabatch.scheduler.runtime.seam import Clock, GroupReports, Runtime
from dynabatch.scheduler.sync.checkpoints import Checkpoints
from dynabatch.scheduler.sync.epochs import Epochs
from dynabatch.scheduler.sync.evaluation import Evaluations
from dynabatch.scheduler.sync.pipeline import Pipeline
from dynabatch.scheduler.sync.roster import Roster
from dynabatch.scheduler.sync.workforce import Workforce
from dynabatch.scheduler.telemetry import JobSnapshot, WorkerStatus

log = logging.getLogger("dynabatch.coordinator")

# How long an evaluation round may take before its missing shards count as failed.
EVAL_TIMEOUT_S = 600.0


def _lr_scheduler_factors(spec: JobSpec) -> tuple[tuple[float, ...] | Callable[[int], float],
                                                 str | None]:
    """The spec's ``optimizer.lr_scheduler`` as a learning-rate factor per epoch (empty when
    it has none) or per optimizer step (``actors.optim.lr_schedule``), and the one-line
    problem when it cannot be computed (torch, so imported only for a job that has one)."""
    sched = spec.optimizer.lr_scheduler
    if sched is None:
        return (), None
    from dynabatch.actors.optim import lr_schedule
    from dynabatch.actors.workloads import WorkloadError

    try:
        return lr_schedule(spec), None
    except WorkloadError as err:
        return (), str(err)


class Coordinator(JobControl):
    """A synchronous job's driver. Where its loop stands is its reducer's state,
    :attr:`loop` (the job's public state is derived from it); what it reports is
    :meth:`snapshot`, :meth:`history` and the views below."""

    def __init__(
        self,
        job_id: str,
        spec: JobSpec | dict,
        *,
        resume: bool = True,
        runtime: Runtime | None = None,
        clock: Clock | None = None,
        reports: GroupReports | None = None,
        worker_cap: int = MAX_WORKERS,
    ):
        """``runtime``: Ray's when None. ``reports``: where the job tells the cluster
        scheduler its group whenever one forms (with Ray's runtime, the scheduler actor;
        none: not told). ``worker_cap``: the most workers a job may have (the service's;
        the simulator's clusters go past it)."""
        super().__init__(job_id, spec if isinstance(spec, JobSpec)
                         else JobSpec.model_validate(spec), clock)
        if runtime is None:
            from dynabatch.scheduler.runtime.ray_runtime import RayGroupReports, RayRuntime

            # The workers' and this driver's own output, into the job log
            # (dynabatch.actors.output).
            runtime = RayRuntime(self.spec, output=self._follow_actor_output())
            reports = reports or RayGroupReports()
        self.runtime = runtime
        self.reports = reports
        self.loop: LoopState = AtRest()  # where the step loop stands (its reducer's state)
        self.reason = "starting workers"
        s = self.spec
        self.loop_config = LoopConfig(
            epochs=s.epochs,
            rule=RebalanceRule(s.rebalance.mode, s.rebalance.every_steps,
                               s.rebalance.check_steps),
            policy_static=s.policy == "static", goodput=s.schedule.mode == "goodput",
            checkpoint_dir=bool(s.checkpoint.dir), checkpoint_every=s.checkpoint.every_epochs,
            judges_epochs=s.early_stopping is not None or s.checkpoint.keep_best is not None,
            isgd=s.isgd.enabled, start_timeout_s=s.start_timeout_s)
        lr_factors, lr_error = _lr_scheduler_factors(s)
        # The job's pure machines: who is in (membership), the global batch, LR, ISGD and
        # goodput of every step (regime), each worker's measured speed (tracker), the
        # epoch's exactly-once account (ledger), and where training stands (protocol: until
        # the data loads, where it starts).
        self.membership = Membership(
            workers=s.initial_workers, min_workers=s.min_workers, max_workers=s.max_workers,
            # The schedule's smallest and largest batch bound the group's size, as they
            # bound the service's scale (batch_bounds: one rule).
            smallest_batch=s.batch_range[0], largest_batch=s.batch_range[1],
            max_batch=s.max_batch, max_possible=worker_cap)
        self.regime = Regime(s, lr_factors)
        self.tracker, self.ledger = Tracker(), Ledger()
        self.protocol = SyncProtocol(
            global_batch=self.regime.batch_for(0), seed=s.seed,
            rule=RebalanceRule(s.rebalance.mode, s.rebalance.every_steps,
                               s.rebalance.check_steps))
        # Evaluations run on the holders between segments, collected as they arrive.
        self.evals = Evaluations(runtime, self.clock, EVAL_TIMEOUT_S)
        # The parts, each given what it uses; none holds this coordinator or another part.
        p, m, t = self.protocol, self.membership, self.tracker
        self.workforce = Workforce(m, t, FailurePolicy(s.max_retries), runtime, self)
        w = self.workforce
        self.pipeline = Pipeline(p, m, self.regime, t, self.ledger, self, w, runtime, self.evals)
        self.roster = Roster(p, m, t, self, w, runtime, self.evals, reports)
        policy = policy_for(s.policy, s.rebalance.min_gain(s.policy))
        self.epochs = Epochs(p, m, self.regime, policy, t, self.ledger, self, w, runtime,
                             self.evals)
        self.checkpoints = Checkpoints(p, m, self.regime, self.ledger, self, w)
        # A checkpoint that cannot be loaded fails the job, not this constructor (the job then
        # ends FAILED naming the file, and run() returns at once); so does an LR schedule.
        error = lr_error
        if error is None and resume and s.checkpoint.dir:
            error = self.checkpoints.resume()
            self.epochs.restored(self.checkpoints.epoch_rebalances)
        if error is None and s.checkpoint.from_ and self.checkpoints.weights is None:
            # A new job starts from another's checkpoint; one resuming from its own goes on
            # from that, which holds what it learnt since.
            error = self.checkpoints.start_from(s.checkpoint.from_)
        if error is not None:
            self.loop = Concluded(JobState.FAILED, error)
            self.finish(JobState.FAILED, error)
        elif self.checkpoints.weights is not None:  # the first group forms with them
            self.loop = AtRest(Memo(restored=True))

    # ---------------------------------------------------------------- views
    @property
    def epoch(self) -> int:
        return self.protocol.epoch

    @property
    def step_in_epoch(self) -> int:
        return self.protocol.step

    # ---------------------------------------------------------------- public interface
    def run(self) -> JobSnapshot:
        while self.step():
            pass
        return self.snapshot()

    def step(self) -> bool:
        """One control-loop step; False once the job is terminal."""
        try:
            return self._step()
        except Exception as err:  # the job fails with the reason; the actor stays up
            log.exception("job %s failed", self.job_id)
            return self._fail(f"internal error: {type(err).__name__}: {err}")

    def snapshot(self) -> JobSnapshot:
        with self.lock:
            p = self.protocol
            alloc = p.allocation
            batch_of = dict(zip(alloc.workers, alloc.batches, strict=True)) if alloc else {}
            # Between epochs (no totals open) the tracker still holds the ended epoch's
            # samples while the plan is the next one's: count one of them, never both. A
            # finished job shows its last epoch's partitions, as its record does.
            last = self.records[-1] if self.records else None
            done = p.epoch >= self.spec.epochs and last is not None
            final = {w.worker: w.partition for w in last.workers} if done else {}
            workers = []
            for rank, m in enumerate(self.membership.members):
                t = self.tracker.workers.get(m.worker_id)
                batch = part = 0
                if m.worker_id in batch_of:
                    batch = batch_of[m.worker_id]
                    trained = t.epoch_samples if t and self.epochs.totals is not None else 0
                    part = final.get(m.worker_id, 0) if done else (
                        trained + p.planned_remaining(m.worker_id))
                workers.append(WorkerStatus(
                    worker=m.worker_id, node=m.node, rank=rank, batch=batch, partition=part,
                    throughput=t.speed if t else 0.0,
                    compute_s_per_step=t.compute_per_step if t else 0.0,
                    wait_s_per_step=t.wait_per_step if t else 0.0,
                    slowdown=t.slowdown if t else 1.0,
                    joined=m.worker_id in batch_of,
                ))
            regime = self.regime.live(self.epoch, self.step_in_epoch, p.global_batch,
                                      p.steps_per_epoch or 1)
            return self._snapshot(
                **regime, epoch=self.epoch, step=self.step_in_epoch,
                steps_per_epoch=p.steps_per_epoch, generation=self.membership.generation,
                policy=self.spec.policy, workers=workers,
                validation_metrics=dict(last.validation_metrics) if last else {},
                utilization=last.utilization if last else None,
                compute_balance=last.compute_balance if last else None,
                rebalances_total=self.epochs.rebalances,
                regroup_seconds_total=self.roster.regroup_seconds,
                retried_samples_total=self.ledger.retried_total,
                rollbacks_total=self.checkpoints.rollbacks,
                step_breakdown=last.breakdown if last else None)

    def _member_ids(self) -> list[str]:
        return self.membership.worker_ids

    def _assignment_error(self, nodes: NodeAssignment) -> str | None:
        with self.lock:
            return self.membership.batch_error(nodes.total)

    def _assignment_arrived(self) -> None:
        """Start the assignment's new workers now, while the job trains (the roster's
        :meth:`~dynabatch.scheduler.sync.roster.Roster.start_assigned`); one that cannot
        start now is started by the next boundary."""
        try:
            self.roster.start_assigned()
        except Exception as err:
            self.log("WARNING", f"the assignment's workers could not start at once "
                                 f"({type(err).__name__}: {err}); the next step boundary "
                                 "starts them")

    def _placement_note(self, workers: int) -> str | None:
        with self.lock:
            m = self.membership
            if self.state == JobState.PENDING and m.generation == 0:
                return None  # the first start shares nodes as it must
        nodes = self.runtime.nodes()
        with self.lock:
            short = m.unplaceable(nodes, min(workers, m.smallest_batch))
        return self.roster.placement_text(short, workers) if short else None

    def shutdown(self) -> None:
        # Every spawned worker is a member, pending, or leaving until it is killed; spares
        # too.
        self.workforce.stop(tuple(self.workforce.leaving))
        m = self.membership
        for w in [*m.members, *m.pending.values()]:
            self.runtime.kill(w.worker_id)
        for node in m.drop_spares():
            self.runtime.stop_spare(node)

    # ---------------------------------------------------------------- the loop
    def _step(self) -> bool:
        """One boundary: the reducer decides, this carries out its effects in order and
        answers each batch with what its last effect did (``answer``), or with the failure
        the failure policy decided to end the job in it (``Failed``)."""
        if self.state.is_terminal:  # ended before the loop ran (a checkpoint unreadable)
            return False
        effects = self._decide(self._boundary())
        while True:
            ok: object = True
            for effect in effects:
                if isinstance(effect, EndStep):
                    return not effect.stop and not self.state.is_terminal
                ok = self._carry_out(effect)
                if self.workforce.failure is not None:
                    return self._fail(self.workforce.failure)
            effects = self._decide(answer(effects[-1], self._seen(), self.clock.now(), ok))

    def _fail(self, reason: str) -> bool:
        """A failure ended the job (the failure policy's ``Fail``, or a bug): the reducer
        concludes it and its effects are carried out."""
        for effect in self._decide(Failed(reason)):
            if not isinstance(effect, EndStep):
                self._carry_out(effect)
        return False

    def _decide(self, event: Event) -> list[Effect]:
        """The reducer's step on ``event``; the job's public state follows the loop's
        (:func:`~dynabatch.scheduler.core.sync.loop.public_state`) at once: RUNNING as its
        group is ready, PENDING as it waits. Its end is published by ``EndJob``, the
        concluding batch's last effect, once the checkpoint and the model are out."""
        self.loop, effects = step(self.loop, event, self.loop_config)
        public = public_state(self.loop)
        if not public.is_terminal and public is not self.state:
            why = (f"waiting for nodes: {self.loop.shortfall}"
                   if isinstance(self.loop, Waiting) else None)
            self.transition(public, why)
        return effects

    def _boundary(self) -> Boundary:
        return Boundary(self._seen(), self.clock.now())

    def _seen(self) -> Seen:
        """What the job's machines say now."""
        p, m = self.protocol, self.membership
        speeds = self.tracker.speeds()
        with self.lock:  # an arriving assignment changes the placement (Roster)
            requests = tuple(type(r).__name__.lower() for r in self._requests)
            membership = MembershipView(
                generation=m.generation, members=m.rank_order(),
                holders=tuple(x.worker_id for x in m.holders()), starting=tuple(m.pending),
                draining=tuple(m.draining(speeds)), moving=tuple(m.moving()), dirty=m.dirty,
                shortfall=m.shortfall())
            cancel = self.cancel_reason
            recorded = len(self.records)
        return Seen(
            cancel=cancel,
            epoch=self.epoch, step=self.step_in_epoch,
            steps_per_epoch=p.steps_per_epoch or 1,
            recorded=recorded,
            batch=p.global_batch, next_batch=self.regime.batch_for(self.epoch + 1),
            requests=requests,
            membership=membership, leaving=tuple(self.workforce.leaving))

    def _carry_out(self, effect: Effect) -> object:
        """One of the reducer's effects, on this driver's parts; True unless a regroup did
        not form or a segment did not all run (an epoch's judgement: its :class:`Verdict`;
        a re-plan: what it offers the segment in flight, or None)."""
        match effect:
            case LoadData():
                self.epochs.load_data()
            case TakeRequests(assignments):
                self.roster.apply_requests(assignments)
            case ApplyDrains():
                self.roster.apply_drains()
            case AdoptStarted():
                self.roster.adopt_started(0.0)
            case Place(starting):
                return self.roster.place(starting)
            case StartWorkers(spawns, wait):
                self.roster.start(spawns, wait)
            case TendSpares(plan):
                self.roster.tend_spares(plan)
            case StopWorkers(workers):
                self.workforce.stop(workers)
            case AwaitStarts():
                self.roster.await_starts()
            case GiveUpStarts():
                self.roster.give_up_starts()
            case WaitForMinimum(shortfall, since):
                self.roster.wait_for_min(shortfall, since)
            case LoadCheckpoint():
                if self.checkpoints.roll_back():
                    self.epochs.restored(self.checkpoints.epoch_rebalances)
            case Regroup(members, source):
                weights = self.checkpoints.weights if source == "checkpoint" else None
                if not self.roster.regroup(members, weights):
                    return False
                self.checkpoints.loaded()
            case BeginEpoch():
                self.epochs.begin_epoch()
            case Replan(cause):
                if cause == "membership":  # at rest: nothing in flight keeps its plan
                    return self.epochs.replan("membership")
                why = f"{self.spec.rebalance.mode} check" if cause == "check" else "epoch start"
                return self.epochs.replan(why, at=self.pipeline.ahead_end(),
                                          early=self.pipeline.update_from())
            case PostPlanUpdate(offer):
                self.epochs.adopted(offer.decision, self.pipeline.post_update(offer), offer.why)
            case PlanSegment(ahead, across):
                return self.pipeline.plan(ahead, across)
            case TrainSegment(order):
                return self.pipeline.train(order, self.epochs.totals)
            case AbsorbAhead():
                return self.pipeline.absorb_ahead(self.epochs.totals)
            case EndEpoch():
                return self.epochs.end_epoch()
            case Evaluate(epoch, shards, record):
                self.epochs.evaluate(epoch, shards, record)
            case JudgeEpoch():
                return self.epochs.judge_epoch()
            case NextEpoch(stop):
                self.epochs.next_epoch(stop)
            case PublishReady():
                self.epochs.publish_ready()
            case CommitInFlight():
                return self.pipeline.drain(self.epochs.totals)
            case Settle():
                self.epochs.settle()
            case Checkpoint("best", position, best):
                self.checkpoints.save(reason=f"best {best['metric']}", position=position,
                                      best=best)
            case Checkpoint(reason, position):  # None: where it stands (in the open epoch)
                open_epoch = self.epochs.totals if position is None else None
                self.checkpoints.save(reason=reason, position=position, epoch_rebalances=(
                    open_epoch.rebalances if open_epoch is not None else 0))
            case SaveModel(reason):
                self.checkpoints.save_model(reason, self.epochs.data)
            case EndJob(outcome, reason):
                self.finish(outcome, reason)
            case _:
                raise TypeError(f"not an effect of the step loop: {effect!r}")
        return True

    def finish(self, state: JobState, reason: str | None) -> None:
        if not self.state.is_terminal:
            self.epochs.close()
        super().finish(state, reason)

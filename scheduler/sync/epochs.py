"""Epochs: the data, each epoch's beginning and plan, its end, evaluation and record.

An epoch ends with the ledger's exactly-once check, its record and an evaluation of its
final weights on the state holders, off the critical path (``evaluation``); the record
joins the history when that is in. A judged epoch (``early_stopping``,
``checkpoint.keep_best``) is judged from its evaluation over the history
(:func:`~dynabatch.scheduler.core.regime.stopping.judge`). Whether to await, judge and
checkpoint is the step loop's decision (``dynabatch.scheduler.core.sync.loop``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dynabatch.scheduler.core.failures import Fail, FailureEvent
from dynabatch.scheduler.core.regime.stopping import Judgement, judge, should_stop
from dynabatch.scheduler.core.sync.allocation import Decision
from dynabatch.scheduler.core.sync.boundary import evaluate_again
from dynabatch.scheduler.core.sync.loop import Verdict
from dynabatch.scheduler.core.sync.protocol import Position, SyncProtocol
from dynabatch.scheduler.core.sync.update import OfferedUpdate
from dynabatch.scheduler.sync.epoch_report import (
    EpochTotals,
    build_record,
    split_fields,
    summary,
    with_scores,
)
from dynabatch.scheduler.sync.evaluation import EvalRound, due_for_test
from dynabatch.scheduler.telemetry import EpochRecord, scores_text

if TYPE_CHECKING:
    from dynabatch.scheduler.control import JobControl
    from dynabatch.scheduler.core.ledger import Ledger
    from dynabatch.scheduler.core.membership import Membership
    from dynabatch.scheduler.core.regime.regime import Regime
    from dynabatch.scheduler.core.sync.allocation import Policy
    from dynabatch.scheduler.core.sync.tracker import Tracker
    from dynabatch.scheduler.runtime.seam import DataInfo, Runtime
    from dynabatch.scheduler.sync.evaluation import Evaluations
    from dynabatch.scheduler.sync.workforce import Workforce


class Epochs:
    def __init__(self, protocol: SyncProtocol, membership: Membership, regime: Regime,
                 policy: Policy, tracker: Tracker, ledger: Ledger, control: JobControl,
                 workforce: Workforce, runtime: Runtime, evals: Evaluations):
        self.protocol, self.membership, self.regime = protocol, membership, regime
        self.policy, self.tracker, self.ledger = policy, tracker, ledger
        self.control, self.workforce = control, workforce
        self.runtime, self.evals = runtime, evals
        self.data: DataInfo | None = None  # once loaded (the first boundary)
        # The open epoch's totals (the pipeline commits each segment into them); None
        # between epochs (the next step boundary begins one).
        self.totals: EpochTotals | None = None
        # The job's rebalances: its history's and the open epoch's (restored: see restored).
        self.rebalances = 0
        # Those a restored checkpoint's epoch made before its position: its totals start so.
        self._carried = 0
        # Test scores of an epoch whose record is not in the history yet (publish_test).
        self.test_scores: dict[int, dict[str, Any]] = {}

    # ---------------------------------------------------------------- beginnings
    def load_data(self) -> None:
        from dynabatch.actors.workloads import WorkloadError

        s, p = self.control.spec, self.protocol
        t0 = self.control.clock.now()
        try:
            d = self.data = self.runtime.load_data()
        except WorkloadError as err:
            self.workforce.failed(FailureEvent("data", error=str(err)))
            return
        p.load(d.n_train)
        if self.ledger.epoch != p.epoch:
            self.ledger.begin_epoch(p.epoch, d.n_train)
        self.evals.loaded(d.n_validation, d.n_test, lambda epoch: due_for_test(
            validation=True, every_epoch=s.evaluation.test_every_epoch,
            last=epoch + 1 >= s.epochs, stopped=False))
        val = f"{d.n_validation} validation, " if d.n_validation else ""
        self.control.log("INFO", f"loaded {d.name}: {d.n_train} train, {val}{d.n_test} test "
                                 f"samples in {self.control.clock.now() - t0:.2f}s")

    def begin_epoch(self) -> None:
        p = self.protocol
        if p.step == 0:
            batch = self.regime.batch_for(p.epoch)
            if batch != p.global_batch:
                self.control.log("INFO", f"epoch {p.epoch}: global batch {p.global_batch} -> "
                                         f"{batch}")
                p.resize(batch)
        self.totals = EpochTotals(started=self.control.clock.now(), rebalances=self._carried)
        self._carried = 0
        self.tracker.begin_epoch()
        if self.ledger.epoch != p.epoch:
            self.ledger.begin_epoch(p.epoch, p.dataset_size)

    def replan(self, why: str, at: int | None = None, early: int | None = None
               ) -> OfferedUpdate | None:
        """Re-plan the rest of the epoch from step ``at`` (default: now; a later step when
        a segment is in flight: it keeps the allocation it was sent with). ``early``: the
        step of that segment from which a new allocation can still take effect inside it
        (its workers claim each step, so they can be sent a plan update; the pipeline's
        :meth:`~dynabatch.scheduler.sync.pipeline.Pipeline.update_from`): one that changed
        the batches is adopted from there and returned, offered to the segment in flight:
        the loop posts it (``PostPlanUpdate``: the pipeline's ``post_update``, then
        :meth:`adopted`)."""
        p = self.protocol
        if at is not None and self.membership.dirty:
            return None  # a worker joined or was lost: the boundary's regroup re-plans
        workers = self.membership.worker_ids
        early = early if at is not None else None
        telemetry = self.tracker.telemetry(workers, self.control.spec.max_batch)
        decision = p.replan(self.policy, telemetry, at=at if early is None else early)
        if decision is None:
            return None
        if early is not None:
            if decision.rebalanced:
                return OfferedUpdate(decision, early, at, why)
            p.defer(early, at)  # kept: from the step after the segment, as planned
        self.adopted(decision, at, why)
        return None

    def restored(self, carried: int) -> None:
        """The job (re)starts from a checkpoint (resumed, or rolled back): the open epoch's
        totals go (the next boundary begins it again, from the checkpoint's step); the
        rebalances are the restored history's (complete: evaluations in flight were settled
        before the checkpoint was written) and those of the checkpoint's epoch before its
        position (``carried``)."""
        self.totals = None
        self._carried = carried
        self.rebalances = sum(r.rebalances for r in self.control.records) + self._carried

    def adopted(self, decision: Decision, at: int | None, why: str) -> None:
        """A re-plan took effect from step ``at`` (None: now): the tracker learns the
        batches, and a rebalance is counted and logged."""
        p = self.protocol
        a = decision.allocation
        self.tracker.decided(dict(zip(a.workers, a.batches, strict=True)))
        if decision.rebalanced:
            self.rebalances += 1
            self.totals.rebalanced()
            where = f" from step {at}" if at is not None and at != p.step else ""
            self.control.log("INFO", f"rebalance ({why}): batches "
                                     f"{dict(zip(a.workers, a.batches, strict=True))}{where} — "
                                     f"{decision.reason}")

    # ---------------------------------------------------------------- ends
    def _judged(self, metric: str, mode: str, min_delta: float = 0.0) -> Judgement:
        """The history's best epoch by ``metric`` (``loss``: the held-out loss) on the
        judged split (validation, when the job has one)."""
        held = [r.held_out(self.evals.split) for r in self.control.records]
        values = [loss if metric == "loss" else scores.get(metric) for loss, scores in held]
        return judge(values, mode, min_delta)

    def judge_epoch(self) -> Verdict:
        """After the ended epoch's evaluation is in: whether it is the best by keep_best's
        metric (what it was judged by, for the best checkpoint), and early stopping's reason
        to end the training after it, if any."""
        epoch = self.protocol.epoch
        history = self.control.records
        best = self.control.spec.checkpoint.keep_best
        judged_best = None
        if best is not None:
            j = self._judged(best.metric, best.mode)
            if j.best is not None and history[j.best].epoch == epoch:
                judged_best = {"metric": best.metric, "mode": best.mode, "value": j.value,
                               "epoch": epoch}
        return Verdict(judged_best, self._stop_after(epoch))

    def _stop_after(self, epoch: int) -> str | None:
        es = self.control.spec.early_stopping
        if es is None or epoch + 1 >= self.control.spec.epochs:
            return None
        history = self.control.records
        j = self._judged(es.metric, es.mode, es.min_delta)
        if not should_stop(j, es.patience):
            return None
        why = (f"early stopping: {es.metric} has not improved on epoch "
               f"{history[j.best].epoch}'s {j.value:g} for {j.stale} "
               f"epoch{'s' if j.stale != 1 else ''} (patience "
               f"{es.patience})")
        self.control.log("INFO", f"{why}; the job ends after epoch {epoch}")
        return why

    def end_epoch(self) -> tuple[EpochRecord, dict[str, tuple[int, int]] | None] | None:
        """Close the epoch's training (the loop's ``EndEpoch``): verify it from the workers'
        reports (None: the exactly-once check does not hold, and the failure policy fails
        the job) and build its record, returned with the shards the holders score its final
        weights on (None: the evaluation sent ahead of its end does; :meth:`evaluate`)."""
        p = self.protocol
        v = self.ledger.verify()
        if not v.verified:
            self.workforce.failed(FailureEvent("exactly_once", error=(
                f"epoch {p.epoch}: exactly-once check of the workers' reports failed: "
                f"{v.reason}")))
            return None
        ep = self.totals
        alloc = p.allocation
        planned = set(alloc.workers) if alloc else set()
        tracks = {w: t for w in self.membership.worker_ids
                  if (t := self.tracker.workers.get(w)) is not None
                  and (t.epoch_steps or w in planned)}
        record = build_record(
            epoch=p.epoch, steps=p.steps_per_epoch, verification=v, totals=ep,
            elapsed=self.control.clock.now() - ep.started, tracks=tracks,
            nodes={m.worker_id: m.node for m in self.membership.members}, allocation=alloc,
            regime=self.regime.end_epoch(p.epoch, p.global_batch, p.steps_per_epoch, ep.wall),
            policy=self.control.spec.policy, emulated=self.control.spec.emulated,
            generation=self.membership.generation)
        if self.evals.unattached(p.epoch) is not None:
            return record, None
        holders = [m.worker_id for m in self.membership.holders()]
        return record, self.evals.shards(holders, self.tracker.speeds())

    def evaluate(self, epoch: int, shards: Mapping[str, tuple[int, int]] | None,
                 record: EpochRecord) -> None:
        """Have the holders score the ended ``epoch``, each its shard (None: the evaluation
        sent ahead of its end does), and attach its record, with its totals, to that
        evaluation: the record is published when it is in (the loop's ``Evaluate``)."""
        if shards is not None:
            self.evals.submit(epoch, dict(shards), behind=True)
        self.evals.attach(epoch, record, self.totals)

    def next_epoch(self, stop: str | None = None) -> None:
        """The ended epoch is closed: the job stands at the next epoch's start (training
        ends there when early stopping said so: ``stop``), and the evaluations that are in
        are published."""
        p = self.protocol
        due = self.evals.test_after
        if stop is not None and due is not None and not due(p.epoch):
            # An early stop ends the training with these weights: the test set scores them
            # (the holders have them: a judged epoch sends nothing ahead of its evaluation).
            holders = [m.worker_id for m in self.membership.holders()]
            self.evals.submit(p.epoch, self.evals.shards(holders, self.tracker.speeds(), "test"),
                              "test", behind=True, record=self.control.records[-1],
                              extra=self.totals)
        with self.control.lock:
            p.next_epoch()
            self.totals = None
        self.publish_ready()

    # ---------------------------------------------------------------- evaluations
    def publish_ready(self) -> None:
        self.evals.poll()
        for rnd in self.evals.ready():
            self.publish(rnd)

    def settle(self) -> None:
        """Wait for the evaluations in flight (each up to its deadline) and publish them."""
        while self.evals.busy:
            ready = self.evals.settle()
            if not ready:
                break
            for rnd in ready:
                self.publish(rnd)

    def publish(self, rnd: EvalRound, closing: bool = False) -> None:
        """An epoch's evaluation is in: its record joins the history, with the scores when
        every shard was scored. A shard that failed on a live worker is a failure the
        policy decides (the job fails once its retries are spent), unless the job is ending anyway
        (``closing``)."""
        for w, r in rnd.failures.items():
            self.control.log("WARNING", f"evaluation of epoch {rnd.epoch} on {w} failed: {r.error}")
            if r.lost:
                self.workforce.remove(w, "failure", "lost during evaluation")
        sums = rnd.sums()
        if sums is not None:
            self.workforce.succeeded("evaluation")
        elif not closing and (bad := next(((w, r) for w, r in rnd.failures.items()
                                           if not r.lost), None)):
            w, r = bad
            decision = self.workforce.failed(FailureEvent(
                "evaluation", position=Position(rnd.epoch, 0), worker=w, shard=rnd.shards[w],
                error=r.error or "no answer", user=r.user))
            if isinstance(decision, Fail):
                return
        again = evaluate_again(
            complete=sums is not None, shard_failed=bool(rnd.failures),
            last_queued=rnd is self.evals.behind,
            holders=tuple(m.worker_id for m in self.membership.holders()),
            waited_s=rnd.critical_s, cancel_requested=self.control.cancel_reason is not None)
        if again is not None:
            # Nothing was sent behind it: the holders left still have the epoch's weights
            # and score the set again (at the job's end, say), so no scores are lost.
            self.control.log("INFO", f"epoch {rnd.epoch}: evaluating again on "
                                     f"{list(again.workers)}")
            shards = self.evals.shards(list(again.workers), self.tracker.speeds(), rnd.split)
            self.evals.submit(rnd.epoch, shards, rnd.split, behind=True, record=rnd.record,
                              extra=rnd.extra, waited_s=again.waited_s)
            return
        scores = self.evals.runtime.finish_evaluation(sums) if sums is not None else None
        if scores is None and rnd.shards:
            self.control.log("WARNING", f"epoch {rnd.epoch}: no {rnd.split} scores (not every "
                                        f"shard of the {rnd.split} set was scored)")
        if rnd.split != self.evals.split:  # the test round behind a validation round
            self.publish_test(rnd.epoch, scores)
            return
        record = self._with_test(with_scores(rnd.record, rnd.extra, scores, rnd))
        with self.control.lock:
            self.control.records.append(record)
            self.control.log("INFO", summary(record, self.control.spec.epochs))
        self.control.tracking.epoch(record)

    def publish_test(self, epoch: int, scores: dict[str, float] | None) -> None:
        """A test round's scores of ``epoch``'s weights join the epoch's record (in the
        history, or once it is: its validation round may have been run again)."""
        self.test_scores[epoch] = split_fields("test", scores)
        at = next((i for i, r in enumerate(self.control.records) if r.epoch == epoch), None)
        if at is None:
            return
        record = self._with_test(self.control.records[at])
        with self.control.lock:
            self.control.records[at] = record
            self.control.log("INFO", f"epoch {epoch}: test "
                                     f"{scores_text(record.scores) or 'not scored'}")
        self.control.tracking.epoch(record)

    def _with_test(self, record: EpochRecord) -> EpochRecord:
        fields = self.test_scores.pop(record.epoch, None)
        return record if fields is None else record.model_copy(update=fields)

    def close(self) -> None:
        """The job ends otherwise than by success or cancellation (which wait for them):
        the epochs whose evaluation is out keep their records, with the scores that are
        in by now."""
        if not self.evals.busy:
            return
        self.evals.poll(timeout_s=1.0)
        for rnd in self.evals.close("the job ended before this shard was scored"):
            self.publish(rnd, closing=True)

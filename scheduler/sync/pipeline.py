"""The segment pipeline: send segments ahead, commit what the workers report, absorb failures.

One segment is always in flight: the next is sent before the current one's results are
read, so workers go from segment to segment without waiting for the coordinator; a re-plan
takes effect after the segment sent ahead, or inside it through a plan update
(``dynabatch.scheduler.core.sync.update``). Whether a segment may be sent ahead, where it
starts and how its wall time is attributed are pure decisions
(``dynabatch.scheduler.core.sync.ahead``); this module executes them. The whole, across an
epoch's end and after a failure: ``docs/architecture.md``, "No bubbles".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dynabatch.scheduler.core.failures import Failure, FailureEvent, WorkerOutcome, classify
from dynabatch.scheduler.core.sync import ahead as decide
from dynabatch.scheduler.core.sync.loop import SegmentOrder
from dynabatch.scheduler.core.sync.protocol import Position
from dynabatch.scheduler.core.sync.update import (
    OfferedUpdate,
    PlanUpdate,
    check_update,
    update_at,
    updated_plans,
)
from dynabatch.scheduler.sync.epoch_report import EpochTotals, segment_busy
from dynabatch.scheduler.sync.evaluation import EvalRound

if TYPE_CHECKING:
    from dynabatch.scheduler.control import JobControl
    from dynabatch.scheduler.core.ledger import Ledger
    from dynabatch.scheduler.core.membership import Membership
    from dynabatch.scheduler.core.regime.regime import Regime
    from dynabatch.scheduler.core.sync.protocol import SyncProtocol
    from dynabatch.scheduler.core.sync.tracker import Tracker
    from dynabatch.scheduler.runtime.seam import Runtime
    from dynabatch.scheduler.sync.evaluation import Evaluations
    from dynabatch.scheduler.sync.workforce import Workforce

UPDATE_TIMEOUT_S = 2.0  # posting a plan update: one compare-and-set in the group's store


@dataclass(frozen=True, slots=True)
class Ahead:
    """A segment sent before the previous one's results were read."""

    position: Position
    plans: dict[str, Any]
    ticket: Any
    sent: float
    behind: EvalRound | None = None  # an evaluation queued on its workers just before it

    @property
    def length(self) -> int:
        return len(next(iter(self.plans.values())).steps)


class Pipeline:
    def __init__(self, protocol: SyncProtocol, membership: Membership, regime: Regime,
                 tracker: Tracker, ledger: Ledger, control: JobControl, workforce: Workforce,
                 runtime: Runtime, evals: Evaluations):
        self.protocol, self.membership, self.regime = protocol, membership, regime
        self.tracker, self.ledger = tracker, ledger
        self.control, self.workforce = control, workforce
        self.runtime, self.evals = runtime, evals
        self.ahead: Ahead | None = None  # the segment in flight, sent ahead
        self.last_collect = -1e18  # when the last segment's results were read

    def grace_s(self) -> float:
        return self.control.spec.collective_timeout_s + 5.0

    def stamp(self, plans: dict[str, Any]) -> dict[str, Any]:
        """The protocol's plans, stamped with the regime's learning rates and ISGD chart
        and with each worker's memory cap (learned for its node and device from an
        out-of-memory failure: dynabatch.scheduler.core.failures.MemoryCaps)."""
        plans = self.regime.stamp(plans, self.protocol.steps_per_epoch)
        out = {}
        for w, plan in plans.items():
            m = self.membership.get(w)
            cap = self.workforce.memory.cap(m.node, m.gpus) if m is not None else None
            out[w] = replace(plan, micro_cap=cap) if cap is not None else plan
        return out

    def ahead_end(self) -> int | None:
        """The step after the segment in flight, when it lies in this epoch."""
        a = self.ahead
        return decide.ahead_end(a.position if a else None, a.length if a else 0,
                                self.protocol.epoch)

    def update_from(self) -> int | None:
        """The step from which a re-plan decided now can take effect inside the segment in
        flight, by a plan update (None: only after it)."""
        a, p = self.ahead, self.protocol
        if a is None or a.position.epoch != p.epoch:
            return None
        if not next(iter(a.plans.values())).updates:
            return None  # its workers claim no step (rebalance: epoch): they would not see it
        return update_at(committed=p.step, ahead_start=a.position.step,
                         ahead_end=a.position.step + a.length)

    def post_update(self, offer: OfferedUpdate) -> int:
        """Send the re-plan offered inside the segment in flight to its workers: their steps
        ``[early, end)`` under the allocation adopted from ``early``. Returns the step it
        takes effect from: ``early`` when they apply it, else (refused: a worker had
        started that step) the segment's end, where the protocol defers it."""
        p, ahead, at, end = self.protocol, self.ahead, offer.early, offer.end
        seg = self.stamp(p.plan_segment(at=at, whole=True))
        update = PlanUpdate(p.epoch, at, {w: tuple(sp for sp in s.steps if sp.step < end)
                                          for w, s in seg.items()})
        why = check_update(ahead.plans, update)
        if why is not None:
            self.control.log("WARNING", f"plan update from step {at} not sent: {why}")
        elif self.runtime.update_segment(update, UPDATE_TIMEOUT_S):
            self.ahead = replace(ahead, plans=updated_plans(ahead.plans, update))
            return at
        p.defer(at, end)
        return end

    def plan(self, ahead: bool, across: bool) -> SegmentOrder:
        """The next segment's order (the loop's :class:`~dynabatch.scheduler.core.sync.loop.
        PlanSegment`): the segment in flight when it starts where the protocol stands, else
        the protocol's next, stamped. ``ahead``: with the one after it, in this epoch, or
        (``across``) the next epoch's first, behind the epoch's evaluation, split over the
        segment's workers."""
        p, flying = self.protocol, self.ahead
        if flying is not None and flying.position == p.position:
            order = SegmentOrder(p.position, flying.plans, sent=True)
        else:
            if flying is not None:  # defensive: a segment ahead always starts here
                self.drain(None)
            plans = self.stamp(p.plan_segment())
            if not plans:  # the loop trains only an epoch not complete: a bug
                raise RuntimeError(f"no segment to train at {p.position} (the epoch is "
                                   "complete)")
            order = SegmentOrder(p.position, plans)
        if not ahead:
            return order
        length = len(next(iter(order.plans.values())).steps)
        at = decide.plan_ahead(order.position, length, p.steps_per_epoch)
        crossing = at.epoch != order.position.epoch
        if crossing and not across:
            return order
        # Each of the segment's workers scores its shard of the epoch's final weights, then
        # trains on.
        shards = self.evals.shards(list(order.plans), self.tracker.speeds()) if crossing else None
        return replace(order, ahead=SegmentOrder(at, self.stamp(p.plan_segment(at=at)),
                                                 shards=shards))

    def drain(self, totals: EpochTotals | None) -> bool:
        """Collect the segment in flight: commit it into the open epoch's ``totals``, or
        (None) discard it after a failure of the one before it (it did not run)."""
        ahead = self.ahead
        if ahead is None:
            return True
        if totals is not None and ahead.position == self.protocol.position:
            # (Sent across the epoch's end: the loop began its epoch.)
            return self.train(SegmentOrder(ahead.position, ahead.plans, sent=True), totals)
        self.ahead = None
        outcomes = self.runtime.collect_segment(ahead.ticket, self.grace_s())
        trained = [o.worker for o in outcomes if o.result is not None and o.result.steps]
        if trained:  # cannot happen: the group broke at the failure before it
            self.control.log("ERROR", f"a segment sent ahead trained on {trained} after the one "
                                      "before it failed; their state is not the committed one")
            for w in trained:
                self.workforce.remove(w, "failure", "trained past a failed segment")
        return False

    def train(self, order: SegmentOrder, totals: EpochTotals) -> bool:
        """Run ``order`` (the loop's :class:`~dynabatch.scheduler.core.sync.loop.
        TrainSegment`): send it (unless it is in flight), then the one ahead of it behind its
        evaluation; commit what the state holders completed into the open epoch's
        ``totals``. True when it all ran."""
        if order.sent:
            flying, self.ahead = self.ahead, None
            if flying is None or flying.position != order.position:  # a bug
                raise RuntimeError(f"no segment in flight at {order.position} to collect")
            ticket, t0, behind = flying.ticket, flying.sent, flying.behind
        else:
            t0 = self.control.clock.now()
            behind = self.evals.take_behind()
            ticket = self.runtime.submit_segment(dict(order.plans))
        if (nxt := order.ahead) is not None:
            # Dropped if this segment fails (it is not the epoch's final state).
            queued = None if nxt.shards is None else self.evals.submit(
                self.protocol.epoch, dict(nxt.shards))
            self.ahead = Ahead(nxt.position, dict(nxt.plans),
                               self.runtime.submit_segment(dict(nxt.plans)),
                               self.control.clock.now(), queued)
        outcomes = self.runtime.collect_segment(ticket, self.grace_s())
        return self.commit(dict(order.plans), outcomes, order.position, t0, totals,
                           behind=behind)

    def commit(self, plans: dict, outcomes: list[WorkerOutcome], start: Position, t0: float,
               totals: EpochTotals, charge: bool = True, behind: EvalRound | None = None
               ) -> bool:
        """Commit what the state holders completed of a segment; handle its failure. True
        when it all ran. ``charge``: count a failure against the retries (not for a
        segment sent ahead, whose failure is the one already counted). ``behind``: an
        evaluation its workers ran just before it (its time is not the segment's)."""
        p = self.protocol
        now = self.control.clock.now()  # before the poll below: a simulated clock moves in it
        evaluation_s = None
        if behind is not None:
            self.evals.poll()  # its shards ran first, so they are in
            if behind.done:
                evaluation_s = behind.critical_s
        failure = classify(outcomes, self.control.spec.collective_timeout_s)
        results = [o.result for o in outcomes if o.result is not None]
        done = max((len(r.steps) for r in results), default=0)
        planned = len(next(iter(plans.values())).steps)
        busy = segment_busy(results, done)
        share = decide.attribute_wall(
            sent=t0, last_collected=self.last_collect, now=now,
            evaluation_s=evaluation_s, done=done, planned=planned, workers=len(plans),
            busy=busy)
        self.last_collect = now
        committed: list[list[Any]] = []
        with self.control.lock:
            for j in range(done):
                reports = [r.steps[j] for r in results if len(r.steps) > j]
                committed.append(reports)
                self.ledger.commit(reports)
                self.regime.observe(reports)
                totals.add_step(reports)
            totals.add_segment(share, busy)
            for r in results:
                self.tracker.observe(r.worker, r.steps)
            p.advance(done)
            self.membership.progressed(
                {r.worker: Position(start.epoch, start.step + len(r.steps)) for r in results}
            )
        # Outside the lock: the first write opens the event files (snapshots need not wait).
        if self.control.tracking.active:
            for reports in committed:
                self.control.tracking.step(reports, p.dataset_size)
        if failure is None:
            # The retry, if this was one, is over.
            self.workforce.succeeded("segment")
            return True
        # Lost and hung workers are removed here; the loop's next batch kills them before
        # anything else, so what they had queued ahead answers at once instead of after
        # another grace period.
        self.segment_failed(failure, charge, partial=done < planned)
        if not p.epoch_complete:
            # An evaluation sent ahead of this epoch's end scored weights that are not the
            # epoch's final ones: the epoch is evaluated when it does end.
            self.evals.discard(p.epoch)
        return False

    def absorb_ahead(self, totals: EpochTotals) -> bool:
        """After a failed segment, the one sent ahead (the loop's :class:`~dynabatch.
        scheduler.core.sync.loop.AbsorbAhead`). Usually it could not train: the
        failure broke the group and its workers refuse it. But a segment can "fail" after
        every collective of it completed, when a worker's result is lost with its node
        (a result too large to travel inline lives in that node's object store). Its peers
        then went on, in lockstep with it, into the segment ahead: what they completed
        there is committed like any segment (the all-reduced coverage proves it); the
        rest is discarded. (One ahead in the next epoch: the loop ended this epoch and
        began that one first.) It all ran only when it was committed whole: otherwise the
        failed segment's retry is still to run."""
        ahead = self.ahead
        if ahead is None:
            return False
        p = self.protocol
        if ahead.position != p.position:
            return self.drain(None)
        self.ahead = None
        outcomes = self.runtime.collect_segment(ahead.ticket, self.grace_s())
        if not any(o.result is not None and o.result.steps for o in outcomes):
            return False
        self.control.log("INFO", f"committing what the segment ahead trained after step "
                                 f"{p.step} of epoch {p.epoch}")
        return self.commit(ahead.plans, outcomes, ahead.position, ahead.sent, totals,
                           charge=False, behind=ahead.behind)

    def segment_failed(self, failure: Failure, charge: bool = True,
                       partial: bool = True) -> None:
        p = self.protocol
        # A step was in flight unless every survivor completed the whole segment (a lost
        # worker's result went with its node after the segment's collectives completed).
        if partial and not p.epoch_complete:
            in_flight = p.step_size(p.step)
            self.ledger.retry(in_flight)
        self.control.log("WARNING", f"step {p.step} of epoch {p.epoch} failed: {failure.summary}")
        for w, why in failure.lost.items():
            self.workforce.remove(w, "failure", why)
        for w, (_, batch) in failure.oom.items():
            m = self.membership.get(w)
            cap = self.workforce.memory.ran_out(m.node, m.gpus, batch) if m is not None else None
            if cap is not None:
                self.control.log("WARNING", f"{w} ran out of memory on a micro-batch of {batch}: "
                                            f"node {m.node}'s memory cap is now {cap} samples")
        # Whoever is left broke off the collective: the group must be formed again.
        self.membership.broke()
        # Uncharged (a segment sent ahead), the failure before it was counted: the next
        # segment is a retry either way. The policy evicts the stragglers.
        self.workforce.failed(FailureEvent("segment", position=p.position, failure=failure,
                                 counted=charge))

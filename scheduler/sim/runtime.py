"""The simulator's runtime: :class:`SimRuntime`, a
:class:`~dynabatch.scheduler.runtime.seam.Runtime` on a virtual clock. It answers the
coordinator's calls from its world (:mod:`~dynabatch.scheduler.sim.world`: nodes, events,
workers) and moves the clock by what each call would take on Ray
(:mod:`~dynabatch.scheduler.sim.cost_model`). Segments and evaluations run in the order sent,
when collected (:mod:`~dynabatch.scheduler.sim.calls`); a segment runs step by step in
:mod:`~dynabatch.scheduler.sim.training`. After a failed segment the workers have left the
group, so one queued behind it trains nothing until the next regroup. The job spec's
``emulation`` and the fault script (:mod:`~dynabatch.scheduler.sim.faults`) apply per worker
ordinal, as on Ray. Timing-only runs (no ``gradients``) have no model: evaluation gives no
loss and no accuracy. The simulator writes no checkpoints: a job that loses every holder of
its state fails, as a job without checkpoints does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dynabatch.actors.contracts import SegmentPlan
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.core.sync.update import updated_plans
from dynabatch.scheduler.runtime.seam import DataInfo, RegroupResult, ShardResult
from dynabatch.scheduler.sim.calls import Call, CallQueue
from dynabatch.scheduler.sim.cost_model import SimulatedCluster
from dynabatch.scheduler.sim.replicas import Replicas
from dynabatch.scheduler.sim.timeline import SimClock
from dynabatch.scheduler.sim.training import LOST, PEER_LEFT, SimTraining, peer_failed


class SimRuntime(SimTraining):
    """``gradients``: the model replicas the workers train (None: timing only).
    ``record.keep_plans = True`` also keeps the plans trained (tests read them)."""

    def __init__(self, spec: JobSpec, cluster: SimulatedCluster, *, clock: SimClock,
                 data: DataInfo, gradients: Replicas | None = None):
        super().__init__(spec, cluster, clock=clock, data=data, gradients=gradients)
        self._calls = CallQueue(self._run_call)
        # The last segment failed: every worker left the group until the next regroup.
        self._broken = False

    # --- Runtime: training --------------------------------------------------------------------
    def submit_segment(self, plans: dict[str, SegmentPlan]) -> Call:
        self.record.submitted += 1
        return self._calls.send(Call(plans=dict(plans)))

    def collect_segment(self, ticket: Call, grace_s: float) -> list[WorkerOutcome]:
        self._calls.run_through(ticket, grace_s)
        return ticket.outcomes or []

    def update_segment(self, update: Any, timeout_s: float) -> bool:
        self.record.updates.append(update)
        call = self._calls.queued_segment(update.epoch, update.at_step)
        if call is None:
            return False
        seg = next(iter(call.plans.values()))
        if not seg.updates or update.at_step == seg.steps[0].step:
            return False  # its workers claim no step, or have started this one
        call.plans = updated_plans(call.plans, update)
        self.record.updates_applied.append(update)
        return True

    def _run_call(self, call: Call, grace_s: float) -> None:
        if call.shards is not None:
            call.results = self._evaluate(call.shards, call.split)
            return
        plans = call.plans
        self.record.segments += 1
        if self._broken:
            call.outcomes = [WorkerOutcome(w, lost=LOST) if self._dead(w)
                             else peer_failed(w, [], PEER_LEFT, 0.0) for w in plans]
            return
        call.outcomes = self._train(plans, grace_s)
        self._broken = any(o.failed for o in call.outcomes)
        if not self._broken and self.faults:
            self._lose_results(call, grace_s)

    def _lose_results(self, call: Call, grace_s: float) -> None:
        """The fault script's ``lose_result``: every collective of the segment completed,
        but a worker's result is lost with its process, which dies one step into the next
        segment. A segment already sent ahead runs now, with it, as on Ray."""
        seg = next(iter(call.plans.values()))
        if not seg.steps:
            return
        lost = [w for w in call.plans
                if self.faults.result_lost(self.ordinals[w], seg.epoch, seg.steps[-1].step)]
        if lost:
            self._calls.run_through(None, grace_s)
            call.outcomes = [WorkerOutcome(o.worker, lost=LOST) if o.worker in lost else o
                             for o in call.outcomes]

    def regroup(self, generation: int, members: Sequence[str], state: dict[str, Any] | None,
                timeout_s: float) -> RegroupResult:
        self.record.regroups += 1
        t0 = self.clock.now()
        self._advance(t0)
        self._calls_kill("die_in_regroup", members, t0)
        rec = self.cluster.spec.recovery
        end = t0 + rec.regroup_s + self.cluster.broadcast_s()
        hit = self._advance(end, watch=members)
        lost = {w: "lost while joining the group: died (simulated)"
                for w in members if self._dead(w)}
        if lost:
            t_fail = hit if hit is not None else min(self._death_time(w) for w in lost)
            self.clock.advance_to(max(t0, t_fail + rec.detect_s))
            others = [w for w in members if w not in lost]
            return RegroupResult(lost, "; ".join(f"{w}: rendezvous timed out" for w in others)
                                 or None)
        self.clock.advance_to(end)
        self._broken = False
        if self.gradients is not None:
            self.gradients.load_state(state, list(members))
        return RegroupResult({})

    def _calls_kill(self, kind: str, workers: Sequence[str], t: float) -> None:
        """The fault script's ``die_in_*``: a worker's process dies in its nth such call."""
        for w in workers:
            if not self._dead(w) and self.faults.counted(kind, self.workers[w].ordinal):
                self._process_dies(w, t)

    def submit_evaluation(self, shards: dict[str, tuple[int, int]],
                          split: str = "test") -> Call:
        return self._calls.send(Call(shards=dict(shards), split=split))

    def poll_evaluation(self, ticket: Call, timeout_s: float) -> list[ShardResult]:
        """Its shards once it ran: it runs now when only evaluations are before it (the
        workers would start it at once), or when the driver waits (the segments before it
        run in the wait, as on Ray)."""
        if not ticket.ran and (timeout_s > 0 or not self._calls.segments_before(ticket)):
            self._calls.run_through(ticket, 0.0)
        if not ticket.ran or ticket.delivered:
            return []
        ticket.delivered = True
        return list(ticket.results or [])

    def _evaluate(self, shards: dict[str, tuple[int, int]],
                  split: str = "test") -> list[ShardResult]:
        """Each worker scores its shard in its node's ``e_s`` per sample (times the node's
        slowdown events; the spec's emulated slowdowns pace training only, as on Ray), all
        at once: the clock moves to the slowest shard's end, and the calls behind start
        there. A worker whose node goes down before its shard is scored loses it."""
        self.record.evaluations += 1
        t0 = self.clock.now()
        self._advance(t0)
        self._calls_kill("die_in_evaluation", list(shards), t0)
        took = {w: (self.workers[w].node.e_s * self.workers[w].node.factor * (hi - lo)
                    if not self._dead(w) else 0.0) for w, (lo, hi) in shards.items()}
        end = t0 + max(took.values(), default=0.0)
        if end > t0:
            self._advance(end)
            self.clock.advance_to(end)
        out = []
        for w, (lo, hi) in shards.items():
            if self._dead(w) and (took[w] == 0.0 or self._death_time(w) < t0 + took[w]):
                out.append(ShardResult(w, error="worker process died or node lost (simulated)",
                                       lost=True))
            elif (error := self.faults.eval_error(self.workers[w].ordinal)) is not None:
                out.append(ShardResult(w, seconds=took[w], error=error))  # it stays up
            elif self.gradients is None:
                # No model in timing-only mode: the record says so (no loss, no accuracy).
                out.append(ShardResult(w, {"n": float(hi - lo)}, seconds=took[w]))
            else:
                sums = self.gradients.eval_sums(w, lo, hi, split=split)
                out.append(ShardResult(w, sums, seconds=took[w]))
        return out

    def finish_evaluation(self, sums: dict[str, float]) -> dict[str, float]:
        return self.gradients.finish(sums) if self.gradients is not None else {}

    def fetch_state(self, worker: str, timeout_s: float) -> dict[str, Any]:
        self.record.fetches += 1
        self._advance(self.clock.now())
        self._calls_kill("die_in_checkpoint", [worker], self.clock.now())
        self._check_alive(worker)
        return self.gradients.state(worker) if self.gradients is not None else {}

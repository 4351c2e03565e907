"""The simulator's runtime: :class:`SimRuntime`, a
:class:`~dynabatch.scheduler.runtime.seam.Runtime` on a virtual clock. It answers the
coordinator's calls from its :class:`~dynabatch.scheduler.sim.world.SimWorld` (the cluster's
nodes, events and workers) and moves the clock by the time each call would take.

What each call costs (formulas in :mod:`dynabatch.scheduler.sim.cost_model`):

* ``submit_segment``/``collect_segment``: calls run in the order sent, when collected
  (:mod:`dynabatch.scheduler.sim.calls`): a segment sent ahead starts where the one before
  it ended, with no bubble, as on Ray. After a failed segment the workers have left the
  group, so a segment queued behind it trains nothing until the next regroup.
  ``update_segment`` applies a plan update to the segment queued from its ``at_step`` on
  every worker, or refuses it when the workers have started that step (the segment's
  first: it started when the one before ended), as on Ray.
* a segment, step by step: ``max_i t_i(b_i) + t_ar(n, m)``; each worker reports what a
  real worker reports (its order positions, its compute and wait, the step's coverage as the
  all-reduce would sum it). With ISGD, the batch loss rides in the gradient's all-reduce
  (the loss slot: no collective of its own), and each
  extra iteration is one more pass (every share's compute again and its all-reduce); the
  step's ``compute_s`` stays its own pass, as on Ray. A node that fails during a step takes
  the step down: the worker on it is lost, its peers answer with a peer error once they
  finished computing and the failure was detected (``detect_s`` after it). A worker
  computing past the collective timeout makes its peers time out (a straggler); the job
  spec's injected errors raise in compute.
* ``regroup``: ``regroup_s`` plus the state broadcast; a member whose node died fails it.
* ``spawn``/``poll_started``: a worker is up ``start_s`` after it was spawned.
* evaluation (queued like a segment: it scores the weights the calls before it leave) and
  ``fetch_state``: free. Each holder's shard of the held-out set is
  scored at once (with real gradients, on the one model replica, which every holder's
  weights equal); a holder whose node died loses its shard, and the epoch its scores, as on
  Ray. Timing-only runs have no model: evaluation gives no loss and no accuracy (None), and
  the training loss of their records is 0.

Cluster events happen in the world (:mod:`dynabatch.scheduler.sim.world`). The job spec's
``emulation`` (slowdowns, disturbances, injected errors) applies per worker ordinal, as on
Ray, on top of the cluster's own speeds. The simulator writes no checkpoints (the spec's
``checkpoint`` is dropped): a job that loses every holder of its state fails, as a job
without checkpoints does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from dynabatch.actors.accumulate import micro_cap
from dynabatch.actors.contracts import (
    Coverage,
    SegmentPlan,
    SegmentResult,
    StepPlan,
    StepTelemetry,
    encode_counts,
)
from dynabatch.actors.emulation import error_at, slowdown_at
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.core.sync.update import updated_plans
from dynabatch.scheduler.runtime.seam import DataInfo, RegroupResult, ShardResult
from dynabatch.scheduler.sim.calls import Call, CallQueue
from dynabatch.scheduler.sim.cost_model import SimulatedCluster, compute_time, jitter
from dynabatch.scheduler.sim.timeline import Recovery, SimClock
from dynabatch.scheduler.sim.world import SimWorld

if TYPE_CHECKING:
    from dynabatch.scheduler.sim.gradients import GradientEngine

_Steps = dict[str, list[StepTelemetry]]  # per worker, the steps it completed in a segment

LOST = "died: worker process died or node lost (simulated node failure)"
PEER_LOST = "DistBackendError: connection closed by peer (simulated: a peer's node failed)"
PEER_TIMEOUT = "DistBackendError: collective timed out (simulated)"
PEER_LEFT = "DistBackendError: a peer left the group after its own error (simulated)"


class SimRuntime(SimWorld):
    """A :class:`~dynabatch.scheduler.runtime.seam.Runtime` on a virtual clock (see the module
    docstring)."""

    def __init__(self, spec: JobSpec, cluster: SimulatedCluster, *, clock: SimClock,
                 data: DataInfo, gradients: GradientEngine | None = None):
        super().__init__(spec, cluster, clock=clock, data=data)
        self.gradients = gradients
        self.recoveries: list[Recovery] = []
        self._failed: tuple[float, tuple[str, ...]] | None = None
        self.steps_completed = 0
        self.segment_calls = 0
        self._calls = CallQueue(self._run_call)
        # The last segment failed: every worker left the group until the next regroup.
        self._broken = False
        # The all-reduce moves the cluster's model_mb, or the real model's gradients when the
        # cluster gave no size and real-gradient mode knows it.
        self._model_bytes: float | None = None
        if cluster.spec.allreduce.model_mb == 0 and gradients is not None:
            self._model_bytes = float(gradients.model_bytes)

    # --- Runtime: training --------------------------------------------------------------------
    def submit_segment(self, plans: dict[str, SegmentPlan]) -> Call:
        return self._calls.send(Call(plans=dict(plans)))

    def collect_segment(self, ticket: Call, grace_s: float) -> list[WorkerOutcome]:
        self._calls.run_through(ticket, grace_s)
        return ticket.outcomes or []

    def update_segment(self, update: Any, timeout_s: float) -> bool:
        call = self._calls.queued_segment(update.epoch, update.at_step)
        if call is None:
            return False
        seg = next(iter(call.plans.values()))
        if not seg.updates or update.at_step == seg.steps[0].step:
            return False  # its workers claim no step, or have started this one
        call.plans = updated_plans(call.plans, update)
        return True

    def _run_call(self, call: Call, grace_s: float) -> None:
        if call.shards is not None:
            call.results = self._evaluate(call.shards)
            return
        plans = call.plans
        if self._broken:
            call.outcomes = [WorkerOutcome(w, lost=LOST) if self._dead(w) else WorkerOutcome(
                w, result=SegmentResult(worker=w, steps=[], error=PEER_LEFT,
                                        error_kind="peer", failed_compute_s=0.0))
                for w in plans]
            return
        call.outcomes = self._train(plans, grace_s)
        self._broken = any(o.failed for o in call.outcomes)

    def _train(self, plans: dict[str, SegmentPlan], grace_s: float) -> list[WorkerOutcome]:
        self.segment_calls += 1
        names = list(plans)
        first = plans[names[0]]
        n = len(names)
        steps: _Steps = {w: [] for w in names}
        rng = self.cluster.rng
        sigma = self.cluster.spec.noise_sigma
        timeout = self.spec.collective_timeout_s
        arrays_version = -1
        a = c = factor = np.zeros(n)
        isgd = first.isgd  # ISGD's chart, kept up to date step by step as the workers do
        # Each worker's micro-batch cap, from its ordinal, as the Ray worker derives its own.
        caps = ([micro_cap(self.spec.micro_batch, self.ordinals[w]) for w in names]
                if self.gradients is not None else None)
        for j in range(len(first.steps)):
            t0 = self.clock.now()
            step = first.steps[j].step
            self._advance(t0)
            self._fire_step_events(first.epoch, step, t0)
            if any(w not in self.workers for w in names):  # killed under the plan
                return self._lost(names, steps, np.zeros(n), t0)
            if arrays_version != self._version:
                nodes = [self.workers[w].node for w in names]
                a = np.fromiter((x.a_s for x in nodes), np.float64, n)
                c = np.fromiter((x.c_s for x in nodes), np.float64, n)
                factor = np.fromiter((x.factor for x in nodes), np.float64, n)
                arrays_version = self._version
            sps = [plans[w].steps[j] for w in names]
            b = np.fromiter((sp.own_size for sp in sps), np.int64, n)
            # A worker reports only its emulated slowdown, as on Ray: a node that is slow (or
            # slows down) does not know it.
            emu = self._emulated(names, first.epoch, step) if self.spec.emulated else np.ones(n)
            compute = compute_time(a, c, b, factor * emu, jitter(rng, sigma, n))
            size = sps[0].size
            end = t0 + float(compute.max()) + self.cluster.allreduce_s(n, size, self._model_bytes)
            # Events during the step happen at their time; one that takes a participant's
            # node down ends the step there (later events wait for their own time).
            self._advance(end, watch=names)
            if any(self._dead(w) for w in names):
                return self._lost(names, steps, compute, t0)
            erred = self._erring(names, first.epoch, step)
            if erred:
                return self._compute_error(names, steps, erred, compute, t0)
            enter = t0 + compute
            first_in = float(enter.min())
            if float(enter.max()) - first_in > timeout:
                return self._timed_out(names, steps, compute, enter, first_in + timeout, grace_s)
            self.clock.advance_to(end)
            if self._failed is not None:
                t_fail, lost = self._failed
                self.recoveries.append(Recovery(t_fail, lost, t0))
                self._failed = None
            wait = (end - t0) - compute  # the all-reduce, including the wait for the slowest
            coverage = _coverage(sps, b, size)
            charting = isgd is not None
            rule = isgd.rule() if charting else None
            out = (self.gradients.step(first.seed, first.epoch, first.dataset_size, sps, rule,
                                       caps=caps)
                   if self.gradients is not None else None)
            losses = out.losses if out is not None else None
            if isgd is not None:
                # ISGD, as on the workers: the batch loss rides in the gradient's all-reduce
                # (its loss slot, beside the coverage: no cost of its own), and each extra
                # iteration is one more pass over every share (the compute again) with its
                # all-reduce. The step's compute_s stays its own pass (what the policy plans
                # with); the clock pays them all.
                extra = out.extra_iters if out is not None else 0
                end += extra * (end - t0)
                self.clock.advance_to(end)
                isgd = isgd.after(out.psi if out is not None else 0.0)
            slow, comp, waits = emu.tolist(), compute.tolist(), wait.tolist()
            for i, (w, sp) in enumerate(zip(names, sps, strict=True)):
                steps[w].append(StepTelemetry(
                    worker=w, epoch=first.epoch, step=sp.step, batch=sp.own_size,
                    samples=sp.own_size, compute_s=comp[i], wait_s=waits[i],
                    loss_sum=losses[i] if losses is not None else 0.0, slowdown=slow[i],
                    start=sp.own_start, step_start=sp.start, step_size=sp.size,
                    coverage=coverage,
                    flagged=out.flagged if out is not None else False,
                    extra_iters=out.extra_iters if out is not None else 0,
                    isgd_loss=out.psi if out is not None and charting else None,
                    local_sqnorm=out.local_sqnorms[i] if out and out.local_sqnorms else None,
                    global_sqnorm=out.global_sqnorm if out is not None else None))
            self.steps_completed += 1
        return [WorkerOutcome(w, result=SegmentResult(worker=w, steps=steps[w])) for w in names]

    def _emulated(self, names: Sequence[str], epoch: int, step: int) -> np.ndarray:
        em = self.spec.emulation
        return np.array([slowdown_at(em, self.workers[w].ordinal, epoch, step) for w in names])

    def _erring(self, names: Sequence[str], epoch: int, step: int) -> list[str]:
        em = self.spec.emulation
        if not em.errors:
            return []
        return [w for w in names if error_at(em, self.workers[w].ordinal, epoch, step)]

    def _lost(self, names: list[str], steps: _Steps, compute: np.ndarray,
              t0: float) -> list[WorkerOutcome]:
        """Nodes failed before or during this step: it fails for everyone. The survivors
        answer once they finished computing and the failure was detected."""
        lost = [w for w in names if self._dead(w)]
        t_fail = min(self._death_time(w) for w in lost)
        detect = self.cluster.spec.recovery.detect_s
        survivors = [i for i, w in enumerate(names) if w not in lost]
        done = max((t0 + float(compute[i]) for i in survivors), default=t0)
        self.clock.advance_to(max(done, t_fail + detect))
        if self._failed is None:
            self._failed = (t_fail, tuple(lost))
        out = []
        for i, w in enumerate(names):
            if w in lost:
                out.append(WorkerOutcome(w, lost=LOST))
            else:
                out.append(WorkerOutcome(w, result=SegmentResult(
                    worker=w, steps=steps[w], error=PEER_LOST, error_kind="peer",
                    failed_compute_s=float(compute[i]))))
        return out

    def _compute_error(self, names: list[str], steps: _Steps, erred: list[str],
                       compute: np.ndarray, t0: float) -> list[WorkerOutcome]:
        """An injected error raises at the start of compute; the worker leaves the group, so
        its peers' collective fails as soon as they reach it."""
        self.clock.advance_to(t0 + float(compute.max()))
        out = []
        for i, w in enumerate(names):
            if w in erred:
                ordinal = self.workers[w].ordinal
                res = SegmentResult(worker=w, steps=steps[w], error_kind="compute",
                                    error=f"InjectedFault: injected error (worker {ordinal})",
                                    failed_compute_s=0.0)
            else:
                res = SegmentResult(worker=w, steps=steps[w], error=PEER_LEFT,
                                    error_kind="peer", failed_compute_s=float(compute[i]))
            out.append(WorkerOutcome(w, result=res))
        return out

    def _timed_out(self, names: list[str], steps: _Steps, compute: np.ndarray,
                   enter: np.ndarray, t_fail: float, grace_s: float) -> list[WorkerOutcome]:
        """The first worker into the all-reduce timed out waiting for one still computing;
        the others fail with it. One computing past ``grace_s`` after that is hung."""
        deadline = t_fail + grace_s
        self.clock.advance_to(min(float(enter.max()), deadline))
        if self._failed is None:
            self._failed = (t_fail, tuple(w for i, w in enumerate(names) if enter[i] > t_fail))
        out = []
        for i, w in enumerate(names):
            if enter[i] > deadline:
                out.append(WorkerOutcome(w, lost="hung: no answer after its peers failed"))
            else:
                out.append(WorkerOutcome(w, result=SegmentResult(
                    worker=w, steps=steps[w], error=PEER_TIMEOUT, error_kind="peer",
                    failed_compute_s=float(compute[i]))))
        return out

    def regroup(self, generation: int, members: Sequence[str], state: dict[str, Any] | None,
                timeout_s: float) -> RegroupResult:
        t0 = self.clock.now()
        self._advance(t0)
        rec = self.cluster.spec.recovery
        end = t0 + rec.regroup_s + self.cluster.broadcast_s()
        hit = self._advance(end, watch=members)
        lost = {w: "lost while joining the group: died (simulated node failure)"
                for w in members if self._dead(w)}
        if lost:
            t_fail = hit if hit is not None else min(self._death_time(w) for w in lost)
            self.clock.advance_to(max(t0, t_fail + rec.detect_s))
            others = [w for w in members if w not in lost]
            return RegroupResult(lost, "; ".join(f"{w}: rendezvous timed out" for w in others)
                                 or None)
        self.clock.advance_to(end)
        self._broken = False
        if state is not None and self.gradients is not None:
            self.gradients.load_state(state)
        return RegroupResult({})

    def submit_evaluation(self, shards: dict[str, tuple[int, int]]) -> Call:
        return self._calls.send(Call(shards=dict(shards)))

    def poll_evaluation(self, ticket: Call, timeout_s: float) -> list[ShardResult]:
        """Its shards once it ran: it runs now when only evaluations (free) are before it,
        or when the driver waits (the segments before it run in the wait, as on Ray)."""
        if not ticket.ran and (timeout_s > 0 or not self._calls.segments_before(ticket)):
            self._calls.run_through(ticket, 0.0)
        if not ticket.ran or ticket.delivered:
            return []
        ticket.delivered = True
        return list(ticket.results or [])

    def _evaluate(self, shards: dict[str, tuple[int, int]]) -> list[ShardResult]:
        self._advance(self.clock.now())
        out = []
        for w, (lo, hi) in shards.items():
            if self._dead(w):
                out.append(ShardResult(w, error="worker process died or node lost (simulated)",
                                       lost=True))
            elif self.gradients is None:
                # No model in timing-only mode: the record says so (no loss, no accuracy).
                out.append(ShardResult(w, {"n": float(hi - lo)}))
            else:
                out.append(ShardResult(w, self.gradients.eval_sums(lo, hi)))
        return out

    def finish_evaluation(self, sums: dict[str, float]) -> dict[str, float]:
        return self.gradients.finish(sums) if self.gradients is not None else {}

    def fetch_state(self, worker: str, timeout_s: float) -> dict[str, Any]:
        self._check_alive(worker)
        return self.gradients.state() if self.gradients is not None else {}


def _coverage(sps: Sequence[StepPlan], b: np.ndarray, size: int) -> Coverage:
    """The step's per-position count as the SUM all-reduce builds it: each worker writes 1
    at the positions it trained."""
    lo = np.fromiter((sp.own_start - sp.start for sp in sps), np.int64, len(sps))
    counts = (np.bincount(lo, minlength=size + 1)[:size + 1]
              - np.bincount(lo + b, minlength=size + 1)[:size + 1])
    return encode_counts(np.cumsum(counts[:size]))


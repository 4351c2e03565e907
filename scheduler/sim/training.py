"""A simulated segment, step by step: :class:`SimTraining`, the part of the simulator's
runtime that trains, on top of the world (:mod:`dynabatch.scheduler.sim.world`). A step takes
``max_i t_i(b_i) + t_ar(n, m)`` (:mod:`dynabatch.scheduler.sim.cost_model`), a share in k
micro-batches paying ``a_i`` k times, and each ISGD extra iteration one more pass; each worker
reports what a real one reports. A node that fails during a step takes the step down: its
worker is lost, and its peers answer with a peer error once they finished computing and the
failure was detected (``detect_s`` after it). A worker computing past the collective timeout
makes its peers time out; the fault script's kinds are
:class:`~dynabatch.scheduler.sim.cluster_spec.Fault`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
from dynabatch.actors.accumulate import micro_cap, micro_ranges, tighter_cap
from dynabatch.actors.contracts import (
    Coverage,
    IsgdRule,
    SegmentPlan,
    SegmentResult,
    StepPlan,
    StepTelemetry,
    encode_counts,
)
from dynabatch.actors.emulation import slowdown_at
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.runtime.seam import DataInfo
from dynabatch.scheduler.sim.cost_model import SimulatedCluster, compute_time, jitter
from dynabatch.scheduler.sim.faults import StepFaults
from dynabatch.scheduler.sim.replicas import Replicas, StepOutcome
from dynabatch.scheduler.sim.timeline import Recovery, SimClock
from dynabatch.scheduler.sim.world import SimWorld

_Steps = dict[str, list[StepTelemetry]]  # per worker, the steps it completed in a segment

LOST = "died: worker process died or node lost (simulated)"
HUNG = "hung: no answer after its peers failed"
PEER_LOST = "DistBackendError: connection closed by peer (simulated: a peer's node failed)"
PEER_TIMEOUT = "DistBackendError: collective timed out (simulated)"
PEER_LEFT = "DistBackendError: a peer left the group after its own error (simulated)"


class SimTraining(SimWorld):
    """The world plus training: ``_train`` runs one segment's plans (see the module
    docstring)."""

    def __init__(
        self,
        spec: JobSpec,
        cluster: SimulatedCluster,
        *,
        clock: SimClock,
        data: DataInfo,
        gradients: Replicas | None = None,
    ):
        super().__init__(spec, cluster, clock=clock, data=data)
        self.gradients = gradients
        self.recoveries: list[Recovery] = []
        self._failed: tuple[float, tuple[str, ...]] | None = None
        # The all-reduce moves the cluster's model_mb, or the real model's gradients when the
        # cluster gave no size and real-gradient mode knows it.
        self._model_bytes: float | None = None
        if cluster.spec.allreduce.model_mb == 0 and gradients is not None:
            self._model_bytes = float(gradients.model_bytes)

    def _train(self, plans: dict[str, SegmentPlan], grace_s: float) -> list[WorkerOutcome]:
        self.record.note_trained(plans)
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
        # Each worker's micro-batch cap, as the Ray worker computes under it: the tighter of
        # the spec's (by its ordinal) and the plan's (learned from an out-of-memory error).
        caps = [
            tighter_cap(micro_cap(self.spec.micro_batch, self.ordinals[w]), plans[w].micro_cap)
            for w in names
        ]
        capped = any(cap is not None for cap in caps)
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
            # k micro-batches pay the per-step cost k times: (k·a + c·b).
            micro = _micro_batches(b, caps) if capped else None
            compute = compute_time(
                a if micro is None else a * micro, c, b, factor * emu, jitter(rng, sigma, n)
            )
            hit = None
            if self.faults:
                # Dying processes die as the step starts; hung and slow ones compute longer.
                hang_s = float(compute.max()) + timeout + grace_s + 1.0
                ordinals = [self.workers[w].ordinal for w in names]
                hit = self.faults.step(names, ordinals, first.epoch, step, b, caps, compute, hang_s)
                for w in hit.died:
                    self._process_dies(w, t0)
            end = (
                t0
                + float(compute.max())
                + self.cluster.allreduce_s(n, sps[0].size, self._model_bytes)
            )
            # Events during the step happen at their time; one that takes a participant's
            # node down ends the step there (later events wait for their own time).
            self._advance(end, watch=names)
            rule = isgd.rule() if isgd is not None else None
            report = partial(self._report, steps, names, first, sps, b, compute, emu, micro,
                             caps, rule)
            lucky = self._lucky(names, hit)
            if any(self._dead(w) for w in names):
                if lucky is not None:
                    report(only=lucky)
                return self._lost(names, steps, compute, t0)
            if hit is not None and hit.errors:
                return self._compute_error(names, steps, hit.errors, compute, t0)
            enter = t0 + compute
            first_in = float(enter.min())
            if float(enter.max()) - first_in > timeout:
                if lucky is not None:
                    report(only=lucky)
                out = self._timed_out(names, steps, compute, enter, first_in + timeout, grace_s)
                for w in hit.hung if hit is not None else ():
                    self._process_dies(w, self.clock.now())  # it answers nothing from now on
                return out
            self.clock.advance_to(end)
            if self._failed is not None:
                t_fail, lost = self._failed
                self.recoveries.append(Recovery(t_fail, lost, t0))
                self._failed = None
            out = report(wait=(end - t0) - compute)
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
        return [WorkerOutcome(w, result=SegmentResult(worker=w, steps=steps[w])) for w in names]

    def _report(
        self,
        steps: _Steps,
        names: list[str],
        first: SegmentPlan,
        sps: list[StepPlan],
        b: np.ndarray,
        compute: np.ndarray,
        emu: np.ndarray,
        micro: np.ndarray | None,
        caps: list[int | None],
        rule: IsgdRule | None,
        *,
        wait: np.ndarray | None = None,
        only: str | None = None,
    ) -> StepOutcome | None:
        """The step of the shares ``sps`` applied, by every worker or ``only`` one (the
        survivor whose all-reduce completed before a peer broke off): the model's step, and
        each applying worker's report of it."""
        size = sps[0].size
        workers = names if only is None else [only]
        out = (
            self.gradients.step(
                first.seed, first.epoch, first.dataset_size, sps, rule, caps=caps, workers=workers
            )
            if self.gradients is not None
            else None
        )
        losses = out.losses if out is not None else None
        coverage = _coverage(sps, b, size)
        charting = first.isgd is not None
        wait = wait if wait is not None else np.zeros(len(names))
        slow, comp, waits = emu.tolist(), compute.tolist(), wait.tolist()
        for i, (w, sp) in enumerate(zip(names, sps, strict=True)):
            if w not in workers:
                continue
            steps[w].append(
                StepTelemetry(
                    worker=w,
                    epoch=first.epoch,
                    step=sp.step,
                    batch=sp.own_size,
                    samples=sp.own_size,
                    compute_s=comp[i],
                    wait_s=waits[i],
                    step_s=comp[i] + waits[i],  # the step by the worker's clock, as on Ray
                    loss_sum=losses[i] if losses is not None else 0.0,
                    slowdown=slow[i],
                    start=sp.own_start,
                    step_start=sp.start,
                    step_size=sp.size,
                    coverage=coverage,
                    flagged=out.flagged if out is not None else False,
                    extra_iters=out.extra_iters if out is not None else 0,
                    isgd_loss=out.psi if out is not None and charting else None,
                    local_sqnorm=out.local_sqnorms[i] if out and out.local_sqnorms else None,
                    global_sqnorm=out.global_sqnorm if out is not None else None,
                    micro_cap=caps[i],
                    micro_batches=int(micro[i]) if micro is not None else 1,
                )
            )
        return out

    def _lucky(self, names: list[str], hit: StepFaults | None) -> str | None:
        """With an ``uneven`` failure and no error, the first survivor, whose all-reduce of
        the failing step completed before the peer broke off."""
        if hit is None or not hit.uneven or hit.errors:
            return None
        return next((w for w in names if not self._dead(w) and w not in hit.hung), None)

    def _emulated(self, names: Sequence[str], epoch: int, step: int) -> np.ndarray:
        em = self.spec.emulation
        return np.array([slowdown_at(em, self.workers[w].ordinal, epoch, step) for w in names])

    def _lost(
        self, names: list[str], steps: _Steps, compute: np.ndarray, t0: float
    ) -> list[WorkerOutcome]:
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
        return _answers(names, steps, compute, {w: WorkerOutcome(w, lost=LOST) for w in lost},
                        PEER_LOST)

    def _compute_error(
        self,
        names: list[str],
        steps: _Steps,
        erred: dict[str, tuple[str, str, int | None]],
        compute: np.ndarray,
        t0: float,
    ) -> list[WorkerOutcome]:
        """An error (``erred``: worker -> kind, message, the micro-batch an out-of-memory
        error tried) raises at the start of compute; the worker leaves the group, so its
        peers' collective fails as soon as they reach it."""
        self.clock.advance_to(t0 + float(compute.max()))
        own = {
            w: WorkerOutcome(w, result=SegmentResult(worker=w, steps=steps[w], error_kind=kind,
                                                     error=message, failed_compute_s=0.0,
                                                     oom_batch=oom_batch))
            for w, (kind, message, oom_batch) in erred.items()
        }
        return _answers(names, steps, compute, own, PEER_LEFT)

    def _timed_out(
        self,
        names: list[str],
        steps: _Steps,
        compute: np.ndarray,
        enter: np.ndarray,
        t_fail: float,
        grace_s: float,
    ) -> list[WorkerOutcome]:
        """The first worker into the all-reduce timed out waiting for one still computing;
        the others fail with it. One computing past ``grace_s`` after that is hung."""
        deadline = t_fail + grace_s
        self.clock.advance_to(min(float(enter.max()), deadline))
        if self._failed is None:
            self._failed = (t_fail, tuple(w for i, w in enumerate(names) if enter[i] > t_fail))
        hung = {w: WorkerOutcome(w, lost=HUNG) for i, w in enumerate(names) if enter[i] > deadline}
        return _answers(names, steps, compute, hung, PEER_TIMEOUT)


def peer_failed(
    worker: str, steps: list[StepTelemetry], error: str, compute_s: float
) -> WorkerOutcome:
    """A worker whose collective failed because of a peer, after ``steps``."""
    return WorkerOutcome(
        worker,
        result=SegmentResult(
            worker=worker, steps=steps, error=error, error_kind="peer", failed_compute_s=compute_s
        ),
    )


def _answers(names: list[str], steps: _Steps, compute: np.ndarray,
             own: dict[str, WorkerOutcome], peer_error: str) -> list[WorkerOutcome]:
    """Each worker's answer to a failed step: its own failure (``own``), else ``peer_error``
    once it finished computing."""
    return [own[w] if w in own else peer_failed(w, steps[w], peer_error, float(compute[i]))
            for i, w in enumerate(names)]


def _micro_batches(b: np.ndarray, caps: Sequence[int | None]) -> np.ndarray:
    """How many micro-batches each share of ``b`` samples is computed in under its cap."""
    k = [max(1, len(micro_ranges(int(x), cap))) for x, cap in zip(b, caps, strict=True)]
    return np.array(k, dtype=np.int64)


def _coverage(sps: Sequence[StepPlan], b: np.ndarray, size: int) -> Coverage:
    """The step's per-position count as the SUM all-reduce builds it: each worker writes 1
    at the positions it trained."""
    lo = np.fromiter((sp.own_start - sp.start for sp in sps), np.int64, len(sps))
    counts = (
        np.bincount(lo, minlength=size + 1)[: size + 1]
        - np.bincount(lo + b, minlength=size + 1)[: size + 1]
    )
    return encode_counts(np.cumsum(counts[:size]))

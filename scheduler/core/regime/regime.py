"""The training regime of a job: its schedule, ISGD chart and goodput estimate, as the
coordinator consults them. Pure: events in, decisions out. The coordinator asks it for each
epoch's global batch, has it stamp each plan's steps (learning rate, noise request, ISGD
chart), feeds it every committed step's reports (the ISGD chart is replayed from them and the
workers' decisions checked) and closes each epoch with it, which in goodput mode decides the
next epoch's batch. Its state (:meth:`Regime.to_state`) goes into checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dynabatch.actors.contracts import SegmentPlan, StepTelemetry
from dynabatch.scheduler.core.regime.goodput import (
    NoiseEstimate,
    choose_batch,
    gain,
    step_time_model,
)
from dynabatch.scheduler.core.regime.isgd import ControlChart, judge, plan_for
from dynabatch.scheduler.core.regime.schedule import Schedule
from dynabatch.scheduler.core.sync.steptime import StepTimeStats

# Goodput's step-time statistics fade by this factor at each epoch's end: older epochs
# (other batch sizes) still identify each worker's fixed cost, a changed speed shows soon.
EPOCH_DECAY = 0.5


@dataclass
class _EpochCounts:
    flagged: int = 0
    extra_iterations: int = 0
    grad_evals: int = 0  # samples whose gradient was computed (extra iterations included)
    steps: int = 0
    overhead_s: float = 0.0  # summed per-step time outside compute (goodput's model)
    overhead_steps: int = 0


class Regime:
    def __init__(self, spec, lr_factors: tuple[float, ...] = ()) -> None:
        # lr_factors: the spec's LR scheduler per epoch (computed with torch, outside).
        self.schedule = Schedule.from_spec(spec, lr_factors)
        self.base_batch = spec.global_batch
        self.mode = spec.schedule.mode
        self.lo, self.hi = spec.batch_range
        n = spec.initial_workers
        self.lo = max(self.lo, n or 1)
        i = spec.isgd
        self.isgd = i if i.enabled else None
        # ``window: epoch``: n_b follows the steps per epoch (set when a segment is stamped).
        self._window_epoch = i.enabled and i.window == "epoch"
        self.chart = (ControlChart(2 if self._window_epoch else i.window, i.sigma)
                      if i.enabled else None)
        self.noise = NoiseEstimate()
        self.population: int | None = None  # training samples (the noise's FPC)
        self.goodput_batch: int | None = None  # goodput mode: the batch chosen for now on
        self.grad_evals_total = 0
        self.flagged_total = 0
        self.extra_total = 0
        self._ep = _EpochCounts()
        self._times: dict[str, StepTimeStats] = {}  # goodput: each worker's (b, t) reports
        self._seen: set[str] = set()  # workers that reported in the open epoch

    # --- decisions --------------------------------------------------------------------
    def batch_for(self, epoch: int) -> int:
        if self.mode == "goodput":
            return self.goodput_batch or min(max(self.base_batch, self.lo), self.hi)
        return self.schedule.batch_at(epoch)

    def lr_factor(self, batch: int) -> float | None:
        """Goodput mode's AdaScale gain at ``batch``; None (the schedule's stage factor)
        otherwise."""
        if self.mode != "goodput":
            return None
        ns = self.noise.noise_scale
        return 1.0 if ns is None else gain(batch, self.base_batch, ns, self.population)

    def stamp(self, plans: dict[str, SegmentPlan], steps_per_epoch: int
              ) -> dict[str, SegmentPlan]:
        """The plans with each step's learning rate and noise request, and the segment's
        ISGD chart (the workers keep it up to date step by step: see
        :class:`~dynabatch.actors.contracts.IsgdPlan`)."""
        if not plans:
            return plans
        first = next(iter(plans.values()))
        self.population = first.dataset_size
        isgd = None
        if self.chart is not None:
            if self._window_epoch:
                self.chart = self.chart.resized(max(2, steps_per_epoch))
            isgd = plan_for(self.chart, first.epoch, self.isgd.epsilon, self.isgd.max_extra)
        noise = self.mode == "goodput"
        out = {}
        for w, plan in plans.items():
            steps = tuple(
                replace(sp, lr=self.schedule.lr_at(plan.epoch, sp.step, steps_per_epoch,
                                                   self.lr_factor(sp.size)), noise=noise)
                for sp in plan.steps)
            out[w] = replace(plan, steps=steps, isgd=isgd)
        return out

    # --- events -----------------------------------------------------------------------
    def observe(self, reports: list[StepTelemetry]) -> None:
        """One committed step: every worker's report of it. ISGD's decisions are checked
        against the replayed chart (:func:`dynabatch.scheduler.core.regime.isgd.judge` raises on a
        mismatch)."""
        if not reports:
            return
        size = reports[0].step_size
        flagged, extra = False, 0
        if self.chart is not None:
            rule = plan_for(self.chart, reports[0].epoch, self.isgd.epsilon,
                            self.isgd.max_extra).rule()
            psi, flagged, extra = judge(rule, reports)
            self.chart = self.chart.push(psi)
        ep = self._ep
        ep.steps += 1
        ep.flagged += int(flagged)
        ep.extra_iterations += extra
        # Every pass over the batch is one gradient per sample: the step's own and one per
        # extra iteration (each extra iteration is one conservative step and one pass).
        ep.grad_evals += size * (1 + extra)
        if self.mode == "goodput":
            self._observe_goodput(reports, size)

    def _observe_goodput(self, reports: list[StepTelemetry], size: int) -> None:
        for r in reports:
            if r.samples <= 0 or r.compute_s <= 0:
                continue
            k = max(r.micro_batches, 1)  # one observation per micro-batch, as the tracker
            s = self._times.get(r.worker, StepTimeStats())
            for _ in range(k):
                s = s.add(r.samples / k, r.compute_s / k)
            self._times[r.worker] = s
            self._seen.add(r.worker)
        # The rest of the step: the all-reduce not hidden behind compute (the slowest
        # worker waits only for it) and the optimizer.
        ep = self._ep
        ep.overhead_s += (min(r.wait_s for r in reports)
                          + max(r.optimizer_s for r in reports))
        ep.overhead_steps += 1
        pts = [(r.samples, r.local_sqnorm) for r in reports if r.local_sqnorm is not None]
        g = next((r.global_sqnorm for r in reports if r.global_sqnorm is not None), None)
        if pts and g is not None:
            self.noise = self.noise.observe([*pts, (size, g)], self.population)

    def end_epoch(self, epoch: int, global_batch: int, steps: int, wall_s: float
                  ) -> dict[str, Any]:
        """Close the epoch: its fields for the EpochRecord; goodput mode picks the next B."""
        ep = self._ep
        self.flagged_total += ep.flagged
        self.extra_total += ep.extra_iterations
        self.grad_evals_total += ep.grad_evals
        last_lr = self.schedule.lr_at(epoch, max(steps - 1, 0), steps,
                                      self.lr_factor(global_batch))
        fields: dict[str, Any] = {
            "global_batch": global_batch,
            "lr": last_lr,
            "isgd_flagged": ep.flagged,
            "isgd_extra_iterations": ep.extra_iterations,
            "grad_evals": ep.grad_evals,
        }
        if self.mode == "goodput":
            self.noise = self.noise.close()
            ns = self.noise.noise_scale
            overhead = ep.overhead_s / ep.overhead_steps if ep.overhead_steps else 0.0
            timing = step_time_model({w: s for w, s in self._times.items() if w in self._seen},
                                     overhead)
            b, _ = choose_batch(self.lo, self.hi, self.base_batch, ns, timing, self.population)
            self.goodput_batch = b
            fields["noise_scale"] = ns
            fields["goodput_batch"] = b
            k = EPOCH_DECAY
            self._times = {w: StepTimeStats(s.n * k, s.sb * k, s.st * k, s.sbb * k, s.sbt * k)
                           for w, s in self._times.items() if w in self._seen}
            self._seen = set()
        self._ep = _EpochCounts()
        return fields

    @property
    def grad_evals(self) -> int:
        """Samples whose gradient was computed so far (extra iterations included), the
        open epoch's too."""
        return self.grad_evals_total + self._ep.grad_evals

    def live(self, epoch: int, step: int, global_batch: int, steps_per_epoch: int
             ) -> dict[str, Any]:
        """The regime's fields of a :class:`~dynabatch.scheduler.telemetry.JobSnapshot`."""
        return {
            "global_batch": global_batch,
            "lr": self.schedule.lr_at(epoch, step, steps_per_epoch,
                                      self.lr_factor(global_batch)),
            "noise_scale": self.noise.noise_scale,
            "goodput_batch": self.goodput_batch,
            "isgd_flagged_total": self.flagged_total + self._ep.flagged,
            "isgd_extra_iterations_total": self.extra_total + self._ep.extra_iterations,
        }

    # --- checkpoints ------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """What a resume needs, mid-epoch included: goodput's batch, the ISGD chart, the
        noise estimate with the open epoch's statistics, and the counters. (Goodput's
        step-time statistics are not kept: a resumed job has new workers, and their first
        epoch's reports refit them.)"""
        return {
            "goodput_batch": self.goodput_batch,
            "chart": list(self.chart.losses) if self.chart is not None else [],
            "chart_window": self.chart.window if self.chart is not None else None,
            "noise": self.noise.to_state(),
            "population": self.population,
            "totals": [self.flagged_total, self.extra_total, self.grad_evals_total],
            "epoch_counts": [self._ep.flagged, self._ep.extra_iterations,
                             self._ep.grad_evals, self._ep.steps],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.goodput_batch = state.get("goodput_batch")
        if self.chart is not None:
            window = state.get("chart_window") or self.chart.window
            losses = tuple(float(x) for x in state.get("chart", []))[-window:]
            self.chart = ControlChart(window, self.chart.sigma, losses)
        self.noise = NoiseEstimate.from_state(state.get("noise", []))
        self.population = state.get("population")
        self.flagged_total, self.extra_total, self.grad_evals_total = state.get(
            "totals", [0, 0, 0])
        f, x, g, s = state.get("epoch_counts", [0, 0, 0, 0])
        self._ep = _EpochCounts(flagged=f, extra_iterations=x, grad_evals=g, steps=s)
        self._times, self._seen = {}, set()

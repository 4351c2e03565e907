"""The training regime of a job: its schedule, ISGD chart and goodput estimate, as the
coordinator consults them. Pure (no ray, no torch, no clock): events in, decisions out.

The coordinator asks it for each epoch's global batch (:meth:`Regime.batch_for`), has it
stamp each step of a plan with the step's learning rate, ISGD rule and noise request
(:meth:`Regime.stamp`), feeds it every committed step's reports (:meth:`Regime.observe`) and
closes each epoch with it (:meth:`Regime.end_epoch`), which returns the epoch's fields for the
:class:`~scheduler.telemetry.EpochRecord` and, in goodput mode, decides the next epoch's batch.
Its state (:meth:`to_state`) goes into checkpoints with the position.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from actors.contracts import SegmentPlan, StepTelemetry
from scheduler.goodput import NoiseEstimate, StepTimeModel, choose_batch, gain
from scheduler.isgd import ControlChart
from scheduler.schedule import Schedule


@dataclass
class _EpochCounts:
    flagged: int = 0
    extra_iterations: int = 0
    grad_evals: int = 0  # samples whose gradient was computed (extra iterations included)
    steps: int = 0


class Regime:
    def __init__(self, spec) -> None:
        self.schedule = Schedule.from_spec(spec)
        self.base_batch = spec.global_batch
        self.mode = spec.schedule.mode
        self.lo, self.hi = spec.batch_range
        n = spec.initial_workers
        self.lo = max(self.lo, n or 1)
        i = spec.isgd
        self.isgd = i if i.enabled else None
        self.chart = ControlChart(i.window, i.sigma) if i.enabled else None
        self.noise = NoiseEstimate()
        self.goodput_batch: int | None = None  # goodput mode: the batch chosen for now on
        self.grad_evals_total = 0
        self.flagged_total = 0
        self.extra_total = 0
        self._ep = _EpochCounts()
        self._rates: list[float] = []

    # --- decisions --------------------------------------------------------------------
    def batch_for(self, epoch: int) -> int:
        if self.mode == "goodput":
            return self.goodput_batch or self.base_batch
        return self.schedule.batch_at(epoch)

    def lr_factor(self, batch: int) -> float | None:
        """Goodput mode's AdaScale gain at ``batch``; None (the schedule's stage factor)
        otherwise."""
        if self.mode != "goodput":
            return None
        ns = self.noise.noise_scale
        return 1.0 if ns is None else gain(batch, self.base_batch, ns)

    @property
    def can_stamp_ahead(self) -> bool:
        """Whether a segment's stamps can be fixed before the one before it reports: true
        unless they depend on its losses (ISGD's control limit) or gradients (goodput's
        AdaScale gain)."""
        return self.chart is None and self.mode != "goodput"

    def stamp(self, plans: dict[str, SegmentPlan], steps_per_epoch: int
              ) -> dict[str, SegmentPlan]:
        """The plans with each step's learning rate, ISGD rule and noise request."""
        if not plans:
            return plans
        first = next(iter(plans.values()))
        rule = (self.chart.rule(first.epoch, self.isgd.epsilon, self.isgd.max_extra)
                if self.chart is not None else None)
        noise = self.mode == "goodput"
        out = {}
        for w, plan in plans.items():
            # ISGD: one step per segment, so every batch is judged against the limit of the
            # batches just before it, as in the paper (the protocol advances by what ran).
            todo = plan.steps[:1] if self.chart is not None else plan.steps
            steps = tuple(
                replace(sp, lr=self.schedule.lr_at(plan.epoch, sp.step, steps_per_epoch,
                                                   self.lr_factor(sp.size)),
                        isgd=rule, noise=noise)
                for sp in todo)
            out[w] = replace(plan, steps=steps)
        return out

    # --- events -----------------------------------------------------------------------
    def observe(self, reports: list[StepTelemetry]) -> None:
        """One committed step: every worker's report of it."""
        if not reports:
            return
        size = reports[0].step_size
        loss = sum(r.loss_sum for r in reports) / max(size, 1)
        if self.chart is not None:
            self.chart = self.chart.push(loss)
        extra = max(r.extra_iters for r in reports)
        ep = self._ep
        ep.steps += 1
        ep.flagged += int(any(r.flagged for r in reports))
        ep.extra_iterations += extra
        ep.grad_evals += size * (1 + extra)
        comp = sum(r.compute_s for r in reports)
        if comp > 0:
            self._rates.append(sum(r.samples for r in reports) / comp * len(reports))
        pts = [(r.samples, r.local_sqnorm) for r in reports if r.local_sqnorm is not None]
        g = next((r.global_sqnorm for r in reports if r.global_sqnorm is not None), None)
        if pts and g is not None:
            self.noise = self.noise.observe([*pts, (size, g)])

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
            ns = self.noise.noise_scale
            timing = None
            if self._rates and steps and wall_s > 0:
                rate = sorted(self._rates)[len(self._rates) // 2]
                per_step = wall_s / steps
                timing = StepTimeModel(max(0.0, per_step - global_batch / rate), rate)
            b, _ = choose_batch(self.lo, self.hi, self.base_batch, ns, timing)
            self.goodput_batch = b
            fields["noise_scale"] = ns
            fields["goodput_batch"] = b
        self._ep = _EpochCounts()
        self._rates = []
        return fields

    def live(self, epoch: int, step: int, global_batch: int, steps_per_epoch: int
             ) -> dict[str, Any]:
        """The regime's fields of a :class:`~scheduler.telemetry.JobSnapshot`."""
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
        return {
            "goodput_batch": self.goodput_batch,
            "chart": list(self.chart.losses) if self.chart is not None else [],
            "noise": [self.noise.grad_sq, self.noise.trace, self.noise.samples],
            "totals": [self.flagged_total, self.extra_total, self.grad_evals_total],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.goodput_batch = state.get("goodput_batch")
        if self.chart is not None:
            losses = tuple(float(x) for x in state.get("chart", []))[-self.chart.window:]
            self.chart = ControlChart(self.chart.window, self.chart.sigma, losses)
        g, t, n = state.get("noise", [0.0, 0.0, 0])
        self.noise = replace(self.noise, grad_sq=float(g), trace=float(t), samples=int(n))
        self.flagged_total, self.extra_total, self.grad_evals_total = state.get(
            "totals", [0, 0, 0])
        self._ep = _EpochCounts()

"""Per-worker telemetry the policy and the reports need. Pure: no ray, no torch, no clock.

For each worker it keeps the decayed step-time statistics of the affine model (older
observations fade by ``STATS_DECAY`` per new one, so the model follows a worker whose speed
changes), the window since the last decision (for DBS), and the epoch's totals.

A worker that computes its share in k micro-batches (its memory cap, ``micro_cap``) is
observed per micro-batch, (b/k, t/k), so the fit is the micro-batch's a and c; the policy
plans the accumulated step with them
(``dynabatch.scheduler.core.sync.steptime.accumulation_slope``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynabatch.actors.contracts import StepTelemetry
from dynabatch.scheduler.core.sync.allocation import WorkerTelemetry
from dynabatch.scheduler.core.sync.steptime import StepTimeStats, fit

STATS_DECAY = 0.9
# A segment whose mean compute is off the model by more than this factor is a change of
# speed (a disturbance), not noise: the worker's model restarts from the new observations.
# Rescaling the old fit by the observed ratio instead (right at once if a slowdown scales
# fixed and per-sample costs alike) was measured worse in bench/disturbance.py, side by
# side, 3 runs each: recovery in 23 steps against 11, balance 0.79 against 0.93. There the
# workers share cores, so the others speed up as the victim sleeps: its slowdown is not a
# uniform scale of the old model, and the new observations are the better prior.
SURPRISE = 1.5


@dataclass
class WorkerTrack:
    capacity: float
    stats: StepTimeStats = field(default_factory=StepTimeStats)
    observed_steps: int = 0
    window_samples: int = 0
    window_compute: float = 0.0
    epoch_samples: int = 0
    epoch_compute: float = 0.0
    epoch_wait: float = 0.0
    epoch_steps: int = 0
    compute_per_step: float = 0.0
    wait_per_step: float = 0.0
    slowdown: float = 1.0
    micro_cap: int | None = None

    @property
    def throughput(self) -> float:
        """Samples per compute-second: over the window, else from the last steps."""
        if self.window_compute:
            return self.window_samples / self.window_compute
        return 0.0


class Tracker:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerTrack] = {}

    def add(self, worker: str, capacity: float) -> None:
        self.workers.setdefault(worker, WorkerTrack(capacity))

    def remove(self, worker: str) -> None:
        self.workers.pop(worker, None)

    def telemetry(self, workers: Sequence[str], cap: int | None) -> list[WorkerTelemetry]:
        out = []
        for w in workers:
            t = self.workers[w]
            out.append(WorkerTelemetry(worker=w, samples=t.window_samples,
                                       compute_s=t.window_compute, cap=cap,
                                       capacity=t.capacity, stats=t.stats,
                                       micro=t.micro_cap))
        return out

    def decided(self) -> None:
        """A policy decision was taken: DBS measures the window since the last one."""
        for t in self.workers.values():
            t.window_samples, t.window_compute = 0, 0.0

    def begin_epoch(self) -> None:
        for t in self.workers.values():
            t.epoch_samples = t.epoch_steps = 0
            t.epoch_compute = t.epoch_wait = 0.0

    def observe(self, worker: str, steps: Iterable[StepTelemetry]) -> None:
        steps = list(steps)
        t = self.workers.get(worker)
        if t is None or not steps:
            return
        self._fit(t, steps)  # first: a change of speed restarts the window too
        samples = sum(s.samples for s in steps)
        compute = sum(s.compute_s for s in steps)
        t.window_samples += samples
        t.window_compute += compute
        t.epoch_samples += samples
        t.epoch_compute += compute
        t.epoch_wait += sum(s.wait_s for s in steps)
        t.epoch_steps += len(steps)
        t.compute_per_step = compute / len(steps)
        t.wait_per_step = sum(s.wait_s for s in steps) / len(steps)
        t.slowdown = steps[-1].slowdown
        t.micro_cap = steps[-1].micro_cap

    def _fit(self, t: WorkerTrack, steps: list[StepTelemetry]) -> None:
        first = t.observed_steps == 0
        t.observed_steps += len(steps)
        if first:
            steps = steps[1:]  # a newcomer's first step still pays one-off costs
        obs = [(s.samples / s.micro_batches, s.compute_s / s.micro_batches)
               for s in steps if s.samples > 0]
        if not obs:
            return
        f = fit(t.stats)
        if f is not None:
            mean_b = sum(b for b, _ in obs) / len(obs)
            mean_t = sum(s for _, s in obs) / len(obs)
            pred = f.predict(mean_b)
            if pred > 0 and not (1 / SURPRISE <= mean_t / pred <= SURPRISE):
                # The worker changed speed: forget the old model.
                t.stats = StepTimeStats()
                t.window_samples, t.window_compute = 0, 0.0
        for b, s in obs:
            t.stats = t.stats.add(b, s, STATS_DECAY)

"""Per-worker telemetry the policy and the reports need. Pure: no ray, no torch, no clock.

For each worker it keeps the decayed step-time statistics of the affine model (older
observations fade by ``STATS_DECAY`` per new one, so the model follows a worker whose speed
changes), the window since the last decision (for DBS), and the epoch's totals.

It also measures how noisy the worker's steps are (``WorkerTrack.noise``: the spread of
each window's seconds per sample, pooled over the windows before it, with a prior), so DBS
moves a share only by what stands out of that noise (``WorkerTelemetry.se``), and the
surprise test takes a change of speed for noise no more.

A worker's first step at a batch size it has not computed before pays one-off costs: a
newcomer's warm-up, and on every step whose shape is new the kernels' per-shape setup
(oneDNN builds its convolution primitives per input shape on a CPU, cuDNN picks its
algorithms on a GPU) and the allocator's new blocks (docs/benchmarks.md, "Why the
policies' constants"). Such a step says little about the worker's speed, so it is left out of
the step-time model and of the surprise test (a re-plan to new sizes would otherwise look
like every worker slowing down), and of the DBS window (DBS would shrink every share it
had just moved, and move it again). Epoch totals count every step.

A worker that computes its share in k micro-batches (its memory cap, ``micro_cap``) is
observed per micro-batch, (b/k, t/k), so the fit is the micro-batch's a and c; the policy
plans the accumulated step with them
(``dynabatch.scheduler.core.sync.steptime.accumulation_slope``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynabatch.actors.contracts import StepTelemetry
from dynabatch.scheduler.core.sync.allocation import WorkerTelemetry
from dynabatch.scheduler.core.sync.steptime import StepTimeStats, fit

STATS_DECAY = 0.9
# A segment whose mean compute is off the model by more than this factor is a change of
# speed (a disturbance), not noise: the worker's model restarts from the new observations,
# not a rescaled old fit (where workers share cores the others speed up as the victim
# slows, so its slowdown is not a uniform scale of the old model).
SURPRISE = 1.5
# ... and by more than this many standard errors of the segment's mean against the model's
# (``WorkerTrack.noise``), so that a short segment's noise does not restart the model.
SURPRISE_Z = 3.0
# ... and only by a model of at least this many steps since the last change: a model of
# the one segment that showed a change is as noisy as what it would be held to.
MIN_MODEL_STEPS = 3


# The surprise test trusts a model measured at one batch size only this far from it: a
# proportional fit (all a model of one size can be) extrapolated far misses the overhead.
NEAR = 0.25

# DBS's noise estimate (see :meth:`WorkerTrack.noise`): the windows a worker closed stay in
# it with weight ``NOISE_DECAY`` per step since, so it follows the host's load over about
# 50 steps. ``PRIOR_NOISE`` (relative spread of one step's time: a step that takes 0.5-2x
# its time, log-uniform) is pooled in with the weight of ``PRIOR_DOF`` steps, so a window of
# one or two steps is not taken as exact; its weight fades as the worker's own steps add up.
# Where these values come from: docs/benchmarks.md, "Why the policies' constants".
NOISE_DECAY = 0.98
PRIOR_NOISE = 0.4
PRIOR_DOF = 4.0


# MIN_MODEL_STEPS in the decayed weight that StepTimeStats.n counts.
MIN_MODEL_WEIGHT = (1.0 - STATS_DECAY**MIN_MODEL_STEPS) / (1.0 - STATS_DECAY) - 1e-9


def _predicts(stats: StepTimeStats, batch: float) -> bool:
    """Whether a fit of ``stats`` can be held to a measurement at ``batch``: its batch
    sizes varied (an affine fit), or ``batch`` is near the one size they hold."""
    mean_b = stats.sb / stats.n
    var_b = stats.sbb / stats.n - mean_b * mean_b
    return var_b > (0.05 * mean_b) ** 2 or abs(batch - mean_b) <= NEAR * mean_b


@dataclass
class WorkerTrack:
    capacity: float
    stats: StepTimeStats = field(default_factory=StepTimeStats)
    # Its last change of speed was a slowdown (at batch ``slowed_batch``): until it is
    # measured at another batch size, the policy plans it cautiously
    # (WorkerTelemetry.slowed); after that its own fit knows better.
    slowed: bool = False
    slowed_batch: float = 0.0
    seen_batches: set[int] = field(default_factory=set)
    # Its batch under the allocation last decided (None: any): the window counts only
    # steps at it, so DBS measures the plan it is about to correct, not the one before.
    plan_batch: int | None = None
    # (batch, mean step compute) of the window under the plan before, at a batch other
    # than plan_batch, since the last change of speed: DBS's second point.
    previous: tuple[int, float] | None = None
    # The relative standard error of ``previous``'s mean step time (0 with none).
    previous_se: float = 0.0
    window_samples: int = 0
    window_compute: float = 0.0
    # The window's steps and the sums of their seconds per sample, and of its squares:
    # the spread of the window's own steps (see ``noise``).
    window_steps: int = 0
    window_x: float = 0.0
    window_xx: float = 0.0
    # The windows closed before: degrees of freedom and relative sum of squares, decayed.
    noise_dof: float = 0.0
    noise_ss: float = 0.0
    epoch_samples: int = 0
    epoch_compute: float = 0.0
    epoch_wait: float = 0.0
    epoch_steps: int = 0
    # The speed of the epoch before this one (0: none): what :attr:`speed` says until
    # this epoch's first step is in.
    last_speed: float = 0.0
    compute_per_step: float = 0.0
    wait_per_step: float = 0.0
    slowdown: float = 1.0
    micro_cap: int | None = None

    @property
    def speed(self) -> float:
        """The worker's speed: samples per compute-second over the epoch's steps (every
        step counted, as the epoch's record counts them), the epoch before's until this
        epoch has a step, 0 when not measured. The one definition of a worker's speed:
        the live snapshot, the epoch record, the evaluation's split and a scale-down's
        choice of whom to drain read it. (The policy reads the window's sums instead:
        DBS measures the plan it is about to correct, see :meth:`Tracker.decided`.)"""
        if self.epoch_compute > 0:
            return self.epoch_samples / self.epoch_compute
        return self.last_speed

    def window_spread(self) -> tuple[float, float]:
        """(degrees of freedom, relative sum of squares) of the window's seconds per
        sample: Σ(x − x̄)² / x̄² over its steps."""
        k = self.window_steps
        if k < 2 or self.window_x <= 0.0:
            return 0.0, 0.0
        mean = self.window_x / k
        return k - 1.0, max(self.window_xx / k - mean * mean, 0.0) * k / (mean * mean)

    def noise(self) -> float:
        """The relative variance of one step's time per sample: the window's own spread,
        the decayed spread of the windows closed before it, and the prior (``PRIOR_NOISE``,
        weight ``PRIOR_DOF`` steps) pooled."""
        dof, ss = self.window_spread()
        return ((self.noise_ss + ss + PRIOR_DOF * PRIOR_NOISE ** 2)
                / (self.noise_dof + dof + PRIOR_DOF))

    @property
    def se(self) -> float:
        """The relative standard error of the window's throughput (0 without a window):
        one step's noise over the square root of the window's steps."""
        k = self.window_steps
        return math.sqrt(self.noise() / k) if k else 0.0

    def reset_window(self) -> None:
        dof, ss = self.window_spread()
        if dof:
            keep = NOISE_DECAY ** dof
            self.noise_dof = self.noise_dof * keep + dof
            self.noise_ss = self.noise_ss * keep + ss
        self.window_samples, self.window_compute = 0, 0.0
        self.window_steps, self.window_x, self.window_xx = 0, 0.0, 0.0


def pooled_noise(tracks: Sequence[WorkerTrack]) -> float:
    """The relative variance of one step's time per sample pooled over ``tracks``: their
    windows and closed windows, and the prior once."""
    dof = ss = 0.0
    for t in tracks:
        d, s = t.window_spread()
        dof += t.noise_dof + d
        ss += t.noise_ss + s
    return (ss + PRIOR_DOF * PRIOR_NOISE ** 2) / (dof + PRIOR_DOF)


def _farther(batch: float, other: float, target: float) -> bool:
    """Whether ``batch`` is at least as far from ``target`` as ``other`` is, by ratio."""
    if target <= 0 or batch <= 0 or other <= 0:
        return True
    return abs(math.log(batch / target)) >= abs(math.log(other / target))


class Tracker:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerTrack] = {}

    def add(self, worker: str, capacity: float) -> None:
        self.workers.setdefault(worker, WorkerTrack(capacity))

    def remove(self, worker: str) -> None:
        self.workers.pop(worker, None)

    def telemetry(self, workers: Sequence[str], cap: int | None) -> list[WorkerTelemetry]:
        """What the policy reads of ``workers``. A window's standard error is taken with
        the larger of its worker's noise and the noise pooled over all ``workers``: they
        share the host's load, and one worker's few steps can happen to agree."""
        tracks = [self.workers[w] for w in workers]
        pooled = pooled_noise(tracks)
        out = []
        for w, t in zip(workers, tracks, strict=True):
            k = t.window_steps
            se = math.sqrt(max(t.noise(), pooled) / k) if k else 0.0
            out.append(WorkerTelemetry(worker=w, samples=t.window_samples,
                                       compute_s=t.window_compute, cap=cap,
                                       capacity=t.capacity, stats=t.stats,
                                       micro=t.micro_cap, slowed=t.slowed,
                                       previous=t.previous, se=se,
                                       previous_se=t.previous_se))
        return out

    def decided(self, batches: dict[str, int] | None = None) -> None:
        """A policy decision was taken. DBS measures each worker at its batch in the
        allocation decided (``batches``): since that batch was decided, so a plan kept
        is measured over all its steps, not re-judged on the last one or two (noise). Only
        steps at that batch count: the segment in flight still runs
        the old plan, and a second correction from its steps would repeat the first.
        ``batches`` None: every window restarts.

        A worker nudged to a batch within ``NEAR`` of its last keeps its window: its
        throughput holds at a near size, and a fresh window would be one or two steps of
        noise, on which the windows of equal workers would re-split at every check, each
        move costing the new sizes' first steps. A window
        closed by a far move is kept as the worker's previous point
        (``WorkerTelemetry.previous``, DBS's secant) unless the point it has is farther
        from the new batch."""
        for w, t in self.workers.items():
            b = None if batches is None else batches.get(w)
            old = t.plan_batch
            if batches is None or b != old:
                nudged = (b is not None and old is not None and t.window_samples > 0
                          and abs(b - old) <= NEAR * old)
                if not nudged:
                    # The point farther from the new batch is kept: a line through two
                    # near sizes is not drawn (DBS's SECANT_RATIO), and a far point
                    # replaced by a near one had lost the line for good.
                    if (b is not None and old is not None and t.window_samples > 0
                            and (t.previous is None or _farther(old, t.previous[0], b))):
                        t.previous = (old, t.window_compute * old / t.window_samples)
                        t.previous_se = t.se
                    t.reset_window()
            t.plan_batch = b

    def speeds(self) -> dict[str, float]:
        """Each measured worker's :attr:`WorkerTrack.speed` (absent: not measured yet)."""
        return {w: v for w, t in self.workers.items() if (v := t.speed) > 0}

    def begin_epoch(self) -> None:
        for t in self.workers.values():
            t.last_speed = t.speed
            t.epoch_samples = t.epoch_steps = 0
            t.epoch_compute = t.epoch_wait = 0.0

    def observe(self, worker: str, steps: Iterable[StepTelemetry]) -> None:
        steps = list(steps)
        t = self.workers.get(worker)
        if t is None or not steps:
            return
        new = []
        for s in steps:  # only a size's first step in this list too
            new.append(s.batch not in t.seen_batches)
            t.seen_batches.add(s.batch)
        settled = [s for s, n in zip(steps, new, strict=True) if not n]
        # First: a change of speed restarts the window too. The segment that showed it
        # stays out of the new window: it was picked for standing out, and when the noise
        # did that, DBS would move a share on it against the others' long windows.
        changed = self._fit(t, settled)
        for s in settled if not changed else ():
            if t.plan_batch is None or s.batch == t.plan_batch:
                t.window_samples += s.samples
                t.window_compute += s.compute_s
                if s.samples > 0:
                    x = s.compute_s / s.samples
                    t.window_steps += 1
                    t.window_x += x
                    t.window_xx += x * x
        samples = sum(s.samples for s in steps)
        compute = sum(s.compute_s for s in steps)
        t.epoch_samples += samples
        t.epoch_compute += compute
        t.epoch_wait += sum(s.wait_s for s in steps)
        t.epoch_steps += len(steps)
        t.compute_per_step = compute / len(steps)
        t.wait_per_step = sum(s.wait_s for s in steps) / len(steps)
        t.slowdown = steps[-1].slowdown
        t.micro_cap = steps[-1].micro_cap

    def _fit(self, t: WorkerTrack, steps: list[StepTelemetry]) -> bool:
        """Fold ``steps`` into the worker's model; True when they showed a change of
        speed (the model and the window restarted)."""
        obs = [(s.samples / s.micro_batches, s.compute_s / s.micro_batches)
               for s in steps if s.samples > 0]
        if not obs:
            return False
        changed = False
        f = fit(t.stats)
        mean_b = sum(b for b, _ in obs) / len(obs)
        if f is not None and t.stats.n >= MIN_MODEL_WEIGHT and _predicts(t.stats, mean_b):
            mean_t = sum(s for _, s in obs) / len(obs)
            pred = f.predict(mean_b)
            bound = max(SURPRISE, math.exp(SURPRISE_Z * math.sqrt(
                t.noise() * (1.0 / len(obs) + 1.0 / t.stats.n))))
            if pred > 0 and not (1 / bound <= mean_t / pred <= bound):
                # The worker changed speed: forget the old model.
                t.stats = StepTimeStats()
                t.slowed, t.slowed_batch = mean_t > pred, mean_b
                t.reset_window()
                t.previous, t.previous_se = None, 0.0  # a point of the old speed
                changed = True
        elif t.slowed and abs(mean_b - t.slowed_batch) > NEAR * t.slowed_batch:
            t.slowed = False  # measured at another size: its own fit knows better
        for b, s in obs:
            t.stats = t.stats.add(b, s, STATS_DECAY)
        return changed

"""Per-worker telemetry the policy and the reports need. Pure: no ray, no torch, no clock.

Per worker: the decayed step-time statistics of the affine model (``STATS_DECAY`` per new
observation, so the model follows a change of speed), the window since the last decision
(for DBS), the epoch's totals, and how noisy its steps are (:meth:`WorkerTrack.noise`), so
DBS moves a share only by what stands out of the noise and the surprise test ignores it.

A step at a batch size the worker has not computed before pays one-off costs (warm-up,
the kernels' per-shape setup, new allocator blocks: docs/benchmarks.md), so it is left out
of the model, the surprise test and the DBS window; epoch totals count every step. A
worker computing its share in k micro-batches is observed per micro-batch, (b/k, t/k).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynabatch.actors.contracts import StepTelemetry
from dynabatch.scheduler.core.sync.allocation import WorkerTelemetry
from dynabatch.scheduler.core.sync.steptime import MIN_SPREAD, StepTimeStats, fit

STATS_DECAY = 0.9
# A change of speed, not noise, is a segment whose mean compute is off the model by more
# than this factor, and by more than SURPRISE_Z standard errors, held to a model of at least
# MIN_MODEL_STEPS steps: the model then restarts from the new observations (where workers
# share cores, a slowdown is not a uniform scale of the old model).
SURPRISE = 1.5
SURPRISE_Z = 3.0
MIN_MODEL_STEPS = 3
# ... in the decayed weight that StepTimeStats.n counts.
MIN_MODEL_WEIGHT = (1.0 - STATS_DECAY**MIN_MODEL_STEPS) / (1.0 - STATS_DECAY) - 1e-9

# A model of one batch size is trusted only this far from it (a proportional fit extrapolated
# far misses the overhead); a worker nudged this little keeps its DBS window.
NEAR = 0.25

# The noise estimate: closed windows decay by NOISE_DECAY per step (about 50 steps), and a
# prior relative spread PRIOR_NOISE weighs as PRIOR_DOF steps, so a window of one or two
# steps is not taken as exact. Values: docs/benchmarks.md, "Why the policies' constants".
NOISE_DECAY = 0.98
PRIOR_NOISE = 0.4
PRIOR_DOF = 4.0


def _predicts(stats: StepTimeStats, batch: float) -> bool:
    """Whether a fit of ``stats`` can be held to a measurement at ``batch`` (an affine fit,
    or ``batch`` near the one size it holds)."""
    mean_b = stats.sb / stats.n
    var_b = stats.sbb / stats.n - mean_b * mean_b
    return var_b > (MIN_SPREAD * mean_b) ** 2 or abs(batch - mean_b) <= NEAR * mean_b


@dataclass
class WorkerTrack:
    capacity: float
    stats: StepTimeStats = field(default_factory=StepTimeStats)
    # Its last change of speed was a slowdown (at ``slowed_batch``): planned cautiously
    # until measured at another batch size.
    slowed: bool = False
    slowed_batch: float = 0.0
    seen_batches: set[int] = field(default_factory=set)
    # Its batch under the allocation last decided (None: any): the window's steps are at it.
    plan_batch: int | None = None
    # (batch, mean step compute) of the window under the plan before, since the last change
    # of speed (DBS's second point), and its relative standard error.
    previous: tuple[int, float] | None = None
    previous_se: float = 0.0
    window_samples: int = 0
    window_compute: float = 0.0
    # The window's steps and the sums of their seconds per sample and its squares.
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
    # The speed of the epoch before this one (0: none).
    last_speed: float = 0.0
    compute_per_step: float = 0.0
    wait_per_step: float = 0.0
    slowdown: float = 1.0
    micro_cap: int | None = None

    @property
    def speed(self) -> float:
        """Samples per compute-second over the epoch's steps (the epoch before's until this
        one has a step; 0: not measured): the one speed the views, the evaluation's split
        and a drain's choice read (the policy reads the window instead)."""
        if self.epoch_compute > 0:
            return self.epoch_samples / self.epoch_compute
        return self.last_speed

    def window_spread(self) -> tuple[float, float]:
        """(degrees of freedom, Σ(x − x̄)² / x̄²) of the window's seconds per sample."""
        k = self.window_steps
        if k < 2 or self.window_x <= 0.0:
            return 0.0, 0.0
        mean = self.window_x / k
        return k - 1.0, max(self.window_xx / k - mean * mean, 0.0) * k / (mean * mean)

    def noise(self) -> float:
        """The relative variance of one step's time per sample: the window's spread, the
        closed windows' (decayed) and the prior, pooled."""
        return pooled_noise((self,))

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
        """What the policy reads of ``workers``; a window's error takes the larger of its
        own noise and the pooled one (workers share the host's load, and a few steps can
        happen to agree)."""
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
        """A policy decided ``batches``: each worker's DBS window counts only steps at its
        new batch (the segment in flight still runs the old plan), so a kept plan is
        measured over all its steps. ``batches`` None: every window restarts.

        A worker nudged within ``NEAR`` keeps its window (a fresh one would be a step or
        two of noise). A window closed by a far move becomes the worker's previous point
        (DBS's secant) unless the one it has is farther from the new batch."""
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
                        t.previous_se = math.sqrt(t.noise() / t.window_steps)
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
        # A change of speed restarts the window; the segment that showed it stays out
        # (picked for standing out, it may be noise).
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
            pred = f.a + f.c * mean_b
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

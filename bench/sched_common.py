"""Shared by the schedule benchmarks (``batch_stages``, ``isgd``, ``goodput``): a job in the
simulator's real-gradient mode on a small heterogeneous cluster, time to a target, and
medians.

Real-gradient mode trains the actual model on the actual data with the production coordinator
(the same schedule, ISGD and goodput machines as on Ray); only the clock is simulated, from a
cluster of unequal nodes (per-step cost ``a + c·b``, the all-reduce, and ISGD's extra passes
charged as more compute and all-reduce). ``wall_s`` is simulated seconds on that cluster.

The data is MNIST-format (``dataset: mnist`` without a path: 12,000 generated training and
2,000 test images, a different draw per seed; real files with ``--mnist DIR``).

:func:`run` can evaluate the model every ``eval_every`` steps (at the first segment
boundary past each multiple; the simulator's evaluation costs no simulated time), so time
to a target is resolved to a few steps rather than to an epoch.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from dynabatch.actors.spec import JobSpec, parse_spec
from dynabatch.scheduler.core.sync.loop import BeginEpoch, TrainSegment
from dynabatch.scheduler.sim.cluster_spec import parse_cluster
from dynabatch.scheduler.sim.simulator import SimResult, simulate

CLUSTER = {
    "classes": [
        {"name": "fast", "count": 1, "a_ms": 3, "c_ms_per_sample": 0.1},
        {"name": "mid", "count": 1, "a_ms": 3, "c_ms_per_sample": 0.2},
        {"name": "slow", "count": 1, "a_ms": 3, "c_ms_per_sample": 0.4},
    ],
    "noise_sigma": 0.05,
    "allreduce": {"alpha_ms": 0.5, "beta_ms_per_mb": 1.0},
}
MODE = ("simulator real-gradient mode (dynabatch.scheduler.sim.simulator): real LeNet training on "
        "MNIST-format data, simulated clock of unequal nodes; wall_s and time_to_target_s "
        "are simulated seconds")


def pin_threads(n: int) -> int:
    """Pin torch's intra-op threads (the float results of a run depend on it); returns the
    count in force, for the JSON."""
    torch.set_num_threads(n)
    return torch.get_num_threads()


def dataset(mnist: str | None = None) -> dict[str, Any]:
    return {"name": "mnist", **({"path": mnist} if mnist else {})}


def job(**kw: Any) -> JobSpec:
    base: dict[str, Any] = {"dataset": dataset(), "model": {"name": "lenet"}, "workers": 3,
                            "policy": "dbs"}
    base.update(kw)
    return parse_spec(base)


@dataclass
class Curve:
    """Evaluations during a run: simulated seconds, gradient evaluations (samples whose
    gradient was computed, extra iterations included), optimizer steps and test accuracy."""

    every: int
    points: list[tuple[float, int, int, float]] = field(default_factory=list)

    def time_to(self, target: float) -> tuple[float | None, int | None, int | None]:
        """(seconds, gradient evaluations, steps) at the first evaluation at or above
        ``target``; Nones if none is."""
        for t, g, s, acc in self.points:
            if acc >= target:
                return t, g, s
        return None, None, None


def run(spec: JobSpec, cluster: dict[str, Any] | None = None, eval_every: int | None = None,
        stop_at: float | None = None) -> tuple[SimResult, Curve | None]:
    """The job in the simulator; with ``eval_every``, its :class:`Curve`. ``stop_at``: end
    the run once an evaluation reaches that accuracy (a time-to-target run need not train
    on)."""
    coord: list[Any] = []
    curve = Curve(eval_every) if eval_every else None
    nxt = [eval_every or 0]
    start: list[float] = []  # the clock when the first epoch began (after workers started)

    def seen(c: Any) -> None:
        """Keep the coordinator, and note when its first epoch begins (after the workers
        started): the first epoch opened or segment sent (the simulator's clock does not
        advance between the loop's decision and its effect)."""
        coord.append(c)
        carry_out = c._carry_out

        def watching(effect: Any) -> Any:
            if not start and isinstance(effect, (BeginEpoch, TrainSegment)):
                start.append(c.clock.now())
            return carry_out(effect)

        c._carry_out = watching

    def progress(_done: int, _total: int) -> None:
        if curve is None or not coord:
            return
        c = coord[0]
        if not start:
            return
        hist = c.history()
        steps = sum(r.steps for r in hist) + (c.step_in_epoch if c.epoch < spec.epochs else 0)
        if steps < nxt[0] and c.epoch < spec.epochs:
            return
        while nxt[0] <= steps:
            nxt[0] += eval_every
        evals = c.regime.grad_evals
        g = c.runtime.gradients  # the held-out set on the simulated model, on the CPU
        obj = g.objective
        sums = obj.eval_sums(g.model, g.x_test, g.y_test, 0, len(g.y_test), torch.device("cpu"))
        acc = float(obj.finish(sums).get("accuracy"))
        curve.points.append((c.clock.now() - start[0], evals, steps, acc))
        if stop_at is not None and acc >= stop_at and not c.state.is_terminal:
            c.cancel("reached the target")

    res = simulate(spec, parse_cluster(cluster or CLUSTER), real_gradients=True,
                   coordinator_hook=seen, progress=progress if curve else None)
    stopped = stop_at is not None and res.snapshot.reason == "reached the target"
    if res.snapshot.state.value != "SUCCEEDED" and not stopped:
        raise RuntimeError(f"{spec.name}: {res.snapshot.reason}")
    return res, curve


def updates(res: SimResult) -> int:
    """Optimizer updates: steps plus ISGD's extra iterations."""
    return sum(r.steps + r.isgd_extra_iterations for r in res.history)


def median(xs: Sequence[float | None]) -> float | None:
    """The median, counting a run that never got there (None) as infinitely slow; None
    when that is the median."""
    vals = sorted(float("inf") if x is None else x for x in xs)
    if not vals:
        return None
    m = statistics.median(vals)
    return None if m == float("inf") else m

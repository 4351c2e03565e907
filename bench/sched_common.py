"""Shared by the schedule benchmarks (``batch_stages``, ``isgd``, ``goodput``): a job in the
simulator's real-gradient mode on a small heterogeneous cluster, and time to a target.

Real-gradient mode trains the actual model on the actual data with the production coordinator
(the same schedule, ISGD and goodput machines as on Ray); only the clock is simulated, from a
cluster of three unequal nodes (per-step cost ``a + c·b``, with ISGD's extra iterations
charged as more compute and all-reduce). ``wall_s`` is simulated seconds on that cluster.
"""

from __future__ import annotations

from typing import Any

from actors.spec import JobSpec, parse_spec
from scheduler.cluster_model import parse_cluster
from scheduler.simulator import SimResult, simulate

CLUSTER = {
    "classes": [
        {"name": "fast", "count": 1, "a_ms": 3, "c_ms_per_sample": 0.1},
        {"name": "mid", "count": 1, "a_ms": 3, "c_ms_per_sample": 0.2},
        {"name": "slow", "count": 1, "a_ms": 3, "c_ms_per_sample": 0.4},
    ],
    "noise_sigma": 0.05,
    "allreduce": {"alpha_ms": 0.5, "beta_ms_per_mb": 1.0},
}
MODE = ("simulator real-gradient mode (scheduler.simulator): real LeNet training on digits, "
        "simulated clock of 3 unequal nodes; wall_s and time_to_target_s are simulated seconds")


def job(**kw: Any) -> JobSpec:
    base: dict[str, Any] = {"dataset": {"name": "digits"}, "model": {"name": "lenet"},
                            "workers": 3, "policy": "dbs"}
    base.update(kw)
    return parse_spec(base)


def run(spec: JobSpec, cluster: dict[str, Any] | None = None) -> SimResult:
    res = simulate(spec, parse_cluster(cluster or CLUSTER), real_gradients=True)
    if res.snapshot.state.value != "SUCCEEDED":
        raise RuntimeError(f"{spec.name}: {res.snapshot.reason}")
    return res


def updates(res: SimResult) -> int:
    """Optimizer updates: steps plus ISGD's extra iterations."""
    return sum(r.steps + r.isgd_extra_iterations for r in res.history)


def time_to(res: SimResult, target: float) -> tuple[float | None, int | None]:
    """(simulated seconds, gradient evaluations) until an epoch's test accuracy reaches
    ``target``; (None, None) if none does."""
    t, evals = 0.0, 0
    for r in res.history:
        t += r.wall_s
        evals += r.grad_evals
        if r.test_accuracy is not None and r.test_accuracy >= target:
            return t, evals
    return None, None

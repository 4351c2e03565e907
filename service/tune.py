"""Auto-tuning of a stage-wise batch schedule (Hu et al. 2022): short probe runs choose each
stage's global batch B_s, LR factor k_s and warm-up w_s.

The job's ``schedule.stages`` give the stage lengths; its first stage's batch B_0 is the
small-batch baseline and is kept. For each later stage s, in order, with the stages before it
already chosen (the *prefix*), a probe trains the prefix and then ``probe_epochs`` epochs of
stage s, and is judged by its final test accuracy:

* the baseline probe keeps the previous stage's batch and factor (no jump);
* candidates jump to B = B_{s−1}·2^j (j ≥ 1, up to ``max_batch``), largest first, each with
  k = B/B_0 (linear) then √(B/B_0) (sqrt), warm-up ``warmup_epochs`` after the jump;
* the first candidate whose accuracy is at least the baseline's minus ``tolerance`` is kept
  (the largest B within tolerance); if none is, the stage keeps the previous stage's batch.

Probes run in the simulator's real-gradient mode (the real model and data, the production
coordinator, a simulated clock). ``budget`` bounds the number of probes: when it runs out, the
remaining stages keep the previous stage's choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from actors.spec import JobSpec, StageSpec
from scheduler.cluster_model import ClusterSpec
from scheduler.simulator import simulate


class TuneError(ValueError):
    """A job that cannot be tuned (one line)."""


@dataclass(frozen=True)
class Probe:
    stage: int
    role: str  # baseline | candidate
    global_batch: int
    lr_factor: float
    warmup_epochs: float
    accuracy: float
    updates: int
    sim_seconds: float
    kept: bool = False


@dataclass(frozen=True)
class TuneResult:
    spec: JobSpec
    probes: list[Probe]
    budget_exhausted: bool

    def report(self) -> dict[str, Any]:
        return {
            "stages": [st.model_dump() for st in self.spec.schedule.stages],
            "probes": [asdict(p) for p in self.probes],
            "budget_exhausted": self.budget_exhausted,
        }


def _with_stages(spec: JobSpec, stages: list[StageSpec], epochs: int) -> JobSpec:
    data = spec.model_dump(mode="json")
    data["epochs"] = epochs
    data["schedule"] = {**data["schedule"], "mode": "stages",
                        "stages": [st.model_dump() for st in stages]}
    # A probe stops early: keep only the LR milestones it reaches.
    sched = data["optimizer"]["schedule"]
    sched["milestones"] = [m for m in sched["milestones"] if m < epochs]
    return JobSpec.model_validate(data)


def tune(spec: JobSpec, cluster: ClusterSpec, *, max_batch: int, tolerance: float = 0.01,
         probe_epochs: int = 2, warmup_epochs: float = 1.0, budget: int = 20,
         on_probe: Callable[[Probe], None] | None = None) -> TuneResult:
    if spec.schedule.mode != "stages" or len(spec.schedule.stages) < 2:
        raise TuneError("schedule.stages: tune needs at least two stages (their epochs "
                        "are kept; their batches are tuned)")
    if probe_epochs < 1:
        raise TuneError(f"--probe-epochs: must be at least 1, got {probe_epochs}")
    if budget < 2:
        raise TuneError(f"--budget: needs at least 2 probes, got {budget}")
    stages = list(spec.schedule.stages)
    b0 = stages[0].global_batch
    if max_batch <= b0:
        raise TuneError(f"--max-batch: {max_batch} is not above the first stage's batch {b0}")
    chosen = [StageSpec(epochs=stages[0].epochs, global_batch=b0, lr_factor=1.0,
                        warmup_epochs=0.0)]
    probes: list[Probe] = []
    left = budget

    def probe(stage: int, role: str, cand: StageSpec) -> Probe:
        nonlocal left
        left -= 1
        prefix_epochs = sum(st.epochs for st in chosen)
        n = min(stages[stage].epochs, probe_epochs)
        job = _with_stages(spec, [*chosen, cand.model_copy(update={"epochs": n})],
                           prefix_epochs + n)
        res = simulate(job, cluster, real_gradients=True)
        if res.snapshot.state.value != "SUCCEEDED":
            raise TuneError(f"probe of stage {stage} at B={cand.global_batch} failed: "
                            f"{res.snapshot.reason}")
        p = Probe(stage, role, cand.global_batch, cand.lr_factor or 1.0,
                  cand.warmup_epochs or 0.0, float(res.history[-1].test_accuracy or 0.0),
                  sum(r.steps + r.isgd_extra_iterations for r in res.history),
                  res.sim_seconds)
        probes.append(p)
        if on_probe is not None:
            on_probe(p)
        return p

    exhausted = False
    for s in range(1, len(stages)):
        prev = chosen[-1]
        keep = StageSpec(epochs=stages[s].epochs, global_batch=prev.global_batch,
                         lr_factor=prev.lr_factor, warmup_epochs=0.0)
        if left < 2:
            exhausted = True
            chosen.append(keep)
            continue
        base = probe(s, "baseline", keep)
        pick = keep
        sizes = []
        b = prev.global_batch * 2
        while b <= max_batch:
            sizes.append(b)
            b *= 2
        for b in reversed(sizes):
            found = False
            for k in (b / b0, math.sqrt(b / b0)):
                if left < 1:
                    exhausted = True
                    break
                cand = StageSpec(epochs=stages[s].epochs, global_batch=b, lr_factor=k,
                                 warmup_epochs=warmup_epochs)
                p = probe(s, "candidate", cand)
                if p.accuracy >= base.accuracy - tolerance:
                    probes[-1] = Probe(**{**asdict(p), "kept": True})
                    pick, found = cand, True
                    break
            if found or exhausted:
                break
        chosen.append(pick)
    tuned = _with_stages(spec, chosen, spec.epochs)
    return TuneResult(tuned, probes, exhausted)

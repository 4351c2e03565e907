"""Auto-tuning of a stage-wise batch schedule (Hu et al. 2022): short probe runs choose each
stage's global batch B_s, LR factor k_s and warm-up w_s.

The job's ``schedule.stages`` give the stage lengths; its first stage's batch B_0 is the
small-batch baseline and is kept (with factor 1 and no warm-up). Probes are judged on a
*validation* split held out of the training data (``holdout``), never on the test set, and
each probe trains ``seeds`` seeds (the job's seed and the next ones) and is judged by their
mean accuracy, so one lucky seed does not pick a batch.

* **Baseline**: one probe trains B_0 (factor 1) in every stage; its validation accuracy at
  the end of each stage's probe window is that stage's reference: the small-batch run, not
  the previous stage's choice, so the accuracy given up never adds up over the stages.
* **Stage s** (in order, the stages before it already chosen): a candidate trains the chosen
  stages, then ``probe_epochs`` epochs of stage s at its (B, k, w), and is judged there.
  Candidates jump to B = B_{s−1}·2^j (j ≥ 1, up to ``max_batch``), largest first; for each B,
  k = B/B_0 (linear) then √(B/B_0) (sqrt), each with every warm-up in ``warmups``, shortest
  first. The first candidate whose mean accuracy is at least the baseline's minus
  ``tolerance`` is kept: the largest B within tolerance, with the largest factor and the
  shortest warm-up that keep it there. If none is, the stage keeps the previous stage's batch
  and factor.

A probe is the job itself, stopped after its window, so it follows the job's own learning-
rate schedule (multi-step milestones and cosine alike). Probes run in the simulator's
real-gradient mode (the real model and data, the production coordinator, a simulated
clock). ``budget`` bounds the number of probes (each ``seeds`` runs): when it runs out, the
remaining stages keep the previous stage's choice.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dynabatch.actors.spec import JobSpec, StageSpec
from dynabatch.scheduler.sim.cluster_spec import ClusterSpec
from dynabatch.scheduler.sim.simulator import SimResult, simulate


class TuneError(ValueError):
    """A job that cannot be tuned (one line)."""


@dataclass(frozen=True)
class Probe:
    stage: int  # the stage it judges (0: the baseline, which serves every stage)
    role: str  # baseline | candidate
    global_batch: int
    lr_factor: float
    warmup_epochs: float
    accuracy: float  # mean validation accuracy over the seeds (baseline: at its last epoch)
    accuracy_per_seed: list[float]
    epochs: int  # epochs each seed trained
    updates: int  # optimizer updates, mean over the seeds
    sim_seconds: float  # mean over the seeds
    kept: bool = False


@dataclass(frozen=True)
class TuneResult:
    spec: JobSpec
    probes: list[Probe]
    budget_exhausted: bool
    baseline: dict[int, float] = field(default_factory=dict)  # stage -> reference accuracy
    settings: dict[str, Any] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        return {
            "stages": [st.model_dump() for st in self.spec.schedule.stages],
            "baseline_accuracy": {str(k): v for k, v in self.baseline.items()},
            "probes": [asdict(p) for p in self.probes],
            "probes_run": len(self.probes),
            "simulations": sum(len(p.accuracy_per_seed) for p in self.probes),
            "budget_exhausted": self.budget_exhausted,
            "settings": self.settings,
        }


def _with_stages(spec: JobSpec, stages: list[StageSpec], seed: int) -> JobSpec:
    data = spec.model_dump(mode="json")
    data["seed"] = seed
    data["schedule"] = {**data["schedule"], "mode": "stages",
                        "stages": [st.model_dump() for st in stages]}
    return JobSpec.model_validate(data)


def _run_until(job: JobSpec, cluster: ClusterSpec, epochs: int, holdout: float) -> SimResult:
    """The job in the simulator, stopped once ``epochs`` epochs are done: their records (the
    segment sent ahead across the window's end may train into the next epoch before the
    stop, as on Ray; that epoch is not part of the probe)."""
    coord = []

    def stop(_done: int, _total: int) -> None:
        c = coord[0]
        if c.epoch >= epochs and not c.state.is_terminal:
            c.cancel("probe window done")

    res = simulate(job, cluster, real_gradients=True, holdout=holdout,
                   coordinator_hook=coord.append, progress=stop)
    if len(res.history) < epochs:
        raise TuneError(f"a probe at B={job.schedule.stages[-1].global_batch} stopped after "
                        f"{len(res.history)} of {epochs} epochs: {res.snapshot.reason}")
    return replace(res, history=res.history[:epochs])


def _sizes(prev: int, max_batch: int) -> list[int]:
    """Candidate batches above ``prev``, largest first."""
    out, b = [], prev * 2
    while b <= max_batch:
        out.append(b)
        b *= 2
    return out[::-1]


def planned_probes(stages: Sequence[int], prev: int, max_batch: int, n_warmups: int,
                   baseline: bool) -> int:
    """The most probes the stages left can spend, if every stage's previous batch is
    ``prev`` (the batches only grow, so later stages have at most as many candidates)."""
    per_stage = len(_sizes(prev, max_batch)) * 2 * n_warmups
    return int(baseline) + per_stage * len(stages)


def tune(spec: JobSpec, cluster: ClusterSpec, *, max_batch: int, tolerance: float = 0.01,
         probe_epochs: int = 2, warmups: Sequence[float] = (0.0, 1.0, 2.0), seeds: int = 2,
         holdout: float = 0.2, budget: int = 20,
         on_probe: Callable[[Probe, int, int], None] | None = None) -> TuneResult:
    """``on_probe(probe, done, total)``: after each probe, with the probes run and the most
    that can still be run in all (the budget included)."""
    if spec.schedule.mode != "stages" or len(spec.schedule.stages) < 2:
        raise TuneError("schedule.stages: tune needs at least two stages (their epochs "
                        "are kept; their batches are tuned)")
    if probe_epochs < 1:
        raise TuneError(f"--probe-epochs: must be at least 1, got {probe_epochs}")
    if budget < 2:
        raise TuneError(f"--budget: needs at least 2 probes, got {budget}")
    if seeds < 1:
        raise TuneError(f"--seeds: must be at least 1, got {seeds}")
    if not 0 < holdout < 1:
        raise TuneError(f"--holdout: must be between 0 and 1, got {holdout}")
    warmups = sorted(set(float(w) for w in warmups))
    if not warmups or warmups[0] < 0:
        raise TuneError(f"--warmups: need warm-ups of 0 epochs or more, got {warmups}")
    stages = list(spec.schedule.stages)
    b0 = stages[0].global_batch
    if max_batch <= b0:
        raise TuneError(f"--max-batch: {max_batch} is not above the first stage's batch {b0}")
    starts = [sum(st.epochs for st in stages[:s]) for s in range(len(stages))]
    window = {s: starts[s] + min(stages[s].epochs, probe_epochs)
              for s in range(1, len(stages))}  # epochs a probe of stage s trains
    chosen = [StageSpec(epochs=stages[0].epochs, global_batch=b0, lr_factor=1.0,
                        warmup_epochs=0.0)]
    probes: list[Probe] = []
    seed_list = [spec.seed + i for i in range(seeds)]

    def record(p: Probe, left: int) -> None:
        """``left``: the most probes that can still follow it."""
        probes.append(p)
        if on_probe is not None:
            on_probe(p, len(probes), len(probes) + min(budget - len(probes), left))

    # The small-batch baseline: B_0 in every stage, read at the end of every stage's window.
    last = max(window.values())
    base_runs = [_run_until(_with_stages(spec, [StageSpec(epochs=spec.epochs,
                                                          global_batch=b0)], seed),
                            cluster, last, holdout) for seed in seed_list]
    baseline = {s: statistics.mean(float(r.history[e - 1].test_accuracy or 0.0)
                                   for r in base_runs) for s, e in window.items()}
    accs = [float(r.history[last - 1].test_accuracy or 0.0) for r in base_runs]
    record(Probe(0, "baseline", b0, 1.0, 0.0, statistics.mean(accs), accs, last,
                 round(statistics.mean(_updates(r) for r in base_runs)),
                 statistics.mean(r.sim_seconds for r in base_runs)),
           planned_probes(range(1, len(stages)), b0, max_batch, len(warmups), False))

    def probe(s: int, cand: StageSpec) -> Probe:
        rest = spec.epochs - starts[s]  # the candidate's stage runs to the job's end
        job_stages = [*chosen, cand.model_copy(update={"epochs": rest})]
        runs = [_run_until(_with_stages(spec, job_stages, seed), cluster, window[s], holdout)
                for seed in seed_list]
        accs = [float(r.history[window[s] - 1].test_accuracy or 0.0) for r in runs]
        return Probe(s, "candidate", cand.global_batch, float(cand.lr_factor or 1.0),
                     float(cand.warmup_epochs or 0.0), statistics.mean(accs), accs,
                     window[s], round(statistics.mean(_updates(r) for r in runs)),
                     statistics.mean(r.sim_seconds for r in runs))

    exhausted = False
    for s in range(1, len(stages)):
        prev = chosen[-1]
        pick = StageSpec(epochs=stages[s].epochs, global_batch=prev.global_batch,
                         lr_factor=prev.lr_factor, warmup_epochs=0.0)
        cands = [StageSpec(epochs=stages[s].epochs, global_batch=b, lr_factor=k,
                           warmup_epochs=w)
                 for b in _sizes(prev.global_batch, max_batch)
                 for k in (b / b0, math.sqrt(b / b0)) for w in warmups]
        for i, cand in enumerate(cands):
            if len(probes) >= budget:
                exhausted = True
                break
            p = probe(s, cand)
            ok = p.accuracy >= baseline[s] - tolerance
            later = planned_probes(range(s + 1, len(stages)),
                                   cand.global_batch if ok else prev.global_batch,
                                   max_batch, len(warmups), False)
            record(Probe(**{**asdict(p), "kept": ok}),
                   later + (0 if ok else len(cands) - i - 1))
            if ok:
                pick = cand
                break
        chosen.append(pick)
    tuned = _with_stages(spec, chosen, spec.seed)
    settings = {"max_batch": max_batch, "tolerance": tolerance, "probe_epochs": probe_epochs,
                "warmups": warmups, "seeds": seed_list, "holdout": holdout, "budget": budget,
                "selection": "mean validation accuracy (held out of the training data)"}
    return TuneResult(tuned, probes, exhausted, baseline, settings)


def _updates(res: SimResult) -> int:
    return sum(r.steps + r.isgd_extra_iterations for r in res.history)

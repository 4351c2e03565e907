"""An epoch's accounting and its :class:`~dynabatch.scheduler.telemetry.EpochRecord`.

:class:`EpochTotals` adds up what the workers reported in an epoch's committed steps (per
step phase times, losses, the busiest worker's time per segment) and the epoch's wall
time. :func:`build_record` turns them, the ledger's verdict and the tracker's per-worker
totals into the record at the epoch's end; :func:`with_scores` completes it once the
epoch's evaluation is in (it runs on the holders after the epoch, off the critical path:
``dynabatch.scheduler.sync.evaluation``), with the step breakdown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dynabatch.actors.contracts import StepTelemetry
from dynabatch.actors.workloads.metric_states import split_scores
from dynabatch.scheduler.core.ledger import Verification
from dynabatch.scheduler.core.sync.ahead import WallShare
from dynabatch.scheduler.core.sync.allocation import Allocation
from dynabatch.scheduler.core.sync.tracker import WorkerTrack
from dynabatch.scheduler.sync.evaluation import EvalRound
from dynabatch.scheduler.telemetry import (
    EpochRecord,
    StepBreakdown,
    WorkerEpochStats,
    splits_text,
)

_PHASES = ("gather_s", "forward_s", "backward_s", "wait_s", "optimizer_s", "overlap_s",
           "micro_batches", "data_wait_s")


@dataclass
class EpochTotals:
    started: float = 0.0
    wall: float = 0.0
    worker_seconds: float = 0.0
    loss_sum: float = 0.0
    loss_samples: int = 0
    rebalances: int = 0
    # Per committed step: the workers' mean phase times. ``busy``: per segment, the
    # longest time a worker spent in its steps. ``evaluation``: the previous epoch's
    # evaluation, which ran on the workers inside this epoch's wall time. The rest of the
    # epoch's wall time is the scheduler's: dispatch, results, ledger, planning, regroups.
    phases: dict[str, float] | None = None
    busy: float = 0.0
    evaluation: float = 0.0
    steps: int = 0
    loader_rates: list[float] = field(default_factory=list)

    def add_step(self, reports: list[StepTelemetry]) -> None:
        if not reports:
            return
        if self.phases is None:
            self.phases = dict.fromkeys(_PHASES, 0.0)
        for k in _PHASES:
            self.phases[k] += sum(getattr(r, k) for r in reports) / len(reports)
        rates = [r.loader_rate for r in reports if r.loader_rate]
        if rates:
            self.loader_rates.append(sum(rates) / len(rates))
        self.steps += 1
        for rep in reports:
            self.loss_sum += rep.loss_sum
            self.loss_samples += rep.samples

    def add_segment(self, share: WallShare, busy: float) -> None:
        """A segment's wall time as attributed (none to steps when it completed none) and
        the longest a worker spent in its completed steps."""
        self.evaluation += share.evaluation
        self.wall += share.wall
        self.worker_seconds += share.worker_seconds
        self.busy += busy

    def rebalanced(self) -> None:
        self.rebalances += 1

    def breakdown(self, elapsed: float, evaluation: float, hidden: float
                  ) -> StepBreakdown | None:
        if not self.steps or self.phases is None:
            return None
        n = self.steps
        ph = {k: v / n for k, v in self.phases.items()}
        return StepBreakdown(
            gather_s=ph["gather_s"], forward_s=ph["forward_s"], backward_s=ph["backward_s"],
            data_wait_s=ph["data_wait_s"],
            loader_rate=(sum(self.loader_rates) / len(self.loader_rates)
                         if self.loader_rates else None),
            allreduce_wait_s=ph["wait_s"], optimizer_s=ph["optimizer_s"],
            overlap_s=ph["overlap_s"], micro_batches=ph["micro_batches"],
            coordinator_s=max(0.0, elapsed - self.evaluation - self.busy) / n,
            evaluation_s=evaluation / n, evaluation_hidden_s=hidden / n,
        )


def segment_busy(results: list[Any], done: int) -> float:
    """The longest time a worker spent in a segment's first ``done`` steps, by its own clock
    (the steps' ``step_s``): training time the segment's wall time holds at least."""
    return max((sum(s.step_s for s in r.steps[:done]) for r in results), default=0.0)


def build_record(
    *, epoch: int, steps: int, verification: Verification, totals: EpochTotals,
    elapsed: float, tracks: Mapping[str, WorkerTrack], nodes: Mapping[str, str],
    allocation: Allocation | None, regime: dict[str, Any], policy: str, emulated: bool,
    generation: int,
) -> EpochRecord:
    """The epoch's record, without its test scores (see :func:`with_scores`)."""
    v, ep = verification, totals
    full = [t for t in tracks.values() if t.epoch_steps == steps] or [
        t for t in tracks.values() if t.epoch_steps]
    computes = [t.epoch_compute for t in full]
    balance = (sum(computes) / len(computes)) / max(computes) if computes and max(
        computes) else 0.0
    util = (sum(t.epoch_compute for t in tracks.values()) / ep.worker_seconds
            if ep.worker_seconds else 0.0)
    a = allocation
    batch_of = dict(zip(a.workers, a.batches, strict=True)) if a else {}
    return EpochRecord(
        **regime, epoch=epoch, wall_s=ep.wall, steps=steps, dataset_size=v.dataset_size,
        samples_trained=v.samples_trained, retried_samples=v.retried_samples,
        verified=v.verified, train_loss=ep.loss_sum / max(ep.loss_samples, 1),
        utilization=min(util, 1.0), compute_balance=balance, rebalances=ep.rebalances,
        generation=generation, policy=policy, emulated=emulated, elapsed_s=elapsed,
        breakdown=ep.breakdown(elapsed, 0.0, 0.0),
        workers=[
            WorkerEpochStats(
                worker=w, node=nodes.get(w, ""), batch=batch_of.get(w, 0),
                partition=v.samples_by_worker.get(w, 0), steps=t.epoch_steps,
                compute_s=t.epoch_compute, wait_s=t.epoch_wait,
                throughput=t.speed,
                slowdown=t.slowdown,
            )
            for w, t in tracks.items()
        ],
    )


def split_fields(split: str, scores: dict[str, float] | None) -> dict[str, Any]:
    """The record's fields of the held-out ``split`` (test, validation) that ``scores``
    (the evaluation's ``{"loss", <metric>: ...}``, None: none) fill."""
    scores, matrices = split_scores(scores or {})  # a confusion matrix is a table
    loss = scores.pop("loss", None)
    if split == "validation":
        return {"validation_loss": loss, "validation_metrics": scores,
                "validation_matrices": matrices}
    return {"test_loss": loss, "test_accuracy": scores.get("accuracy"), "test_metrics": scores,
            "test_matrices": matrices}


def with_scores(record: EpochRecord, totals: EpochTotals, scores: dict[str, float] | None,
                rnd: EvalRound) -> EpochRecord:
    """``record`` completed by its evaluation (``scores`` None: it did not complete), in the
    fields of the split the round scored."""
    evaluation, hidden = rnd.critical_s, rnd.hidden_s
    return record.model_copy(update={
        **split_fields(rnd.split, scores),
        "evaluation_s": evaluation, "evaluation_hidden_s": hidden,
        "breakdown": totals.breakdown(record.elapsed_s or 0.0, evaluation, hidden),
    })


def summary(record: EpochRecord, epochs: int | None = None) -> str:
    """The epoch's line in the job log, with the job's own held-out metrics, each split
    named: ``epoch 1/N`` for the first of ``epochs``, as the progress and ``status`` count
    them."""
    scores = splits_text(record.validation_metrics, record.scores) or "no test scores"
    of = f"/{epochs}" if epochs else ""
    return (f"epoch {record.epoch + 1}{of}: {record.wall_s:.2f}s, "
            f"loss {record.train_loss:.4f}, "
            f"{scores}, balance {record.compute_balance:.3f}, utilization "
            f"{record.utilization:.3f}, {record.samples_trained} samples verified exactly once"
            + explain_utilization(record))


def explain_utilization(record: EpochRecord) -> str:
    """Where a worker's step went, from the workers' reports (means over workers): what
    utilization (compute over the workers' wall time) leaves out. "" without a breakdown.

    The rest of a step is what no phase accounts for; in an emulated run (compute timed as
    thread CPU time, see dynabatch.actors.emulation) it is mostly time a worker was ready to
    run but had no core: emulated nodes share the machine's cores with each other and with
    whatever else runs there, which a cluster of real nodes would not."""
    b, ws = record.breakdown, [w for w in record.workers if w.steps]
    if b is None or not ws or not record.steps:
        return ""
    step = record.wall_s / record.steps
    compute = sum(w.compute_s / w.steps for w in ws) / len(ws)
    wait = sum(w.wait_s / w.steps for w in ws) / len(ws)
    parts = {"compute": compute, "all-reduce wait": wait, "optimizer": b.optimizer_s,
             "coordinator": b.coordinator_s, "evaluation": b.evaluation_s}
    rest = max(0.0, step - sum(parts.values()))
    shown = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items())
    why = (" (ready to run without a core: the emulated nodes share this machine's cores; a "
           "peer's such delay shows in the all-reduce wait)" if record.emulated else "")
    return f" (a {step * 1e3:.1f} ms step: {shown}, rest {rest * 1e3:.1f} ms{why})"

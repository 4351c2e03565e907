"""Where a step's time goes: the per-step phases averaged over an epoch's workers and steps,
the coordinator's share, evaluation's share on the critical path and the part of it the
split across holders hid, and the CLI table that shows them."""

from __future__ import annotations

import pytest
from dynabatch.actors.contracts import SegmentPlan, StepTelemetry
from dynabatch.api.cli.common import breakdown_table
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.sync.ahead import WallShare
from dynabatch.scheduler.runtime.seam import ShardResult
from dynabatch.scheduler.sync.coordinator import Coordinator
from dynabatch.scheduler.sync.epoch_report import EpochTotals, segment_busy, with_scores
from dynabatch.scheduler.sync.evaluation import EvalRound
from dynabatch.scheduler.telemetry import EpochRecord, StepBreakdown
from rich.console import Console

from bench.runtime_watch import watch_steps
from tests.fakes import EVAL_SPEEDUP, Lineages, TimedSimRuntime, edit_steps, sim_runtime
from tests.unit.test_engine_faults import SPE, _assert_exactly_once, _run_to, _spec


def _rep(w: str, step: int, **phases) -> StepTelemetry:
    return StepTelemetry(worker=w, epoch=0, step=step, batch=4, samples=4, compute_s=0.0,
                         wait_s=phases.get("wait_s", 0.0), loss_sum=4.0, **{
                             k: v for k, v in phases.items() if k != "wait_s"})


def test_phases_are_averaged_over_workers_then_steps():
    ep = EpochTotals()
    ep.add_step([_rep("a", 0, gather_s=0.1, forward_s=0.2, backward_s=0.4, wait_s=0.3,
                      optimizer_s=0.05, overlap_s=0.2, micro_batches=1, step_s=1.0),
                 _rep("b", 0, gather_s=0.3, forward_s=0.4, backward_s=0.8, wait_s=0.1,
                      optimizer_s=0.05, overlap_s=0.0, micro_batches=3, step_s=1.2)])
    ep.add_step([_rep("a", 1, gather_s=0.2, forward_s=0.2, backward_s=0.4, wait_s=0.1,
                      optimizer_s=0.05, overlap_s=0.2, micro_batches=1, step_s=0.8)])
    results = [type("R", (), {"steps": [_rep("a", 0, step_s=1.0), _rep("a", 1, step_s=0.8)]}),
               type("R", (), {"steps": [_rep("b", 0, step_s=1.2)]})]
    # The previous epoch's evaluation took 0.5 s of the segment's wall time.
    ep.add_segment(WallShare(0.5, 2.5, 5.0), segment_busy(results, 2))
    assert (ep.wall, ep.worker_seconds) == (2.5, 5.0)
    b = ep.breakdown(elapsed=4.0, evaluation=0.6, hidden=1.0)
    assert b.gather_s == pytest.approx((0.2 + 0.2) / 2)
    assert b.forward_s == pytest.approx((0.3 + 0.2) / 2)
    assert b.backward_s == pytest.approx((0.6 + 0.4) / 2)
    assert b.allreduce_wait_s == pytest.approx((0.2 + 0.1) / 2)
    assert b.optimizer_s == pytest.approx(0.05)
    assert b.overlap_s == pytest.approx((0.1 + 0.2) / 2)
    assert b.micro_batches == pytest.approx((2 + 1) / 2)
    # busy: the longest worker per segment (a: 1.8 s); the previous epoch's evaluation
    # (0.5 s) ran inside this epoch's wall time and is not the coordinator's.
    assert ep.busy == pytest.approx(1.8)
    assert b.coordinator_s == pytest.approx((4.0 - 0.5 - 1.8) / 2)
    assert b.evaluation_s == pytest.approx(0.3) and b.evaluation_hidden_s == pytest.approx(0.5)
    assert ep.loss_sum == pytest.approx(12.0) and ep.loss_samples == 12
    assert EpochTotals().breakdown(1.0, 0.0, 0.0) is None  # no step committed


def test_a_record_gets_its_scores_and_evaluation_share_when_they_arrive():
    ep = EpochTotals()
    ep.add_step([_rep("a", 0, step_s=1.0)])
    ep.add_step([_rep("a", 1, step_s=1.0)])
    record = EpochRecord(epoch=0, wall_s=2.0, steps=2, dataset_size=8, samples_trained=8,
                         train_loss=1.0, utilization=1.0, compute_balance=1.0,
                         policy="static", workers=[], elapsed_s=2.5)
    rnd = EvalRound(0, {"a": (0, 6), "b": (6, 10)}, None, 0.0, 10.0)
    rnd.results = {"a": ShardResult("a", {"n": 6.0}, 0.4), "b": ShardResult("b", {"n": 4.0}, 0.3)}
    done = with_scores(record, ep, {"loss": 0.7, "accuracy": 0.9, "perplexity": 2.0}, rnd)
    assert (done.test_loss, done.test_accuracy) == (0.7, 0.9)
    assert done.test_metrics == {"accuracy": 0.9, "perplexity": 2.0}
    assert done.evaluation_s == pytest.approx(0.4)  # the slowest shard
    assert done.evaluation_hidden_s == pytest.approx(0.3)  # the other shard's work
    assert done.breakdown.evaluation_s == pytest.approx(0.2)
    assert done.breakdown.evaluation_hidden_s == pytest.approx(0.15)
    none = with_scores(record, ep, None, rnd)
    assert none.test_loss is None and none.test_accuracy is None and none.test_metrics == {}


class _PhasedRuntime(TimedSimRuntime):
    """Simulated workers that report their phases: compute is 10% gather, 30% forward and
    60% backward; a step lasts its slowest worker's compute."""

    def _train(self, plans: dict[str, SegmentPlan], grace_s: float) -> list[WorkerOutcome]:
        return edit_steps(super()._train(plans, grace_s), _phased)


def _phased(rep: StepTelemetry) -> StepTelemetry:
    c = rep.compute_s
    return rep.model_copy(update={"gather_s": 0.1 * c, "forward_s": 0.3 * c,
                                  "backward_s": 0.6 * c})


def test_every_epoch_reports_its_breakdown_with_evaluation_off_the_critical_path():
    spec = _spec(rebalance={"mode": "epoch"}, policy="dbs")
    speeds = {0: 1000, 1: 500, 2: 250}
    lineages = Lineages()
    rt = sim_runtime(spec, n_train=1000, speeds=speeds, gradients=lineages,
                     runtime=_PhasedRuntime)
    coord = Coordinator("job", spec, runtime=rt, clock=rt.clock)
    steps: list = []
    watch_steps(rt, steps.append)
    coord.run()
    _assert_exactly_once(coord, lineages)
    hist = coord.history()
    for r in hist:
        b = r.breakdown
        rows = [row for row in steps if row[0].epoch == r.epoch]
        assert len(rows) == r.steps == SPE
        for phase, key in [("gather_s", "gather_s"), ("forward_s", "forward_s"),
                           ("backward_s", "backward_s"), ("wait_s", "allreduce_wait_s")]:
            want = sum(sum(getattr(x, phase) for x in row) / len(row) for row in rows) / SPE
            assert getattr(b, key) == pytest.approx(want), (r.epoch, key)
        # Evaluation: the shards ran side by side (in proportion to speed), so the
        # critical path paid less than the fastest worker scoring all 100 samples alone.
        alone = 100 / (max(speeds.values()) * EVAL_SPEEDUP)
        assert 0 < r.evaluation_s < 0.7 * alone
        assert r.evaluation_hidden_s > r.evaluation_s
        assert b.evaluation_s == pytest.approx(r.evaluation_s / SPE)
        assert b.evaluation_hidden_s == pytest.approx(r.evaluation_hidden_s / SPE)
        # The coordinator takes no simulated time: the wall time no step covers is the previous
        # epoch's evaluation, which ran on the workers, not the coordinator's.
        assert b.coordinator_s == pytest.approx(0.0, abs=1e-9), r.epoch
    assert coord.snapshot().step_breakdown == hist[-1].breakdown


def test_the_cli_table_shows_milliseconds_per_step_for_every_phase():
    b = StepBreakdown(gather_s=0.001, data_wait_s=0.0007, forward_s=0.002, backward_s=0.004,
                      allreduce_wait_s=0.0005, optimizer_s=0.0003, overlap_s=0.0015,
                      coordinator_s=0.0002, evaluation_s=0.0012, evaluation_hidden_s=0.0024,
                      micro_batches=2.0)
    console = Console(record=True, width=240)
    console.print(breakdown_table(b))
    text = console.export_text()
    header, row = [ln for ln in text.splitlines() if "│" in ln or "┃" in ln][:2]
    cols = [c.strip() for c in header.strip("┃ ").split("┃")]
    vals = [c.strip() for c in row.strip("│ ").split("│")]
    assert dict(zip(cols, vals, strict=True)) == {
        "gather": "1.0", "data wait": "0.7", "forward": "2.0", "backward": "4.0",
        "all-reduce wait": "0.5",
        "optimizer": "0.3", "coordinator": "0.2", "evaluation": "1.2",
        "evaluation hidden": "2.4", "overlapped": "1.5", "micro-batches": "2"}


class _DispatchingRuntime(TimedSimRuntime):
    """Every segment's results take 50 ms more than its steps to come back (dispatch): a
    segment's wall time is longer than its busiest worker's steps."""

    def collect_segment(self, ticket, grace_s):
        self.clock.sleep(0.05)
        return super().collect_segment(ticket, grace_s)


def test_an_evaluation_that_ran_before_a_regroup_is_not_taken_out_of_the_next_segment():
    """The epoch's evaluation is queued for the next segment, whose workers score it first;
    but a scale-down at that boundary waits for it and regroups, so it ran before the
    segment was sent. Nothing of that segment's time is evaluation's (it was taken out of
    the dispatch time the segment did spend)."""
    spec = _spec(rebalance={"mode": "epoch"}, policy="dbs")
    rt = sim_runtime(spec, n_train=1000, speeds={0: 1000, 1: 500, 2: 250},
                     gradients=Lineages(), runtime=_DispatchingRuntime)
    coord = Coordinator("job", spec, runtime=rt, clock=rt.clock)
    _run_to(coord, 1, 0)
    assert coord.evals.behind is not None  # epoch 0's round, queued for the next segment
    coord.scale(2)
    _run_to(coord, 1, 1)
    assert coord.membership.generation == 2 and coord.epochs.totals.evaluation == 0.0
    assert coord.run().state == JobState.SUCCEEDED

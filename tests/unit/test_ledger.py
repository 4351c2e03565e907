"""The ledger rebuilds each epoch from the workers' reports and checks exactly-once."""

from __future__ import annotations

import numpy as np
from dynabatch.actors.contracts import SegmentPlan, StepTelemetry, decode_counts, encode_counts
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.core.ledger import Ledger
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator
from hypothesis import given
from hypothesis import strategies as st

from tests.fakes import edit_steps, sim_runtime
from tests.unit.test_engine_faults import _spec


def _reports(epoch, step, start, shares, counts=None):
    size = sum(shares)
    cov = np.ones(size, dtype=np.int64) if counts is None else counts
    out, pos = [], start
    for i, n in enumerate(shares):
        out.append(StepTelemetry(worker=f"w{i}", epoch=epoch, step=step, batch=n, samples=n,
                                 compute_s=0.01, wait_s=0.0, loss_sum=0.0, start=pos,
                                 step_start=start, step_size=size, coverage=encode_counts(cov)))
        pos += n
    return out


def _epoch_steps(n, b):
    return [(s, s * b, min(b, n - s * b)) for s in range(-(-n // b))]


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_coverage_round_trips(values):
    arr = np.array(values, dtype=np.int64)
    assert (decode_counts(encode_counts(arr)) == arr).all()


@given(n=st.integers(1, 500), b=st.integers(1, 64), workers=st.integers(1, 5), data=st.data())
def test_any_split_of_every_step_verifies(n, b, workers, data):
    led = Ledger()
    led.begin_epoch(0, n)
    for step, start, size in _epoch_steps(n, b):
        cuts = sorted(data.draw(st.lists(st.integers(0, size), min_size=workers - 1,
                                         max_size=workers - 1)))
        shares = np.diff([0, *cuts, size]).tolist()
        led.commit(_reports(0, step, start, shares))
    v = led.verify()
    assert v.verified, v.problems
    assert v.samples_trained == n and sum(v.samples_by_worker.values()) == n


@given(n=st.integers(2, 300), b=st.integers(1, 32), data=st.data())
def test_a_missing_or_repeated_step_is_caught(n, b, data):
    steps = _epoch_steps(n, b)
    victim = data.draw(st.integers(0, len(steps) - 1))
    repeat = data.draw(st.booleans())
    led = Ledger()
    led.begin_epoch(0, n)
    for step, start, size in steps:
        if step == victim and not repeat:
            continue
        led.commit(_reports(0, step, start, [size]))
        if step == victim:
            led.commit(_reports(0, step, start, [size]))
    v = led.verify()
    assert not v.verified
    assert ("committed twice" in v.reason) if repeat else ("never trained" in v.reason)


def test_a_position_counted_twice_by_the_all_reduce_is_caught():
    led = Ledger()
    led.begin_epoch(0, 8)
    led.commit(_reports(0, 0, 0, [2, 2], counts=np.array([1, 2, 1, 1])))
    led.commit(_reports(0, 1, 4, [4]))
    v = led.verify()
    assert not v.verified and "trained more than once (positions [1, 2))" in v.reason


def test_reports_that_disagree_are_caught():
    led = Ledger()
    led.begin_epoch(0, 4)
    a, b = _reports(0, 0, 0, [2, 2])
    b = b.model_copy(update={"coverage": ((1, 3), (0, 1))})
    led.commit([a, b])
    assert "different coverage" in led.verify().reason


def test_a_worker_claiming_positions_outside_the_coverage_is_caught():
    led = Ledger()
    led.begin_epoch(0, 4)
    (a,) = _reports(0, 0, 0, [4], counts=np.array([1, 1, 1, 0]))
    led.commit([a])
    assert "did not contain" in led.verify().reason


def test_state_round_trip():
    led = Ledger()
    led.begin_epoch(2, 100)
    for step, start, size in _epoch_steps(100, 10)[:4]:
        led.commit(_reports(2, step, start, [size - 3, 3]))
    led.retry(10)
    copy = Ledger()
    copy.load_state(led.to_state())
    assert copy.to_state() == led.to_state()
    assert [s[0] for s in copy.to_state()["steps"]] == [0, 1, 2, 3]
    for step, start, size in _epoch_steps(100, 10)[4:]:
        copy.commit(_reports(2, step, start, [size]))
    v = copy.verify()
    assert v.verified and v.retried_samples == 10 and v.epoch == 2


def test_the_retried_total_spans_epochs_and_checkpoints():
    """An epoch's verification has its own retried samples; the job's total (what the
    snapshot reports) keeps every epoch's, through a checkpoint's state too."""
    led = Ledger()
    led.begin_epoch(0, 100)
    led.retry(10)
    led.begin_epoch(1, 100)
    led.retry(4)
    assert led.verify().retried_samples == 4 and led.retried_total == 14
    copy = Ledger()
    copy.load_state(led.to_state())
    assert copy.retried_total == 14 and copy.verify().retried_samples == 4
    copy.begin_epoch(2, 100)
    assert copy.retried_total == 14 and copy.verify().retried_samples == 0


class _LosingRuntime(SimRuntime):
    """A defective all-reduce: one sample of step 3 is missing from what it summed."""

    def _train(self, plans: dict[str, SegmentPlan], grace_s: float) -> list[WorkerOutcome]:
        return edit_steps(super()._train(plans, grace_s), _lose_first_sample_of_step_3)


def _lose_first_sample_of_step_3(rep: StepTelemetry) -> StepTelemetry:
    if rep.step != 3:
        return rep
    counts = decode_counts(rep.coverage)
    counts[0] = 0
    return rep.model_copy(update={"coverage": encode_counts(counts)})


def test_a_sample_the_workers_did_not_train_fails_the_job_with_the_reason():
    spec = _spec()
    rt = sim_runtime(spec, n_train=1000, runtime=_LosingRuntime)
    snap = Coordinator("lose", spec, runtime=rt, clock=rt.clock).run()
    assert snap.state == JobState.FAILED
    assert "exactly-once" in snap.reason and "1 samples never trained (positions [192, 193))" \
        in snap.reason

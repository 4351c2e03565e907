"""Failure classification and the retry budget: every failure is bounded."""

from __future__ import annotations

from dynabatch.actors.contracts import SegmentResult
from dynabatch.scheduler.core.failures import RetryBudget, WorkerOutcome, classify
from dynabatch.scheduler.core.sync.protocol import Position
from hypothesis import given
from hypothesis import strategies as st


def _res(w, kind=None, took=0.01):
    return WorkerOutcome(w, result=SegmentResult(
        worker=w, steps=[], error=None if kind is None else f"{kind} error",
        error_kind=kind, failed_compute_s=took))


def test_complete_segment_is_no_failure():
    assert classify([_res("w0"), _res("w1")], 10) is None


def test_lost_and_hung_workers_are_removed():
    f = classify([_res("w0", "peer"), WorkerOutcome("w1", lost="died: node lost"),
                  WorkerOutcome("w2", lost="hung: no answer")], 10)
    assert set(f.lost) == {"w1", "w2"} and not f.compute and not f.stragglers


def test_own_error_is_compute_not_straggler():
    f = classify([_res("w0", "peer"), _res("w1", "compute", took=50.0)], 10)
    assert f.compute == {"w1": "compute error"} and not f.stragglers


def test_straggler_is_the_slow_one_when_everyone_answered():
    f = classify([_res("w0", "peer", 0.1), _res("w1", "peer", 12.0), _res("w2", "peer", 0.2)], 10)
    assert list(f.stragglers) == ["w1"]
    f = classify([_res("w0", "peer", 0.1), _res("w1", "peer", 0.3)], 10)
    assert not f.stragglers and f.peer_errors


@given(st.lists(st.sampled_from(["compute", "peer", "lost"]), min_size=1, max_size=30),
       st.integers(0, 5))
def test_retries_at_one_position_are_bounded(kinds, max_retries):
    budget = RetryBudget(max_retries)
    pos = Position(0, 3)
    compute = unexplained = 0
    for kind in kinds:
        if kind == "compute":
            f = classify([_res("w0", "peer"), _res("w1", "compute")], 10)
            compute += 1
        elif kind == "peer":
            f = classify([_res("w0", "peer"), _res("w1", "peer")], 10)
            unexplained += 1
        else:
            f = classify([_res("w0", "peer"), WorkerOutcome("w1", lost="died")], 10)
        verdict = budget.failed(pos, f)
        if compute > max_retries or unexplained > max_retries + 1:
            assert verdict is not None
            return
        assert verdict is None


def test_success_or_a_new_position_resets_the_budget():
    budget = RetryBudget(0)
    f = classify([_res("w0", "compute")], 10)
    assert budget.failed(Position(0, 1), f) is not None
    budget.succeeded()
    assert budget.failed(Position(0, 1), classify([_res("w0", "peer")], 10)) is None


@given(st.lists(st.sampled_from(["fail", "lost", "ok"]), min_size=1, max_size=30),
       st.integers(0, 5))
def test_regroups_that_fail_in_a_row_are_bounded(kinds, max_retries):
    # A regroup that lost workers forms a different group next time: it never ends the job
    # by itself, but it counts towards the run of failures the next one is judged by.
    budget = RetryBudget(max_retries)
    run = 0
    for kind in kinds:
        if kind == "ok":
            budget.regrouped()
            run = 0
            continue
        run += 1
        verdict = budget.regroup_failed(kind == "lost", "no answer")
        if kind == "fail" and run > max_retries + 1:
            assert verdict == (f"the group could not be formed {run} times in a row: "
                               "no answer")
            return
        assert verdict is None


def test_regroup_failures_do_not_touch_the_segment_retries():
    budget = RetryBudget(0)
    assert budget.regroup_failed(False, "x") is None
    assert not budget.retrying
    f = classify([_res("w0", "peer"), WorkerOutcome("w1", lost="died")], 10)
    assert budget.failed(Position(0, 2), f) is None
    assert budget.retrying  # the next segment is the retry, whatever happens in between
    budget.regrouped()
    assert budget.retrying and budget.regroup_failed(False, "x") is None
    budget.succeeded()
    assert not budget.retrying


def test_a_user_error_fails_the_job_at_once_naming_it():
    """An error in the job's data, model or configuration (error_kind user: a token id
    beyond the vocabulary, dict samples whose keys differ) fails the same way on every node:
    the first one fails the job, with no retries, and says it is not a fault."""
    f = classify([_res("w0", "peer"), _res("w1", "user", took=50.0)], 10)
    assert f.user == {"w1": "user error"}
    assert not f.compute and not f.stragglers
    verdict = RetryBudget(2).failed(Position(0, 3), f)
    assert verdict == ("worker w1 failed at epoch 0 step 3 with user error (an error in the "
                       "job's data, model or configuration: not retried)")
    assert "user error" in f.summary


def test_a_user_error_is_told_from_its_mark_or_its_ray_cause():
    from dynabatch.actors.data.source import DataError
    from dynabatch.actors.errors import UserError, is_user_error

    class Wrong(DataError, UserError):
        pass

    assert is_user_error(Wrong("dataset.name: x"))
    assert not is_user_error(DataError("dataset.name: sample 3: OSError"))
    wrapped = RuntimeError("ray::Worker.run_segment()")
    wrapped.cause = Wrong("x")
    assert is_user_error(wrapped)


def test_an_evaluation_user_error_is_not_retried_and_others_are():
    budget = RetryBudget(max_retries=2)
    assert budget.evaluation_failed(0, "w1", (0, 8), "ValueError: flaky") is None
    verdict = budget.evaluation_failed(0, "w1", (0, 8), "TokenIdError: token id 60",
                                       user=True)
    assert verdict == ("evaluation of epoch 0 failed on w1 (test samples [0, 8)) with "
                       "TokenIdError: token id 60 (an error in the job's data, model or "
                       "configuration: not retried)")

"""Failure classification and the failure policy: every failure gets one decision, and
retries are bounded."""

from __future__ import annotations

from dynabatch.actors.contracts import SegmentResult
from dynabatch.scheduler.core.failures import (
    Attempts,
    Evict,
    Fail,
    FailureDecision,
    FailureEvent,
    FailurePolicy,
    Retry,
    RollBack,
    WorkerOutcome,
    classify,
)
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


class Budget:
    """The policy with its attempts threaded through, as the driver holds them."""

    def __init__(self, max_retries: int):
        self.policy, self.attempts = FailurePolicy(max_retries), Attempts()

    def decide(self, event: FailureEvent) -> FailureDecision:
        self.attempts, decision = self.policy.decide(self.attempts, event)
        return decision

    def segment(self, position: Position, failure, counted: bool = True) -> str | None:
        d = self.decide(FailureEvent("segment", position=position, failure=failure,
                                     counted=counted))
        return d.reason if isinstance(d, Fail) else None

    def regroup(self, lost: bool, why: str) -> str | None:
        d = self.decide(FailureEvent("regroup", lost=lost, error=why))
        return d.reason if isinstance(d, Fail) else None


@given(st.lists(st.sampled_from(["compute", "peer", "lost"]), min_size=1, max_size=30),
       st.integers(0, 5))
def test_retries_at_one_position_are_bounded(kinds, max_retries):
    budget = Budget(max_retries)
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
        verdict = budget.segment(pos, f)
        if compute > max_retries or unexplained > max_retries + 1:
            assert verdict is not None
            return
        assert verdict is None


def test_success_or_a_new_position_resets_the_budget():
    budget = Budget(0)
    f = classify([_res("w0", "compute")], 10)
    assert budget.segment(Position(0, 1), f) is not None
    budget.attempts = budget.attempts.succeeded()
    assert budget.segment(Position(0, 1), classify([_res("w0", "peer")], 10)) is None


@given(st.lists(st.sampled_from(["fail", "lost", "ok"]), min_size=1, max_size=30),
       st.integers(0, 5))
def test_regroups_that_fail_in_a_row_are_bounded(kinds, max_retries):
    # A regroup that lost workers forms a different group next time: it never ends the job
    # by itself, but it counts towards the run of failures the next one is judged by.
    budget = Budget(max_retries)
    run = 0
    for kind in kinds:
        if kind == "ok":
            budget.attempts = budget.attempts.regrouped()
            run = 0
            continue
        run += 1
        verdict = budget.regroup(kind == "lost", "no answer")
        if kind == "fail" and run > max_retries + 1:
            assert verdict == (f"the group could not be formed {run} times in a row: "
                               "no answer")
            return
        assert verdict is None


def test_regroup_failures_do_not_touch_the_segment_retries():
    budget = Budget(0)
    assert budget.regroup(False, "x") is None
    assert budget.attempts.position is None
    f = classify([_res("w0", "peer"), WorkerOutcome("w1", lost="died")], 10)
    assert budget.segment(Position(0, 2), f) is None
    # The retry's position is counted, whatever happens before it runs.
    assert budget.attempts.position == Position(0, 2)
    budget.attempts = budget.attempts.regrouped()
    assert budget.attempts.position == Position(0, 2) and budget.regroup(False, "x") is None
    budget.attempts = budget.attempts.succeeded()
    assert budget.attempts.position is None


def test_a_straggler_is_evicted_by_the_policy_counted_or_not():
    f = classify([_res("w0", "peer", 0.1), _res("w1", "peer", 12.0)], 10)
    for counted in (True, False):
        attempts, d = FailurePolicy(0).decide(
            Attempts(), FailureEvent("segment", position=Position(0, 1), failure=f,
                                     counted=counted))
        assert isinstance(d, Evict) and list(d.workers) == ["w1"]
        assert d.workers["w1"].startswith("straggler: a step computed 12.0s")
        assert (attempts.position is not None) == counted


_outcomes = st.lists(
    st.one_of(
        st.builds(_res, st.sampled_from(["w0", "w1", "w2"]),
                  st.sampled_from([None, "peer", "compute", "user"]), st.floats(0, 20)),
        st.builds(lambda w: WorkerOutcome(w, lost="died"), st.sampled_from(["w0", "w1"]))),
    min_size=1, max_size=4)
_events = st.one_of(
    st.builds(lambda out, c, e, s: FailureEvent(
        "segment", position=Position(e, s), failure=classify(out, 10), counted=c),
        _outcomes, st.booleans(), st.integers(0, 3), st.integers(0, 9)),
    st.builds(lambda lost: FailureEvent("regroup", lost=lost, error="no answer"),
              st.booleans()),
    st.builds(lambda user, e: FailureEvent("evaluation", position=Position(e, 0), worker="w1",
                                           shard=(0, 8), error="ValueError", user=user),
              st.booleans(), st.integers(0, 3)),
    st.builds(lambda err, ck: FailureEvent("state_lost", position=Position(1, 2), error=err,
                                           checkpoint=ck and not err),
              st.sampled_from(["", "corrupt"]), st.booleans()),
    st.builds(lambda k: FailureEvent(k, error=f"{k} failed"),
              st.sampled_from(["no_workers", "data", "exactly_once"])),
)


@given(st.lists(_events, min_size=1, max_size=40), st.integers(0, 3))
def test_every_failure_gets_exactly_one_decision(events, max_retries):
    """Whatever failures come, in any order, each gets one decision of the four; a job
    that fails says why in one line; what is retried is bounded by max_retries."""
    policy, attempts = FailurePolicy(max_retries), Attempts()
    for event in events:
        attempts, decision = policy.decide(attempts, event)
        assert isinstance(decision, Retry | Evict | RollBack | Fail)
        if isinstance(decision, Fail):
            assert decision.reason and "\n" not in decision.reason
        if isinstance(decision, RollBack):
            assert event.kind == "state_lost" and event.checkpoint
        if event.kind in ("no_workers", "data", "exactly_once"):
            assert isinstance(decision, Fail)
        assert attempts.compute <= max_retries + 1
        assert attempts.regroup >= 0 and attempts.evaluation >= 0
        if isinstance(decision, Fail):
            return  # the job is over: no failure comes after


@given(st.booleans(), st.booleans(), st.one_of(st.none(), st.text(min_size=1, max_size=20)))
def test_a_lost_state_rolls_back_to_a_loaded_checkpoint_or_fails_with_the_reason(
        has_dir, found, error):
    error = error if has_dir else None  # only a job that keeps checkpoints loads one
    _, d = FailurePolicy(2).decide(Attempts(), FailureEvent(
        "state_lost", position=Position(3, 7), error=error or "",
        checkpoint=has_dir and found and error is None))
    assert "committed at epoch 3 step 7" in d.reason
    assert isinstance(d, RollBack) == (has_dir and found and error is None)
    if isinstance(d, RollBack):
        assert d.reason.endswith("rolling back")
    elif error is not None:
        assert d.reason.endswith(f"cannot be loaded: {error}")
    else:  # never from freshly initialised weights
        assert "no checkpoint to restore" in d.reason


def test_a_user_error_fails_the_job_at_once_naming_it():
    """An error in the job's data, model or configuration (error_kind user: a token id
    beyond the vocabulary, dict samples whose keys differ) fails the same way on every node:
    the first one fails the job, with no retries, and says it is not a fault."""
    f = classify([_res("w0", "peer"), _res("w1", "user", took=50.0)], 10)
    assert f.user == {"w1": "user error"}
    assert not f.compute and not f.stragglers
    verdict = Budget(2).segment(Position(0, 3), f)
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
    budget = Budget(max_retries=2)

    def evaluation(error: str, user: bool = False) -> FailureDecision:
        return budget.decide(FailureEvent("evaluation", position=Position(0, 0), worker="w1",
                                          shard=(0, 8), error=error, user=user))

    assert isinstance(evaluation("ValueError: flaky"), Retry)
    verdict = evaluation("TokenIdError: token id 60", user=True).reason
    assert verdict == ("evaluation of epoch 0 failed on w1 (test samples [0, 8)) with "
                       "TokenIdError: token id 60 (an error in the job's data, model or "
                       "configuration: not retried)")

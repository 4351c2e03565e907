"""The synchronous driver's pure decisions: the pipeline (send ahead, cross an epoch, where
the next segment starts, whose time a segment took) and the boundary (wait for workers,
roll back, evaluate again, checkpoint due)."""

from __future__ import annotations

import pytest
from dynabatch.scheduler.core.sync.ahead import (
    ahead_end,
    attribute_wall,
    can_cross_epoch,
    can_send_ahead,
    plan_ahead,
)
from dynabatch.scheduler.core.sync.boundary import (
    evaluate_again,
    wait_for_minimum,
)
from dynabatch.scheduler.core.sync.protocol import Position
from hypothesis import given
from hypothesis import strategies as st

times = st.floats(0, 1e6, allow_nan=False)


# ------------------------------------------------------------------ the pipeline
@given(st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.booleans())
def test_a_segment_is_sent_ahead_only_with_nothing_to_do_at_rest(
        cancel, retrying, requests, regroup, fixed):
    ok = can_send_ahead(cancel_requested=cancel, retrying=retrying,
                        requests_pending=requests, regroup_due=regroup, stamps_fixed=fixed)
    # Whatever needs the group at rest stops it.
    assert ok == (fixed and not (cancel or retrying or requests or regroup))


@given(st.integers(0, 20), st.integers(1, 20), st.booleans(),
       st.integers(1, 4), st.integers(1, 4), st.booleans(), st.booleans())
def test_an_epoch_is_crossed_only_at_the_same_batch_with_nothing_decided_between(
        nxt, epochs, goodput, next_batch, batch, due, replans):
    ok = can_cross_epoch(next_epoch=nxt, epochs=epochs, goodput=goodput,
                         next_batch=next_batch, batch=batch, checkpoint_due=due,
                         replans_at_end=replans)
    if ok:
        assert nxt < epochs and not goodput and next_batch == batch and not due
        assert not replans
    else:
        assert nxt >= epochs or goodput or next_batch != batch or due or replans


@given(st.integers(0, 50), st.integers(0, 99), st.integers(1, 10), st.integers(1, 100))
def test_the_next_segment_starts_where_this_one_ends_or_at_the_next_epoch(
        epoch, step, length, spe):
    at = plan_ahead(Position(epoch, step), length, spe)
    if step + length < spe:
        assert at == Position(epoch, step + length)
    else:
        assert at == Position(epoch + 1, 0)
    assert at > Position(epoch, step)  # always forward


def test_a_replan_waits_for_the_segment_in_flight_in_this_epoch_only():
    assert ahead_end(None, 0, 3) is None
    assert ahead_end(Position(3, 4), 2, 3) == 6
    assert ahead_end(Position(4, 0), 2, 3) is None  # sent across the epoch's end


@given(times, times, st.floats(0, 1e3), st.one_of(st.none(), st.floats(0, 1e3)),
       st.integers(1, 8), st.integers(0, 8), st.integers(1, 64))
def test_wall_time_is_split_between_the_evaluation_and_the_completed_steps(
        sent, last, took, evaluation_s, planned, done, workers):
    done = min(done, planned)
    now = max(sent, last) + took
    share = attribute_wall(sent=sent, last_collected=last, now=now, evaluation_s=evaluation_s,
                           done=done, planned=planned, workers=workers)
    total = now - max(sent, last)  # from the later of sending and the last collection
    assert 0.0 <= share.evaluation <= total
    if evaluation_s is None:
        assert share.evaluation == 0.0
    else:
        assert share.evaluation == min(total, evaluation_s)
    if done == 0:  # nothing trained: the epoch is charged nothing
        assert share.wall == share.worker_seconds == 0.0
    else:
        rest = total - share.evaluation
        assert share.wall == pytest.approx(rest * done / planned, abs=1e-9)
        assert share.worker_seconds == pytest.approx(share.wall * workers, rel=1e-12,
                                                     abs=1e-9)
        assert share.wall <= rest + 1e-9


def test_a_segment_sent_ahead_is_timed_from_when_the_one_before_was_collected():
    # Sent at 1, but its workers were busy with the previous one until 5.
    share = attribute_wall(sent=1.0, last_collected=5.0, now=8.0, evaluation_s=1.0,
                           done=2, planned=4, workers=3)
    assert (share.evaluation, share.wall, share.worker_seconds) == (1.0, 1.0, 3.0)


# ------------------------------------------------------------------ the boundary
@given(st.lists(st.floats(0, 100), min_size=1, max_size=20), st.booleans(),
       st.floats(1, 500), st.floats(1, 500))
def test_a_wait_for_workers_starts_once_and_gives_up_at_its_limit(
        gaps, started, start_timeout, worker_timeout):
    since, now = None, 1000.0
    limit = worker_timeout if started else start_timeout  # a job never started waits longer
    for i, gap in enumerate(gaps):
        now += gap
        w = wait_for_minimum(since=since, now=now, started=started,
                             start_timeout_s=start_timeout, worker_wait_timeout_s=worker_timeout)
        assert w.first == (i == 0) and w.limit == limit
        assert w.since == (now if i == 0 else since)
        assert w.waited == now - w.since >= 0
        assert w.give_up == (w.waited >= limit)
        if w.give_up:
            return
        since = w.since


def test_the_wait_fails_exactly_at_the_timeout_passed_in():
    kw = {"started": True, "start_timeout_s": 900.0, "worker_wait_timeout_s": 30.0}
    assert not wait_for_minimum(since=10.0, now=39.9, **kw).give_up
    w = wait_for_minimum(since=10.0, now=40.0, **kw)
    assert w.give_up and w.limit == 30.0 and not w.first



@given(st.booleans(), st.booleans(), st.booleans(),
       st.lists(st.sampled_from(["w0", "w1", "w2"]), unique=True, max_size=3),
       st.floats(0, 100))
def test_a_lost_evaluation_is_run_again_only_while_the_holders_have_the_weights(
        complete, failed, last, holders, waited):
    again = evaluate_again(complete=complete, shard_failed=failed, last_queued=last,
                           holders=tuple(holders), waited_s=waited)
    if not complete and failed and last and holders:
        assert again is not None
        assert again.workers == tuple(holders) and again.waited_s == waited
    else:
        assert again is None

"""JobState: terminal flags and the transition table."""

from __future__ import annotations

import itertools

import pytest
from dynabatch.scheduler.core.lifecycle import _TRANSITIONS, InvalidTransition, JobState

S = JobState
ALLOWED = {
    (S.PENDING, S.RUNNING),
    (S.PENDING, S.FAILED),
    (S.PENDING, S.CANCELLED),
    (S.RUNNING, S.PENDING),  # membership fell below min_workers: wait for nodes
    (S.RUNNING, S.SUCCEEDED),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.CANCELLED),
}


def test_values_are_their_names():
    assert [s.value for s in S] == ["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]
    assert S("RUNNING") is S.RUNNING
    assert S.RUNNING == "RUNNING"  # StrEnum: JSON and SQLite see plain strings


def test_terminal_flags():
    assert {s for s in S if s.is_terminal} == {S.SUCCEEDED, S.FAILED, S.CANCELLED}
    assert not S.PENDING.is_terminal
    assert not S.RUNNING.is_terminal


@pytest.mark.parametrize(("old", "new"), list(itertools.product(S, S)))
def test_transition_table(old, new):
    assert old.can_become(new) == ((old, new) in ALLOWED)


def test_table_covers_every_state_and_terminals_are_final():
    assert set(_TRANSITIONS) == set(S)
    for s in S:
        assert s not in _TRANSITIONS[s], f"{s} -> {s} should not be a transition"
        if s.is_terminal:
            assert not _TRANSITIONS[s]
        else:
            # every live state can end: fail and cancel are always possible
            assert {S.FAILED, S.CANCELLED} <= _TRANSITIONS[s]


def test_every_state_reachable_from_every_live_one():
    """The job store takes any state from a live job's sampled snapshot on this ground."""
    for live in (s for s in S if not s.is_terminal):
        seen, frontier = {live}, [live]
        while frontier:
            for nxt in _TRANSITIONS[frontier.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        assert seen == set(S), live


def test_invalid_transition_error():
    err = InvalidTransition(S.SUCCEEDED, S.RUNNING)
    assert isinstance(err, ValueError)
    assert err.old is S.SUCCEEDED and err.new is S.RUNNING
    assert str(err) == "job is SUCCEEDED; it cannot become RUNNING"

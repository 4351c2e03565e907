"""Every write path of the job store moves a job's state only as the lifecycle allows
(scheduler/core/lifecycle.py): a move it does not allow is refused and leaves the row as it
was. The paths: ``transition`` (a service-initiated change), ``save_snapshot`` (what the
coordinator reported), ``mark_resumed`` (a new coordinator from the checkpoint) and
``interrupt`` (the embedded Ray ended; resumed when the API starts again)."""

from __future__ import annotations

import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import InvalidTransition, JobState
from dynabatch.scheduler.telemetry import JobSnapshot
from dynabatch.service.store import JobStore
from hypothesis import given, settings
from hypothesis import strategies as st

LIVE = {JobState.PENDING, JobState.RUNNING}
PATHS = ("transition", "save_snapshot", "mark_resumed", "interrupt")


def _expected(path: str, old: JobState, new: JobState) -> bool:
    """The rules, written out from the lifecycle's meaning rather than from its table: a
    finished job stays finished, except that a FAILED or CANCELLED job may be resumed."""
    if path == "transition":  # one step of the state machine
        steps = {
            JobState.PENDING: {JobState.RUNNING, JobState.FAILED, JobState.CANCELLED},
            JobState.RUNNING: {
                JobState.PENDING,
                JobState.SUCCEEDED,
                JobState.FAILED,
                JobState.CANCELLED,
            },
        }
        return new in steps.get(old, set())
    if path == "save_snapshot":  # sampled: a live job may be seen anywhere further on
        return old in LIVE
    if path == "mark_resumed":
        return old is not JobState.SUCCEEDED
    return old in LIVE  # interrupt


def _snap(job_id: str, state: JobState) -> JobSnapshot:
    return JobSnapshot(
        job_id=job_id,
        name="job",
        state=state,
        epochs=2,
        policy="affine",
        finished_at=1.0 if state.is_terminal else None,
    )


def _job_in(store: JobStore, job_id: str, state: JobState) -> None:
    store.create(job_id, JobSpec.model_validate({"name": "job"}), cluster="c", now=0.0)
    if state is JobState.PENDING:
        return
    store.save_snapshot(_snap(job_id, JobState.RUNNING), now=1.0)
    if state is not JobState.RUNNING:
        store.transition(job_id, state, "ended", now=2.0)


def _write(store: JobStore, path: str, job_id: str, new: JobState) -> None:
    if path == "transition":
        store.transition(job_id, new, "moved", now=3.0)
    elif path == "save_snapshot":
        if not store.save_snapshot(_snap(job_id, new), now=3.0):
            raise InvalidTransition(store.get(job_id).state, new)
    elif path == "mark_resumed":
        store.mark_resumed(job_id, "resumed", automatic=False, now=3.0)
    elif store.interrupt(job_id, "interrupted", now=3.0) is None:
        raise InvalidTransition(store.get(job_id).state, new)


@settings(max_examples=150, deadline=None)
@given(
    old=st.sampled_from(list(JobState)),
    new=st.sampled_from(list(JobState)),
    path=st.sampled_from(PATHS),
)
def test_the_store_refuses_every_move_the_lifecycle_does_not_allow(
    old: JobState, new: JobState, path: str
) -> None:
    if path in ("mark_resumed", "interrupt"):
        new = JobState.PENDING  # where those paths lead
    store = JobStore(":memory:")
    try:
        _job_in(store, "j", old)
        before = store.get("j")
        assert before is not None and before.state is old
        try:
            _write(store, path, "j", new)
        except InvalidTransition as err:
            assert not _expected(path, old, new), f"{path} {old} -> {new} refused: {err}"
            after = store.get("j")
            assert after is not None
            assert (after.state, after.reason, after.resumes) == (
                before.state,
                before.reason,
                before.resumes,
            )
            assert store.logs("j") == []  # a refused resume logs nothing either
        else:
            assert _expected(path, old, new), f"{path} let {old} become {new}"
            after = store.get("j")
            assert after is not None and after.state is new
    finally:
        store.close()


@pytest.mark.parametrize("state", [JobState.FAILED, JobState.CANCELLED])
def test_a_resume_is_the_one_way_out_of_a_terminal_state(state: JobState) -> None:
    assert state.resumed() is JobState.PENDING
    with pytest.raises(InvalidTransition, match="SUCCEEDED"):
        JobState.SUCCEEDED.resumed()

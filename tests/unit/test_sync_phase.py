"""The synchronous driver's Phase: the transition table, its enforcement, and the phases a
driven job really goes through."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import pytest
from dynabatch.scheduler.core.failures import FailurePolicy
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.membership import Membership
from dynabatch.scheduler.core.sync.phase import InvalidPhase, Phase, moves
from dynabatch.scheduler.runtime.seam import DataInfo
from dynabatch.scheduler.sim.calls import Call
from dynabatch.scheduler.sim.cluster_spec import Fault
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator
from dynabatch.scheduler.sync.job import SyncJob
from hypothesis import given
from hypothesis import strategies as st

from tests.fakes import sim_job
from tests.unit.test_engine_faults import N, _spec

LIVE = [p for p in Phase if not p.is_terminal]


def _reachable(start: Phase) -> set[Phase]:
    seen, todo = {start}, deque([start])
    while todo:
        for nxt in moves()[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_table_covers_every_phase_and_done_is_the_only_end():
    assert set(moves()) == set(Phase)
    assert moves()[Phase.DONE] == frozenset()
    assert [p for p in Phase if p.is_terminal] == [Phase.DONE]


def test_every_phase_is_reachable_from_starting_and_can_end():
    assert _reachable(Phase.STARTING) == set(Phase)
    for p in LIVE:
        assert Phase.DONE in moves()[p], p  # a failure or an internal error, anywhere


def test_phases_entered_inside_a_step_have_only_their_entries():
    # Rolling back happens in a regroup, and goes back to it; an epoch ends while training
    # or while a cancellation commits the segment in flight.
    into = {p: {q for q in Phase if p in moves()[q]} for p in Phase}
    assert into[Phase.ROLLING_BACK] == {Phase.REGROUPING}
    assert moves()[Phase.ROLLING_BACK] == {Phase.REGROUPING, Phase.DONE}
    assert into[Phase.ENDING_EPOCH] == {Phase.TRAINING, Phase.CANCELLING}
    assert Phase.CANCELLING not in moves()[Phase.ROLLING_BACK]
    # A cancellation does not train on, wait or regroup.
    assert moves()[Phase.CANCELLING] == {Phase.ENDING_EPOCH, Phase.FINISHING, Phase.DONE}


@given(st.sampled_from(list(Phase)), st.sampled_from(list(Phase)))
def test_can_become_is_the_table_and_staying_is_allowed(old, new):
    assert old.can_become(new) == (new is old or new in moves()[old])


def _job() -> SyncJob:
    m = Membership(
        workers=2, min_workers=1, max_workers=None, smallest_batch=8, max_batch=None,
        max_possible=16,
    )
    return SyncJob(job_id="j", membership=m, regime=None, policy=None, failures=FailurePolicy(1))


@given(st.lists(st.tuples(st.sampled_from(list(Phase)), st.floats(0, 1e6)), max_size=40))
def test_a_job_moves_only_along_the_table_and_records_each_change(walk):
    job = _job()
    job.waiting_since = None
    for new, at in walk:
        old, changes = job.phase, len(job.phase_changes)
        if old is Phase.WAITING_FOR_WORKERS and job.waiting_since is None:
            job.waiting_since = at  # as the driver does when a wait begins
        if old.can_become(new):
            job.become(new, at)
            assert job.phase is new
            if new is not old:
                last = job.phase_changes[-1]
                assert (last.old, last.new, last.at) == (old, new, at)
                # A wait's start belongs to the wait: the next one starts over.
                assert job.waiting_since is None or new is Phase.WAITING_FOR_WORKERS
            else:
                assert len(job.phase_changes) == changes
        else:
            with pytest.raises(InvalidPhase):
                job.become(new, at)
            assert job.phase is old and len(job.phase_changes) == changes


def test_invalid_phase_pickles_intact():
    import pickle

    err = pickle.loads(pickle.dumps(InvalidPhase(Phase.DONE, Phase.TRAINING)))
    assert (err.old, err.new) == (Phase.DONE, Phase.TRAINING)
    assert "DONE" in str(err)


# ------------------------------------------------------------------ a driven job's phases


class _Cancelling(SimRuntime):
    """The simulator's runtime with a test's ``hook``, called as the job loads its data
    (its first call, in STARTING), and a stop for a driver that would evaluate again
    without end."""

    hook: Callable[[], None] | None = None

    def load_data(self) -> DataInfo:
        if self.hook is not None:
            self.hook()
        return super().load_data()

    def submit_evaluation(self, shards: dict[str, tuple[int, int]]) -> Call:
        if self.record.evaluations >= 100:
            raise RuntimeError("evaluated 100 times")
        return super().submit_evaluation(shards)


def _coord(events: list[dict] | None = None, **kw) -> tuple[Coordinator, _Cancelling]:
    """A job on the simulator's runtime over 3 nodes (node i computes 1000, 500, 250
    samples/s); ``events``: nodes that fail or join as the job trains a step."""
    spec = _spec(**{"epochs": 2, **kw})
    coord, rt, _ = sim_job(
        spec, n_train=N, speeds={0: 1000, 1: 500, 2: 250}, runtime=_Cancelling, events=events
    )
    return coord, rt


# Node 1 fails as the job trains step 4 of epoch 0: under max_batch 24 the job waits for a
# third worker (2 x 24 cannot hold B=64).
LOSE_NODE1 = [{"epoch": 0, "step": 4, "fail": {"class": "node01", "index": 0}}]
# Every node fails as the job trains step 6 of epoch 1, and 3 fresh nodes join.
LOSE_EVERY_NODE = [
    {"epoch": 1, "step": 6, "fail": 3},
    {"epoch": 1, "step": 6, "join": {"class": "node00", "count": 3}},
]


def _path(coord: Coordinator) -> list[Phase]:
    return [c.new for c in coord.phase_changes()]


def _lost(coord: Coordinator) -> list[str]:
    return [e.worker for e in coord.membership_events() if e.kind == "failure"]


def test_a_clean_run_starts_regroups_trains_ends_epochs_and_finishes():
    coord, _ = _coord()
    assert coord.phase is Phase.STARTING
    assert coord.run().state == JobState.SUCCEEDED
    assert coord.phase is Phase.DONE
    T, E = Phase.TRAINING, Phase.ENDING_EPOCH
    assert _path(coord) == [Phase.REGROUPING, T, E, T, E, Phase.FINISHING, Phase.DONE]


def test_a_lost_worker_regroups_at_the_next_boundary_and_its_retry_runs_alone():
    coord, rt = _coord()
    rt.inject(Fault(kind="die", worker=1, epoch=0, step=5))
    sent = []
    while coord.step():
        sent.append((coord.phase, coord.job.attempts.retrying, coord.job.ahead is not None))
    assert coord.snapshot().state == JobState.SUCCEEDED
    assert _lost(coord) == ["w1"]
    path = _path(coord)
    # The first group, the one after the loss (and one when a replacement joins).
    assert path.count(Phase.REGROUPING) >= 2
    i = path.index(Phase.REGROUPING, 1)
    assert path[i - 1] is Phase.TRAINING and path[i + 1] is Phase.TRAINING
    # While the failure is being retried, nothing is sent ahead of the retry.
    assert any(retrying for _, retrying, _ in sent)
    assert not any(retrying and ahead for _, retrying, ahead in sent)


def test_every_holder_lost_rolls_back_inside_the_regroup(tmp_path):
    coord, _ = _coord(LOSE_EVERY_NODE, checkpoint={"dir": str(tmp_path)}, epochs=3)
    assert coord.run().state == JobState.SUCCEEDED
    assert sorted(_lost(coord)) == ["w0", "w1", "w2"]
    path = _path(coord)
    i = path.index(Phase.ROLLING_BACK)
    assert path[i - 1] is Phase.REGROUPING and path[i + 1] is Phase.REGROUPING


def test_too_few_workers_wait_then_fail_after_the_timeout():
    # node01 fails at step 4 of epoch 0; the other two nodes' one CPU each is their worker's,
    # so no third worker can start and 2 x 24 cannot hold B=64.
    coord, _ = _coord(LOSE_NODE1, max_batch=24)
    phases = []
    while coord.step():
        phases.append(coord.phase)
    assert coord.snapshot().state == JobState.FAILED
    assert _lost(coord) == ["w1"]
    assert Phase.WAITING_FOR_WORKERS in phases and coord.phase is Phase.DONE
    waits = [c for c in coord.phase_changes() if c.new is Phase.WAITING_FOR_WORKERS]
    done = coord.phase_changes()[-1]
    assert done.old is Phase.WAITING_FOR_WORKERS and done.new is Phase.DONE
    assert done.at - waits[-1].at >= coord.spec.worker_wait_timeout_s


def test_a_cancel_with_a_segment_in_flight_commits_it_and_is_done():
    coord, _ = _coord()
    while coord.job.ahead is None:
        assert coord.step()
    coord.cancel("enough")
    assert not coord.step()
    assert coord.snapshot().state == JobState.CANCELLED
    assert _path(coord)[-2:] == [Phase.CANCELLING, Phase.DONE]


# ------------------------------------------------------------------ a cancel in every phase
def _arm_cancel(coord: Coordinator, rt: _Cancelling, phase: Phase) -> dict[str, int]:
    """Cancel the job (as another thread would) once it is in ``phase``; returns the
    segments and evaluations run until then, filled in when it fires."""
    fired: dict[str, int] = {}

    def cancel() -> None:
        if not fired:
            fired.update(segments=rt.record.segments, evaluations=rt.record.evaluations)
            coord.cancel("enough")

    def cancel_in_phase() -> None:
        if coord.phase is phase:
            cancel()  # STARTING is never entered: it is the first phase

    job, become = coord.job, coord.job.become

    def become_and_cancel(new: Phase, at: float) -> None:
        become(new, at)
        if new is phase:
            cancel()

    job.become = become_and_cancel
    rt.hook = cancel_in_phase
    return fired


def _to_last_epoch(coord: Coordinator) -> None:
    while (coord.epoch, coord.step_in_epoch) < (1, 6):
        assert coord.step()


def _before_the_loss(coord: Coordinator) -> None:
    """Step 6 of epoch 1 is next: every node fails in it (``LOSE_EVERY_NODE``)."""
    _to_last_epoch(coord)
    assert not _lost(coord) and Phase.ROLLING_BACK not in _path(coord)


@pytest.mark.parametrize(
    ("phase", "setup", "kw"),
    [
        (Phase.STARTING, None, {}),
        (Phase.WAITING_FOR_WORKERS, None, {"max_batch": 24, "events": LOSE_NODE1}),
        (Phase.REGROUPING, None, {}),
        (Phase.ROLLING_BACK, _before_the_loss, {"events": LOSE_EVERY_NODE}),
        (Phase.TRAINING, None, {}),
        (Phase.ENDING_EPOCH, None, {}),
        # Without checkpoints: one is due at the last epoch's end, which would await (and
        # evaluate again) there, in ENDING_EPOCH.
        (Phase.FINISHING, _to_last_epoch, {"checkpoint": {}}),
    ],
    ids=lambda v: v.value if isinstance(v, Phase) else "",
)
def test_a_cancel_takes_effect_within_a_step_or_an_evaluation_in_every_phase(
    phase, setup, kw, tmp_path
):
    # From the phase on, w0's evaluations always fail (a metric that raises on real
    # batches), with retries to spare: an epoch's end and the job's end evaluate again,
    # and a cancel must stop that too. A checkpoint is due at every epoch's end.
    coord, rt = _coord(**({"checkpoint": {"dir": str(tmp_path)}, "max_retries": 50} | kw))
    if setup is not None:
        setup(coord)
    rt.inject(Fault(kind="eval_error", worker=0))
    fired = _arm_cancel(coord, rt, phase)
    snap = coord.run()
    assert fired, f"the job never was {phase.value}"
    assert snap.state == JobState.CANCELLED, snap.reason
    assert _path(coord)[-2:] == [Phase.CANCELLING, Phase.DONE]
    # At most the segment in flight and the one sent ahead of it are committed (none when
    # the cancel came before training), and the evaluation in flight awaited; nothing is
    # evaluated again.
    idle = phase in (
        Phase.STARTING,
        Phase.WAITING_FOR_WORKERS,
        Phase.REGROUPING,
        Phase.ROLLING_BACK,
    )
    assert rt.record.segments - fired["segments"] <= (0 if idle else 2)
    assert rt.record.evaluations - fired["evaluations"] <= 1

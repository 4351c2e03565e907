"""The synchronous loop's one vocabulary, its engine's states, as a driven job really goes
through them: the states it rests in between boundaries (at rest, waiting for workers since
when) and the ones inside a boundary (regrouping, rolling back, training, ending an epoch,
finishing, cancelling). The public :class:`JobState` (PENDING, RUNNING, how it ended) is the
lifecycle's, checked in ``test_lifecycle.py``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.sync.messages import Command, Event
from dynabatch.scheduler.core.sync.states import (
    AtRest,
    CancelCommitting,
    CancelSettling,
    Ending,
    Finishing,
    LoopState,
    Opening,
    Regrouping,
    RollingBack,
    Training,
    Waiting,
)
from dynabatch.scheduler.runtime.seam import DataInfo
from dynabatch.scheduler.sim.calls import Call
from dynabatch.scheduler.sim.cluster_spec import Fault
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator

from tests.fakes import sim_job
from tests.unit.test_engine_faults import N, _spec

# ------------------------------------------------------------------ a driven job's states


class _Cancelling(SimRuntime):
    """The simulator's runtime with a test's ``hook``, called as the job loads its data
    (its first call, before any group forms), and a stop for a driver that would evaluate again
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


Seen = list[tuple[float, LoopState]]


def _record(coord: Coordinator, then: Callable[[LoopState], None] | None = None) -> Seen:
    """The engine's state after each of its decisions, with the driver's clock (the product
    keeps no log of them: this wraps the engine's ``on``); ``then`` is called with each."""
    seen: Seen = []
    on = coord.engine.on

    def recording(event: Event) -> list[Command]:
        commands = on(event)
        seen.append((coord.clock.now(), coord.engine.state))
        if then is not None:
            then(coord.engine.state)
        return commands

    coord.engine.on = recording
    return seen


def _path(seen: Seen, *kinds: type) -> list[type]:
    """The kinds of state the job went through, of ``kinds``, each stay counted once."""
    path: list[type] = []
    for _, state in seen:
        if isinstance(state, kinds) and (not path or path[-1] is not type(state)):
            path.append(type(state))
    return path


def _lost(coord: Coordinator) -> list[str]:
    return [e.worker for e in coord.membership_events() if e.kind == "failure"]


def test_a_clean_run_regroups_trains_ends_epochs_and_finishes():
    coord, _ = _coord()
    assert coord.engine.state == AtRest()
    seen = _record(coord)
    assert coord.run().state == JobState.SUCCEEDED
    assert coord.engine.state == AtRest()
    T, E = Training, Ending
    assert _path(seen, Regrouping, Training, Ending, Finishing, Waiting, CancelSettling) == [
        Regrouping, T, E, T, E, Finishing]


def test_a_lost_worker_regroups_at_the_next_boundary_and_its_retry_runs_alone():
    coord, rt = _coord()
    rt.inject(Fault(kind="die", worker=1, epoch=0, step=5))
    seen = _record(coord)
    sent = []
    while coord.step():
        sent.append((coord.job.attempts.retrying, coord.job.ahead is not None))
    assert coord.snapshot().state == JobState.SUCCEEDED
    assert _lost(coord) == ["w1"]
    path = _path(seen, Regrouping, Training)
    # The first group, the one after the loss (and one when a replacement joins).
    assert path.count(Regrouping) >= 2
    i = path.index(Regrouping, 1)
    assert path[i - 1] is Training and path[i + 1] is Training
    # While the failure is being retried, nothing is sent ahead of the retry.
    assert any(retrying for retrying, _ in sent)
    assert not any(retrying and ahead for retrying, ahead in sent)


def test_every_holder_lost_rolls_back_inside_the_regroup(tmp_path):
    coord, _ = _coord(LOSE_EVERY_NODE, checkpoint={"dir": str(tmp_path)}, epochs=3)
    seen = _record(coord)
    assert coord.run().state == JobState.SUCCEEDED
    assert sorted(_lost(coord)) == ["w0", "w1", "w2"]
    path = _path(seen, Regrouping, RollingBack, Training)
    i = path.index(RollingBack)
    assert path.count(RollingBack) == 1
    assert path[i + 1] is Regrouping and path[i + 2] is Training


def test_too_few_workers_wait_then_fail_after_the_timeout():
    # node01 fails at step 4 of epoch 0; the other two nodes' one CPU each is their worker's,
    # so no third worker can start and 2 x 24 cannot hold B=64.
    coord, rt = _coord(LOSE_NODE1, max_batch=24)
    seen = _record(coord)
    while coord.step():
        pass
    assert coord.snapshot().state == JobState.FAILED
    assert _lost(coord) == ["w1"]
    waits = [state for _, state in seen if isinstance(state, Waiting)]
    # One wait, carried from boundary to boundary since it began, and the job failed in it
    # once it had lasted the timeout.
    assert len(waits) >= 2 and {w.since for w in waits} == {waits[0].since}
    assert waits[0].since == next(at for at, state in seen if isinstance(state, Waiting))
    assert seen[-1][1] is waits[-1] and "below the minimum" in waits[-1].shortfall
    assert rt.clock.now() - waits[0].since >= coord.spec.worker_wait_timeout_s


def test_a_cancel_with_a_segment_in_flight_commits_it_and_is_done():
    coord, _ = _coord()
    seen = _record(coord)
    while coord.job.ahead is None:
        assert coord.step()
    coord.cancel("enough")
    assert not coord.step()
    assert coord.snapshot().state == JobState.CANCELLED
    assert _path(seen, CancelCommitting, CancelSettling, Training)[-2:] == [
        CancelCommitting, CancelSettling]
    assert [type(state) for _, state in seen[-2:]] == [CancelSettling, AtRest]


# ------------------------------------------------------------------ a cancel in every state
def _arm_cancel(coord: Coordinator, rt: _Cancelling, kinds: tuple[type, ...] | None
                ) -> tuple[dict[str, int], Seen]:
    """Cancel the job (as another thread would) once its engine is in one of ``kinds``
    (None: as it loads its data, before any group forms); returns the segments and
    evaluations run until then, filled in when it fires, and the states seen."""
    fired: dict[str, int] = {}

    def cancel() -> None:
        if not fired:
            fired.update(segments=rt.record.segments, evaluations=rt.record.evaluations)
            coord.cancel("enough")

    def cancel_in(state: LoopState) -> None:
        if kinds is not None and isinstance(state, kinds):
            cancel()

    if kinds is None:
        rt.hook = cancel
    return fired, _record(coord, then=cancel_in)


def _to_last_epoch(coord: Coordinator) -> None:
    while (coord.epoch, coord.step_in_epoch) < (1, 6):
        assert coord.step()


def _before_the_loss(coord: Coordinator) -> None:
    """Step 6 of epoch 1 is next: every node fails in it (``LOSE_EVERY_NODE``)."""
    _to_last_epoch(coord)
    assert not _lost(coord)


@pytest.mark.parametrize(
    ("kinds", "setup", "kw", "idle"),
    [
        (None, None, {}, True),
        ((Waiting,), None, {"max_batch": 24, "events": LOSE_NODE1}, True),
        ((Regrouping,), None, {}, True),
        ((RollingBack,), _before_the_loss, {"events": LOSE_EVERY_NODE}, True),
        ((Opening, Training), None, {}, False),
        ((Ending,), None, {}, False),
        # Without checkpoints: one is due at the last epoch's end, which would await (and
        # evaluate again) there, while Ending.
        ((Finishing,), _to_last_epoch, {"checkpoint": {}}, False),
    ],
    ids=["starting", "waiting", "regrouping", "rolling-back", "training", "ending-epoch",
         "finishing"],
)
def test_a_cancel_takes_effect_within_a_step_or_an_evaluation_in_every_state(
    kinds, setup, kw, idle, tmp_path
):
    # From then on, w0's evaluations always fail (a metric that raises on real batches),
    # with retries to spare: an epoch's end and the job's end evaluate again, and a cancel
    # must stop that too. A checkpoint is due at every epoch's end.
    coord, rt = _coord(**({"checkpoint": {"dir": str(tmp_path)}, "max_retries": 50} | kw))
    if setup is not None:
        setup(coord)
    rt.inject(Fault(kind="eval_error", worker=0))
    fired, seen = _arm_cancel(coord, rt, kinds)
    snap = coord.run()
    assert fired, f"the job never was {kinds}"
    assert snap.state == JobState.CANCELLED, snap.reason
    assert [type(state) for _, state in seen[-2:]] == [CancelSettling, AtRest]
    # At most the segment in flight and the one sent ahead of it are committed (none when
    # the cancel came before training), and the evaluation in flight awaited; nothing is
    # evaluated again.
    assert rt.record.segments - fired["segments"] <= (0 if idle else 2)
    assert rt.record.evaluations - fired["evaluations"] <= 1

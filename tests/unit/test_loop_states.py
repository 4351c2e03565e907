"""The synchronous loop's one vocabulary, its reducer's states
(``dynabatch.scheduler.core.sync.loop``), as a driven job really goes through them: the
states it rests in between boundaries (at rest, waiting for workers since when), the ones
inside a boundary (regrouping, rolling back, training, ending an epoch, finishing,
cancelling) and the one it ends in (concluded, with the job's outcome). The public
:class:`JobState` (PENDING, RUNNING, how it ended) is the lifecycle's, checked in
``test_lifecycle.py``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.sync.loop import (
    AtRest,
    Cancelling,
    Concluded,
    Effects,
    EndingEpoch,
    Evaluate,
    Event,
    LoopConfig,
    LoopState,
    Regrouping,
    Training,
    TrainSegment,
    Waiting,
    step,
)
from dynabatch.scheduler.runtime.seam import DataInfo
from dynabatch.scheduler.sim.calls import Call
from dynabatch.scheduler.sim.cluster_spec import Fault
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync import coordinator
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


class _Sending(_Cancelling):
    """The same, keeping what its driver sends the workers, in order: each segment's plans
    and each evaluation's shards."""

    sent: list[tuple[str, dict]]

    def submit_segment(self, plans: dict) -> Call:
        self.__dict__.setdefault("sent", []).append(("segment", dict(plans)))
        return super().submit_segment(plans)

    def submit_evaluation(self, shards: dict[str, tuple[int, int]]) -> Call:
        self.__dict__.setdefault("sent", []).append(("evaluation", dict(shards)))
        return super().submit_evaluation(shards)


def _coord(events: list[dict] | None = None, runtime: type[_Cancelling] = _Cancelling,
           **kw) -> tuple[Coordinator, _Cancelling]:
    """A job on the simulator's runtime over 3 nodes (node i computes 1000, 500, 250
    samples/s); ``events``: nodes that fail or join as the job trains a step."""
    spec = _spec(**{"epochs": 2, **kw})
    coord, rt, _ = sim_job(
        spec, n_train=N, speeds={0: 1000, 1: 500, 2: 250}, runtime=runtime, events=events
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


Trail = list[tuple[float, LoopState]]


def kind(state: LoopState) -> str:
    """The state's name on a job's path: its type's, or its stage's where one type has
    several (training's opening, check, posting and absorbing; a regroup's rolling back;
    an epoch's end judging it or going on cancelling; a cancel committing or settling)."""
    match state:
        case Regrouping("rolling_back"):
            return "rolling back"
        case Regrouping():
            return "regrouping"
        case Training(_, "segment"):
            return "training"
        case Training(_, stage):
            return stage
        case EndingEpoch(_, "train", False):
            return "ending"
        case EndingEpoch(_, then, judging):
            return "judging" if judging else f"ending to {then}"
        case Cancelling(_, stage):
            return f"cancel {stage}"
    return type(state).__name__


def _record(coord: Coordinator, monkeypatch: pytest.MonkeyPatch,
            then: Callable[[LoopState], None] | None = None,
            decisions: list[tuple[Event, Effects]] | None = None,
            retrying: list[bool] | None = None) -> Trail:
    """The loop's state after each of the reducer's decisions, with the driver's clock (the
    product keeps no log of them: this wraps the ``step`` the coordinator calls, as it
    calls it); ``then`` is called with each; ``decisions`` gets each event and effects,
    ``retrying`` whether the failure policy was retrying a segment when it decided."""
    trail: Trail = []

    def recording(state: LoopState, event: Event, config: LoopConfig
                  ) -> tuple[LoopState, Effects]:
        new, effects = step(state, event, config)
        trail.append((coord.clock.now(), new))
        if decisions is not None:
            decisions.append((event, effects))
        if retrying is not None:
            retrying.append(coord.workforce.attempts.position is not None)
        if then is not None:
            then(new)
        return new, effects

    monkeypatch.setattr(coordinator, "step", recording)
    return trail


def _path(trail: Trail, *kinds: str) -> list[str]:
    """The kinds of state the job went through, of ``kinds``, each stay counted once."""
    path: list[str] = []
    for _, state in trail:
        k = kind(state)
        if k in kinds and (not path or path[-1] != k):
            path.append(k)
    return path


def _lost(coord: Coordinator) -> list[str]:
    return [e.worker for e in coord.membership_events() if e.kind == "failure"]


def test_a_clean_run_regroups_trains_ends_epochs_and_finishes(monkeypatch):
    coord, _ = _coord()
    assert coord.loop == AtRest()
    trail = _record(coord, monkeypatch)
    assert coord.run().state == JobState.SUCCEEDED
    assert coord.loop == Concluded(JobState.SUCCEEDED, None, coord.loop.memo)
    assert _path(trail, "regrouping", "training", "ending", "Finishing", "Waiting",
                 "cancel settling", "Concluded") == [
        "regrouping", "training", "ending", "training", "ending", "Finishing", "Concluded"]
    # Each epoch's states carry it.
    assert sorted({s.epoch for _, s in trail if isinstance(s, Training | EndingEpoch)}) == [0, 1]
    # Once concluded, a boundary does nothing and says the loop is over.
    assert not coord.step() and isinstance(coord.loop, Concluded)


def test_the_workers_are_sent_exactly_the_segments_the_loops_effects_carry(monkeypatch):
    """``TrainSegment(order)`` is what happens: each segment the workers are sent is its
    order's plans or the plans it sends ahead (behind the evaluation shards it carries when
    that is the next epoch's first), and an order for the segment in flight sends nothing.
    ``Evaluate(epoch, shards, record)`` too: its shards are scored, or (None) the ones sent
    ahead of the epoch's end were, and its record is the epoch's."""
    coord, rt = _coord(runtime=_Sending, epochs=3)
    decisions: list[tuple[Event, Effects]] = []
    _record(coord, monkeypatch, decisions=decisions)
    assert coord.run().state == JobState.SUCCEEDED
    orders = [e.order for _, effects in decisions for e in effects
              if isinstance(e, TrainSegment)]
    segments = [sent for what, sent in rt.sent if what == "segment"]
    expected, flying = [], None
    for order in orders:
        if order.sent:  # the one sent ahead: its position, its workers
            assert flying is not None and order.position == flying.position
            assert set(order.plans) == set(flying.plans)
        else:
            expected.append(dict(order.plans))
        flying = order.ahead
        if flying is not None:
            expected.append(dict(flying.plans))
            if flying.shards is not None:  # scored before the next epoch's first segment
                i = rt.sent.index(("segment", dict(flying.plans)))
                assert rt.sent[i - 1] == ("evaluation", dict(flying.shards))
    assert segments == expected
    # Some went ahead, one across an epoch's end, and some were collected as sent ahead.
    assert any(o.ahead is not None for o in orders) and any(o.sent for o in orders)
    assert any(o.ahead is not None and o.ahead.shards is not None for o in orders)
    scored = [sent for what, sent in rt.sent if what == "evaluation"]
    ahead = {o.ahead.position.epoch - 1: dict(o.ahead.shards) for o in orders
             if o.ahead is not None and o.ahead.shards is not None}
    evaluations = [e for _, effects in decisions for e in effects if isinstance(e, Evaluate)]
    assert [e.epoch for e in evaluations] == [0, 1, 2]
    for e in evaluations:
        assert e.record.epoch == e.epoch
        assert (dict(e.shards) if e.shards is not None else ahead[e.epoch]) in scored
    assert any(e.shards is None for e in evaluations)  # one was sent ahead of its end
    assert len(scored) == len(evaluations)  # each epoch scored once


def test_a_lost_worker_regroups_at_the_next_boundary_and_its_retry_runs_alone(monkeypatch):
    coord, rt = _coord()
    rt.inject(Fault(kind="die", worker=1, epoch=0, step=5))
    decisions: list[tuple[Event, Effects]] = []
    retrying: list[bool] = []
    trail = _record(coord, monkeypatch, decisions=decisions, retrying=retrying)
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED
    assert _lost(coord) == ["w1"]
    path = _path(trail, "regrouping", "training")
    # The first group, the one after the loss (and one when a replacement joins).
    assert path.count("regrouping") >= 2
    i = path.index("regrouping", 1)
    assert path[i - 1] == "training" and path[i + 1] == "training"
    # While the failure is being retried (as the coordinator's failure policy says), nothing
    # is sent ahead of the retry.
    sent = [(retried, e.order.ahead is not None)
            for (_, effects), retried in zip(decisions, retrying, strict=True)
            for e in effects if isinstance(e, TrainSegment)]
    assert any(retrying for retrying, _ in sent)
    assert not any(retrying and ahead for retrying, ahead in sent)


def test_every_holder_lost_rolls_back_inside_the_regroup(tmp_path, monkeypatch):
    coord, _ = _coord(LOSE_EVERY_NODE, checkpoint={"dir": str(tmp_path)}, epochs=3)
    trail = _record(coord, monkeypatch)
    assert coord.run().state == JobState.SUCCEEDED
    assert sorted(_lost(coord)) == ["w0", "w1", "w2"]
    path = _path(trail, "regrouping", "rolling back", "training")
    i = path.index("rolling back")
    assert path.count("rolling back") == 1
    assert path[i + 1] == "regrouping" and path[i + 2] == "training"


def test_too_few_workers_wait_then_fail_after_the_timeout(monkeypatch):
    # node01 fails at step 4 of epoch 0; the other two nodes' one CPU each is their worker's,
    # so no third worker can start and 2 x 24 cannot hold B=64.
    coord, rt = _coord(LOSE_NODE1, max_batch=24)
    trail = _record(coord, monkeypatch)
    while coord.step():
        pass
    snap = coord.snapshot()
    assert snap.state == JobState.FAILED
    assert _lost(coord) == ["w1"]
    waits = [state for _, state in trail if isinstance(state, Waiting)]
    # One wait, carried from boundary to boundary since it began, and the job failed in it
    # once it had lasted the timeout: the failure policy's Fail concludes the loop.
    assert len(waits) >= 2 and {w.since for w in waits} == {waits[0].since}
    assert waits[0].since == next(at for at, state in trail if isinstance(state, Waiting))
    assert trail[-2][1] is waits[-1] and "below the minimum" in waits[-1].shortfall
    assert trail[-1][1] == Concluded(JobState.FAILED, snap.reason, waits[-1].memo)
    assert rt.clock.now() - waits[0].since >= coord.spec.worker_wait_timeout_s


def test_a_cancel_with_a_segment_in_flight_commits_it_and_is_done(monkeypatch):
    coord, _ = _coord()
    decisions: list[tuple[Event, Effects]] = []
    trail = _record(coord, monkeypatch, decisions=decisions)
    while not any(isinstance(e, TrainSegment) and e.order.ahead is not None
                  for _, effects in decisions for e in effects):  # one is in flight
        assert coord.step()
    coord.cancel("enough")
    assert not coord.step()
    snap = coord.snapshot()
    assert snap.state == JobState.CANCELLED and snap.reason == "enough"
    assert _path(trail, "cancel committing", "cancel settling", "training")[-2:] == [
        "cancel committing", "cancel settling"]
    assert [kind(state) for _, state in trail[-2:]] == ["cancel settling", "Concluded"]
    assert trail[-2][1].reason == "enough"
    assert trail[-1][1] == Concluded(JobState.CANCELLED, "enough", trail[-1][1].memo)


# ------------------------------------------------------------------ a cancel in every state
def _arm_cancel(coord: Coordinator, rt: _Cancelling, kinds: tuple[str, ...] | None,
                monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, int], Trail]:
    """Cancel the job (as another thread would) once its loop is in one of ``kinds``
    (None: as it loads its data, before any group forms); returns the segments and
    evaluations run until then, filled in when it fires, and the states seen."""
    fired: dict[str, int] = {}

    def cancel() -> None:
        if not fired:
            fired.update(segments=rt.record.segments, evaluations=rt.record.evaluations)
            coord.cancel("enough")

    def cancel_in(state: LoopState) -> None:
        if kinds is not None and kind(state) in kinds:
            cancel()

    if kinds is None:
        rt.hook = cancel
    return fired, _record(coord, monkeypatch, then=cancel_in)


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
        (("Waiting",), None, {"max_batch": 24, "events": LOSE_NODE1}, True),
        (("regrouping",), None, {}, True),
        (("rolling back",), _before_the_loss, {"events": LOSE_EVERY_NODE}, True),
        (("opening", "training"), None, {}, False),
        (("ending",), None, {}, False),
        # Without checkpoints: one is due at the last epoch's end, which would await (and
        # evaluate again) there, while ending.
        (("Finishing",), _to_last_epoch, {"checkpoint": {}}, False),
    ],
    ids=["starting", "waiting", "regrouping", "rolling-back", "training", "ending-epoch",
         "finishing"],
)
def test_a_cancel_takes_effect_within_a_step_or_an_evaluation_in_every_state(
    kinds, setup, kw, idle, tmp_path, monkeypatch
):
    # From then on, w0's evaluations always fail (a metric that raises on real batches),
    # with retries to spare: an epoch's end and the job's end evaluate again, and a cancel
    # must stop that too. A checkpoint is due at every epoch's end.
    coord, rt = _coord(**({"checkpoint": {"dir": str(tmp_path)}, "max_retries": 50} | kw))
    if setup is not None:
        setup(coord)
    rt.inject(Fault(kind="eval_error", worker=0))
    fired, trail = _arm_cancel(coord, rt, kinds, monkeypatch)
    snap = coord.run()
    assert fired, f"the job never was {kinds}"
    assert snap.state == JobState.CANCELLED, snap.reason
    assert [kind(state) for _, state in trail[-2:]] == ["cancel settling", "Concluded"]
    assert trail[-1][1] == Concluded(JobState.CANCELLED, "enough", trail[-1][1].memo)
    # At most the segment in flight and the one sent ahead of it are committed (none when
    # the cancel came before training), and the evaluation in flight awaited; nothing is
    # evaluated again.
    assert rt.record.segments - fired["segments"] <= (0 if idle else 2)
    assert rt.record.evaluations - fired["evaluations"] <= 1

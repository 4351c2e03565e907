"""The parameter-server driver's pure engine (``scheduler/core/ps/engine.py``): what the start,
the learners' exits, the requests and the server's snapshots mean, with no driver behind it.

The property drives it with random events (exits of each kind, node joins, snapshots with
epochs verified or not, scale/drain/assign requests, cancels) and checks the driver's rules
against the test's own model of the job; the examples follow each path. The driver that
carries these commands out on Ray and the simulator is tested in ``test_ps_export.py``,
``test_ps_assign.py``, ``test_ps_sim.py`` and ``tests/integration/test_ps.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest
from dynabatch.scheduler.core.lifecycle import InvalidEvent, JobState
from dynabatch.scheduler.core.membership import NodeAssignment
from dynabatch.scheduler.core.ps.engine import (
    NODE_POLL_S,
    Crew,
    Ended,
    EngineState,
    PSEngine,
    Running,
    Scaling,
    Starting,
    WaitingForNode,
    job_state,
    learners,
)
from dynabatch.scheduler.core.ps.messages import (
    AssignRequested,
    Command,
    DataLoaded,
    DrainRequested,
    DriverFailed,
    EpochSeen,
    Event,
    ExportModel,
    Kill,
    LearnerEnded,
    Leave,
    ListNodes,
    Log,
    NodeAdded,
    NodesListed,
    Note,
    Polled,
    RecordEpoch,
    ScaleRequested,
    Sleep,
    SpawnLearner,
    StartServer,
)
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

NODES = ("n0", "n1", "n2")
rarely = st.sampled_from([False, False, False, False, True])
assignments = st.dictionaries(st.sampled_from(NODES), st.integers(1, 3), min_size=1).map(
    NodeAssignment.of
)


class Held:
    """The engine's rules and its state, stepped in place as the driver does."""

    def __init__(self, initial: int | None, wait_s: float) -> None:
        self.engine = PSEngine(initial, wait_s)
        self.state: EngineState = Starting()

    def on(self, event: Event) -> list[Command]:
        self.state, out = self.engine.step(self.state, event)
        return out

    @property
    def learners(self) -> dict[str, str]:
        return learners(self.state)


def _running(initial: int | None = 2, nodes: tuple[str, ...] = ("n0", "n1"), **kw) -> Held:
    """An engine past its start: ``initial`` learners round ``nodes``, joined at time 0."""
    engine = Held(initial, wait_s=5.0, **kw)
    engine.on(DataLoaded())
    engine.on(NodesListed(nodes, 0.0))
    return engine


# --- the property -----------------------------------------------------------------------


class Model:
    """The test's own account of the job, from the events it sent and the commands it got:
    who is a learner (node, ordinal, join time) and what each learner had applied."""

    def __init__(self) -> None:
        self.members: dict[str, tuple[str, int, float]] = {}
        self.ever: set[str] = set()
        self.ordinals: set[int] = set()
        self.applied: dict[str, float] = {}
        self.server_epochs: list[EpochSeen] = []
        self.recorded: list[int] = []  # the positions RecordEpoch named, in order
        self.last_t: float | None = None
        self.first_listing: float | None = None

    def key(self, w: str, now: float) -> tuple[bool, float, int]:
        """Where ``w`` stands in a scale-down: unmeasured first (newest first), then by
        samples applied per second since it joined, the slowest first."""
        _, ordinal, joined = self.members[w]
        age, n = now - joined, self.applied.get(w)
        v = n / age if n is not None and age > 0 else 0.0
        return (v > 0, v, -ordinal)

    def apply(self, commands: list[Command], now: float) -> tuple[list[str], list[str]]:
        """Follow the membership commands; the learners that joined and those killed."""
        joined, killed = [], []
        for i, c in enumerate(commands):
            match c:
                case SpawnLearner(w, ordinal, node):
                    assert w not in self.ever and ordinal not in self.ordinals, "reused"
                    assert w == f"w{ordinal}"
                    assert commands[i + 1] == Note("join", w, node, "joined")
                    self.ever.add(w)
                    self.ordinals.add(ordinal)
                    self.members[w] = (node, ordinal, now)
                    joined.append(w)
                case Kill(w):
                    node = self.members.pop(w)[0]
                    assert commands[i + 1] == Leave(w)
                    assert commands[i + 2].kind == "leave" and commands[i + 2].node == node
                    killed.append(w)
                case Leave(w) if w in self.members:  # lost: no kill
                    node = self.members.pop(w)[0]
                    assert commands[i + 1].kind == "failure" and commands[i + 1].node == node
        return joined, killed


@st.composite
def running_event(draw: st.DrawFn, engine: Held, model: Model, now: float) -> Event:
    members = sorted(model.members) or ["w99"]
    worker = draw(st.sampled_from([*members, "w99"]))
    kind = draw(st.sampled_from(["scale", "drain", "assign", "exit", "node", "poll", "poll"]))
    if draw(rarely) and draw(rarely):  # a command the driver carried out raised
        return DriverFailed("internal error: OSError: no space")
    if kind == "scale":
        return ScaleRequested(draw(st.integers(1, 5)))
    if kind == "drain":
        return DrainRequested(worker)
    if kind == "assign":
        return AssignRequested(draw(assignments), now)
    if kind == "exit":
        error = draw(st.none() | st.just("boom"))
        return LearnerEnded(worker, error, lost=draw(st.sampled_from([True, True, False])))
    if kind == "node":
        return NodeAdded(draw(st.sampled_from(NODES)), draw(st.booleans()), now)
    epochs = list(model.server_epochs)
    for _ in range(draw(st.integers(0, 2))):
        t = (epochs[-1].t if epochs else 0.0) + draw(st.floats(0.5, 3.0))
        ok = not draw(rarely)
        epochs.append(EpochSeen(len(epochs), t, ok, () if ok else ("position 3 twice",)))
    applied = {w: draw(st.floats(0.0, 500.0)) for w in model.members if draw(st.booleans())}
    return Polled(
        now=now,
        started_s=draw(st.none() | st.just(0.25)),
        epochs=tuple(epochs),
        finished=draw(rarely),
        applied=tuple(applied.items()),
        cancel="stop" if draw(rarely) else None,
    )


# Not shrunk: a failing run of 25 events (hundreds of draws) takes Hypothesis minutes to
# shrink, past the suite's timeout; the failing run's draws are printed as they were.
@settings(max_examples=300, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(
    initial=st.none() | st.integers(1, 4),
    data=st.data(),
)
def test_every_run_follows_the_drivers_rules(initial: int | None, data: st.DataObject) -> None:
    engine = Held(initial, wait_s=2.0)
    model, now, exported = Model(), 0.0, 0
    for _ in range(25):
        now += data.draw(st.floats(0.0, 1.5))
        state = engine.state
        if isinstance(state, Ended):  # never a command after the job ended
            assert engine.learners == {}
            late = data.draw(running_event(engine, model, now))
            if isinstance(late, DriverFailed):  # a late failure: the outcome stands
                assert engine.on(late) == [] and engine.state == state
            else:
                with pytest.raises(InvalidEvent):
                    engine.on(late)
            return
        if isinstance(state, Starting):
            event: Event = DataLoaded(data.draw(st.none() | st.just("dataset.name: regression")))
        elif isinstance(state, WaitingForNode | Scaling):
            nodes = data.draw(st.lists(st.sampled_from(NODES), unique=True, max_size=3))
            starting = isinstance(state, WaitingForNode)
            assignment = data.draw(st.none() | assignments) if starting else None
            event = NodesListed(tuple(nodes), now, assignment)
        else:
            event = data.draw(running_event(engine, model, now))
        before = dict(model.members)
        keys = {w: model.key(w, now) for w in before}
        out = engine.on(event)
        joined, killed = model.apply(out, now)
        if isinstance(event, LearnerEnded) and event.error is None:
            model.members.pop(event.worker, None)  # it finished: gone, nothing to do
        f = engine.state if isinstance(engine.state, Ended) else None
        if f is not None:
            model.members.clear()  # the job's learners end with it
            assert not joined
        assert engine.learners == {w: m[0] for w, m in model.members.items()}
        assert not any(isinstance(c, ListNodes) for c in out[:-1])  # it waits for the answer
        exported += sum(isinstance(c, ExportModel) for c in out)
        assert exported <= 1  # the model goes out once at most
        if f is not None and f.outcome == JobState.SUCCEEDED:  # only when the server says so
            assert isinstance(event, Polled) and event.finished

        match state, event:
            case _, DriverFailed(reason):  # one decision: the job fails, nothing more to do
                assert out == [] and f == Ended(JobState.FAILED, reason)
            case Starting(), DataLoaded(problem):
                if problem:
                    assert out == [] and f == Ended(JobState.FAILED, problem)
                else:
                    assert out == [StartServer(initial or 0), ListNodes()]
            case WaitingForNode(), NodesListed(nodes, t, assignment):
                if model.first_listing is None:
                    model.first_listing = t
                if not nodes:
                    over = t >= model.first_listing + 2.0
                    want = Ended(JobState.FAILED, "no eligible node for a learner")
                    assert (out, f) == (([], want) if over else ([Sleep(NODE_POLL_S), ListNodes()],
                                                                  None))
                else:
                    assert job_state(engine.state) == JobState.RUNNING
                    placed = Counter(model.members[w][0] for w in joined)
                    if assignment is not None:  # a place leaves exactly the slots
                        assert placed == dict(assignment.slots)
                    else:
                        n = initial or len(nodes)
                        assert [model.members[w][0] for w in joined] == [
                            nodes[i % len(nodes)] for i in range(n)
                        ]
            case Scaling(workers), NodesListed():
                assert len(model.members) == workers  # never below (nor above) the request
                assert not (joined and killed)
                # The slowest go first: each one removed is no faster than each one kept.
                kept = [w for w in before if w not in killed]
                assert all(keys[k] <= keys[w] for k in killed for w in kept)
            case Running(), AssignRequested(nodes):
                assert Counter(m[0] for m in model.members.values()) == dict(nodes.slots)
                for k in killed:  # on each node, the fastest keep their slots
                    same = [w for w in before if w not in killed and before[w][0] == before[k][0]]
                    assert all(keys[k] <= keys[w] for w in same)
            case Running(crew), ScaleRequested(workers):
                assert out == [ListNodes()] and engine.state == Scaling(workers, crew)
            case Running(), DrainRequested(w):
                assert killed == ([w] if w in before else []) and not joined
            case Running(), LearnerEnded(w, error, lost):
                if w in before and error is not None and not lost:  # a raising learner
                    assert out == [Log("ERROR", f"learner {w} failed: {error}")]
                    assert f == Ended(JobState.FAILED, error)
                else:
                    assert f is None and not joined and not killed
                    assert w not in model.members
            case Running(), NodeAdded(node, assigned):
                assert [model.members[w][0] for w in joined] == ([] if assigned else [node])
            case Running(), Polled() as p:
                new = list(p.epochs[len(model.server_epochs) :])
                recorded = [c for c in out if isinstance(c, RecordEpoch)]
                if model.last_t is None and p.started_s is not None:
                    model.last_t = p.started_s
                for c, e in zip(recorded, new, strict=False):  # once each, in order
                    assert c == RecordEpoch(e, e.t - (model.last_t or 0.0))
                    model.recorded.append(c.epoch.epoch)
                    model.last_t = e.t
                model.server_epochs = list(p.epochs)
                model.applied = dict(p.applied)
                bad = next((e for e in new if not e.verified), None)
                exports = [c for c in out if isinstance(c, ExportModel)]
                if bad is not None:
                    assert len(recorded) == new.index(bad) + 1
                    assert f is not None and f.outcome == JobState.FAILED
                    assert f"epoch {bad.epoch} " in f.reason
                    assert not exports
                    return
                assert len(recorded) == len(new)
                if p.finished:  # success only when the server says finished
                    assert exports == [ExportModel("end")]
                    assert f == Ended(JobState.SUCCEEDED)
                elif p.cancel:
                    assert exports == ([ExportModel("cancel")] if model.recorded else [])
                    assert f == Ended(JobState.CANCELLED, p.cancel)
                elif not before:
                    assert f == Ended(JobState.FAILED, "every learner was lost")
                else:
                    assert f is None and not exports
            case _:
                pytest.fail(f"{event} while {state}")
        assert model.recorded == list(range(len(model.recorded)))


# --- examples, one per path -------------------------------------------------------------


def test_a_dataset_the_server_cannot_train_fails_the_job_before_anything_starts() -> None:
    engine = Held(2, wait_s=5.0)
    why = "dataset.name: protocol ps trains classification (class labels) only"
    assert engine.on(DataLoaded(why)) == []
    assert engine.state == Ended(JobState.FAILED, why)
    assert job_state(engine.state) == JobState.FAILED


def test_the_start_waits_for_a_node_from_its_first_listing_then_fails() -> None:
    engine = Held(2, wait_s=1.0)
    assert engine.on(DataLoaded()) == [StartServer(2), ListNodes()]
    assert engine.on(NodesListed((), 10.0)) == [Sleep(NODE_POLL_S), ListNodes()]
    assert engine.on(NodesListed((), 10.5)) == [Sleep(NODE_POLL_S), ListNodes()]
    assert engine.on(NodesListed((), 11.0)) == []
    assert engine.state == Ended(JobState.FAILED, "no eligible node for a learner")


def test_the_first_learners_go_round_the_nodes_and_the_job_runs() -> None:
    engine = Held(3, wait_s=1.0)
    engine.on(DataLoaded())
    assert engine.on(NodesListed((), 0.0)) == [Sleep(NODE_POLL_S), ListNodes()]
    out = engine.on(NodesListed(("n0", "n1"), 0.5))
    spawns = [c for c in out if isinstance(c, SpawnLearner)]
    assert spawns == [SpawnLearner("w0", 0, "n0"), SpawnLearner("w1", 1, "n1"),
                      SpawnLearner("w2", 2, "n0")]
    assert isinstance(engine.state, Running) and job_state(engine.state) == JobState.RUNNING
    # Unset: one learner per node, with no start barrier.
    unset = Held(None, wait_s=1.0)
    assert unset.on(DataLoaded()) == [StartServer(0), ListNodes()]
    unset.on(NodesListed(("n0", "n1", "n2"), 0.0))
    assert unset.learners == {"w0": "n0", "w1": "n1", "w2": "n2"}


def test_an_assigned_start_places_learners_on_exactly_the_slots() -> None:
    engine = Held(1, wait_s=1.0)
    engine.on(DataLoaded())
    a = NodeAssignment.of({"n1": 2, "n2": 1})
    engine.on(NodesListed(("n0", "n1", "n2"), 0.0, a))
    assert Counter(engine.learners.values()) == {"n1": 2, "n2": 1}
    assert job_state(engine.state) == JobState.RUNNING
    assert engine.on(AssignRequested(a, 1.0)) == []  # its queued Assign: nothing to do


def test_a_learner_that_finished_is_gone_a_lost_one_leaves_and_a_raising_one_fails() -> None:
    engine = _running(3, ("n0", "n1", "n2"))
    assert engine.on(LearnerEnded("w0")) == [] and "w0" not in engine.learners
    assert engine.on(LearnerEnded("w1", "node died", lost=True)) == [
        Leave("w1"),
        Note("failure", "w1", "n1", "node died"),
    ]
    assert engine.on(LearnerEnded("w1", "late report", lost=False)) == []  # not a learner
    out = engine.on(LearnerEnded("w2", "ValueError: bad shape", lost=False))
    assert out == [Log("ERROR", "learner w2 failed: ValueError: bad shape")]
    assert engine.state == Ended(JobState.FAILED, "ValueError: bad shape")
    with pytest.raises(InvalidEvent, match="Polled while Ended"):
        engine.on(Polled(now=9.0))


def test_a_node_added_gets_a_learner_unless_the_job_is_assigned() -> None:
    engine = _running(2)
    assert engine.on(NodeAdded("n2", assigned=False, now=1.0)) == [
        SpawnLearner("w2", 2, "n2"),
        Note("join", "w2", "n2", "joined"),
    ]
    assert engine.on(NodeAdded("n3", assigned=True, now=1.0)) == []


def test_a_scale_down_removes_the_slowest_by_samples_applied_per_second() -> None:
    engine = _running(3, ("n0", "n1", "n2"))
    # w0: 100 samples in 10 s; w1: 300; w2: 200. Two leave: w0, then w2.
    engine.on(Polled(now=10.0, applied=(("w0", 100.0), ("w1", 300.0), ("w2", 200.0))))
    assert engine.on(ScaleRequested(1)) == [ListNodes()]
    out = engine.on(NodesListed(("n0", "n1", "n2"), 10.0))
    assert [c for c in out if isinstance(c, Kill)] == [Kill("w0"), Kill("w2")]
    assert Note("leave", "w0", "n0", "scaled down to 1") in out
    assert engine.learners == {"w1": "n1"}


def test_a_scale_up_goes_round_the_nodes_listed_now() -> None:
    engine = _running(2)
    engine.on(ScaleRequested(4))
    out = engine.on(NodesListed(("n0", "n1", "n2"), 1.0))
    assert [c for c in out if isinstance(c, SpawnLearner)] == [
        SpawnLearner("w2", 2, "n2"),
        SpawnLearner("w3", 3, "n0"),
    ]
    engine.on(ScaleRequested(5))
    out = engine.on(NodesListed((), 2.0))  # none listed: the last list stands
    assert [c for c in out if isinstance(c, SpawnLearner)] == [SpawnLearner("w4", 4, "n1")]


def test_an_assignment_keeps_the_fastest_on_each_node_and_fills_empty_slots() -> None:
    engine = _running(4)  # w0, w2 on n0; w1, w3 on n1
    engine.on(Polled(now=10.0, applied=(("w0", 50.0), ("w1", 10.0), ("w2", 90.0), ("w3", 5.0))))
    out = engine.on(AssignRequested(NodeAssignment.of({"n0": 1, "n2": 2}), 10.0))
    assert sorted(c.worker for c in out if isinstance(c, Kill)) == ["w0", "w1", "w3"]
    assert Note("leave", "w0", "n0", "assigned elsewhere") in out
    assert engine.learners == {"w2": "n0", "w4": "n2", "w5": "n2"}


def test_a_drain_removes_a_learner_and_ignores_one_already_gone() -> None:
    engine = _running(2)
    assert engine.on(DrainRequested("w1")) == [
        Kill("w1"),
        Leave("w1"),
        Note("leave", "w1", "n1", "drained"),
    ]
    assert engine.on(DrainRequested("w1")) == []


def test_epochs_are_recorded_once_timed_from_the_start_and_an_unverified_one_fails() -> None:
    engine = _running(2)
    e0, e1 = EpochSeen(0, 2.0), EpochSeen(1, 5.0)
    assert engine.on(Polled(now=1.0, started_s=0.5)) == []
    assert engine.on(Polled(now=3.0, started_s=0.5, epochs=(e0,))) == [RecordEpoch(e0, 1.5)]
    assert engine.on(Polled(now=4.0, started_s=0.5, epochs=(e0,))) == []
    bad = EpochSeen(2, 6.0, verified=False, problems=("a", "b", "c", "d"))
    out = engine.on(Polled(now=7.0, epochs=(e0, e1, bad)))
    assert out == [RecordEpoch(e1, 3.0), RecordEpoch(bad, 1.0)]
    assert engine.state == Ended(JobState.FAILED, "epoch 2 not exactly once: a; b; c")


def test_the_end_records_the_last_epochs_exports_and_succeeds() -> None:
    engine = _running(2)
    e0 = EpochSeen(0, 4.0)
    out = engine.on(Polled(now=5.0, epochs=(e0,), finished=True, cancel="x"))
    assert out == [RecordEpoch(e0, 4.0), ExportModel("end")]
    assert engine.state == Ended(JobState.SUCCEEDED) and engine.learners == {}


def test_a_cancel_exports_the_model_only_once_an_epoch_was_trained() -> None:
    engine = _running(2)
    assert engine.on(Polled(now=1.0, cancel="stop")) == []
    assert engine.state == Ended(JobState.CANCELLED, "stop")
    trained = _running(2)
    trained.on(Polled(now=2.0, epochs=(EpochSeen(0, 1.0),)))
    assert trained.on(Polled(now=3.0, epochs=(EpochSeen(0, 1.0),), cancel="stop")) == [
        ExportModel("cancel")
    ]
    assert trained.state == Ended(JobState.CANCELLED, "stop")


def test_every_learner_lost_fails_the_job() -> None:
    engine = _running(1, ("n0",))
    engine.on(LearnerEnded("w0", "node died"))
    assert engine.on(Polled(now=1.0)) == []
    assert engine.state == Ended(JobState.FAILED, "every learner was lost")


def test_a_failed_command_fails_the_job_from_any_state_and_a_late_one_changes_nothing() -> None:
    rules = PSEngine(2, wait_s=5.0)
    why = "internal error: OSError: no space"
    for state in (Starting(), WaitingForNode(3.0), _running(2).state, Scaling(3, Crew())):
        assert job_state(state) != JobState.FAILED
        assert rules.step(state, DriverFailed(why)) == (Ended(JobState.FAILED, why), [])
    done = Ended(JobState.SUCCEEDED)
    assert rules.step(done, DriverFailed(why)) == (done, [])


def test_the_public_state_is_derived_from_the_engines() -> None:
    assert [job_state(s) for s in (Starting(), WaitingForNode(), Running(Crew()),
                                   Scaling(2, Crew()), Ended(JobState.CANCELLED, "stop"))] == [
        JobState.PENDING, JobState.PENDING, JobState.RUNNING, JobState.RUNNING,
        JobState.CANCELLED,
    ]


def test_an_event_no_state_expects_is_refused_and_an_ended_job_has_no_learners() -> None:
    engine = Held(1, wait_s=1.0)
    with pytest.raises(InvalidEvent, match="Polled while Starting"):
        engine.on(Polled(now=0.0))
    engine.on(DataLoaded())
    with pytest.raises(InvalidEvent, match="ScaleRequested while WaitingForNode"):
        engine.on(ScaleRequested(2))
    running = _running(2)
    running.on(DriverFailed("internal error: KeyError: 'x'"))  # a command raised
    assert running.learners == {} and isinstance(running.state, Ended)
    with pytest.raises(InvalidEvent):
        running.on(NodeAdded("n0", assigned=False, now=1.0))

"""A job's log cannot grow without bound from one repeated event: repeats are counted."""

from __future__ import annotations

from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.repeats import Repeats
from dynabatch.scheduler.sync.coordinator import Coordinator
from hypothesis import given
from hypothesis import strategies as st

from tests.fakes import sim_runtime


def _shown(lines: list[tuple[str, str]]) -> list[str]:
    return [m for _, m in lines]


def test_a_repeated_line_is_shown_a_few_times_then_counted():
    r = Repeats(shown=3, window=5)
    out = [m for _ in range(1234) for m in _shown(r.offer("INFO", "again"))]
    assert out == ["again"] * 3 + [
        f"again [repeated {n} more times so far]" for n in (10, 100, 1000)
    ]
    assert _shown(r.flush()) == ["again [repeated 1231 more times in all]"]
    assert r.flush() == []


def test_alternating_lines_are_both_counted_and_the_count_ends_with_the_run():
    r = Repeats(shown=2, window=4)
    out = []
    for _ in range(50):
        out += _shown(r.offer("WARNING", "evaluation failed"))
        out += _shown(r.offer("INFO", "evaluating again"))
    assert out.count("evaluation failed") == 2 and out.count("evaluating again") == 2
    # Other lines push the run out of the window: its count is logged then.
    for i in range(5):
        out += _shown(r.offer("INFO", f"line {i}"))
    assert "evaluation failed [repeated 48 more times in all]" in out
    assert "evaluating again [repeated 48 more times in all]" in out
    assert r.flush() == []


def test_a_line_that_comes_back_outside_the_window_is_shown_each_time():
    r = Repeats(shown=1, window=3)
    out = []
    for epoch in range(6):
        out += _shown(r.offer("INFO", "user print: epoch done"))
        for i in range(4):
            out += _shown(r.offer("INFO", f"epoch {epoch} line {i}"))
    assert out.count("user print: epoch done") == 6
    assert not any("repeated" in m for m in out)


@given(st.lists(st.sampled_from(["a", "b", "c"]), max_size=300))
def test_every_occurrence_is_shown_or_counted(stream):
    r = Repeats(shown=2, window=3)
    out = [m for x in stream for _, m in r.offer("INFO", x)] + _shown(r.flush())
    for x in "abc":
        logged = sum(1 for m in out if m == x)
        counted = sum(
            int(m.split("repeated ")[1].split()[0])
            for m in out
            if m.startswith(f"{x} [repeated") and m.endswith("in all]")
        )
        assert logged + counted == stream.count(x), (x, out)


def test_a_job_log_repeating_one_event_stays_small_and_keeps_the_count():
    spec = JobSpec.model_validate(dict(workers=2, global_batch=32, epochs=1))
    rt = sim_runtime(spec, n_train=200)
    coord = Coordinator("job", spec, runtime=rt, clock=rt.clock)
    for _ in range(20_000):
        coord.log("WARNING", "evaluation of epoch 2 on w0 failed: ValueError: bad shape")
        coord.log("INFO", "epoch 2: evaluating again on ['w0', 'w1']")
    assert len(coord.logs()) < 20
    coord.cancel("enough")
    assert coord.run().state == JobState.CANCELLED
    messages = [x.message for x in coord.logs()]
    assert (
        "evaluation of epoch 2 on w0 failed: ValueError: bad shape "
        "[repeated 19997 more times in all]"
    ) in messages
    assert messages[-1].startswith("state CANCELLED")
    assert [x.seq for x in coord.logs()] == list(range(len(messages)))

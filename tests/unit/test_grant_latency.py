"""bench/grant_latency.py's reading of a job's log lines and membership events into an
assignment's latencies (no Ray)."""

from __future__ import annotations

import pytest

from bench.grant_latency import latencies, ratios, segment


def _line(t: float, message: str) -> dict:
    return {"time": t, "message": message}


def _join(t: float, worker: str) -> dict:
    return {"time": t, "kind": "join", "worker": worker}


T = 1000.0  # the assign call

LOGS = [
    _line(990.0, "starting worker w0 on node aaaa"),  # the job's first start: not counted
    _line(995.0, "generation 1: 1 workers ['w0'] (formed in 0.10s)"),
    _line(1000.2, "assignment requested: {'a': 1, 'b': 1, 'c': 1}"),
    _line(1000.3, "starting worker w1 on node bbbb"),
    _line(1002.0, "starting worker w2 on node cccc"),
    _line(1008.0, "worker w1 join: node available"),
    _line(1010.0, "worker w2 join: node available"),
    _line(1013.0, "generation 2: 3 workers ['w0', 'w1', 'w2'] (formed in 0.50s)"),
]
EVENTS = [_join(994.0, "w0"), _join(1008.0, "w1"), _join(1010.0, "w2")]


def test_latencies_from_the_jobs_reports():
    got = latencies(T, 3, LOGS, EVENTS)
    assert got["new_workers"] == ["w1", "w2"]
    assert got["arrived_s"] == pytest.approx(0.2)
    assert got["started_first_s"] == pytest.approx(0.3)
    assert got["started_s"] == pytest.approx(2.0)
    assert got["up_s"] == pytest.approx(10.0)
    assert got["cold_start_s"] == pytest.approx((7.7 + 8.0) / 2)
    assert got["joined_s"] == pytest.approx(13.0)


def test_a_group_of_the_size_formed_before_the_new_workers_joined_is_not_theirs():
    # A group of 3 formed before w2's join (say a worker of the first start came back) is
    # not the one that trains with the assignment's workers.
    logs = [*LOGS[:6], _line(1009.0, "generation 2: 3 workers ['w0', 'w1', 'x']"), *LOGS[6:]]
    assert latencies(T, 3, logs, EVENTS)["joined_s"] == pytest.approx(13.0)


@pytest.mark.parametrize(("logs", "events", "says"), [
    ([x for x in LOGS if "assignment" not in x["message"]], EVENTS, "assignment requested"),
    ([x for x in LOGS if x["time"] < T or "starting" not in x["message"]], EVENTS,
     "starting worker"),
    (LOGS, EVENTS[:2], "w2 started but have no join event"),
    (LOGS[:-1], EVENTS, "generation G: 3 workers"),
])
def test_what_the_job_did_not_report_is_named(logs, events, says):
    with pytest.raises(ValueError, match=says):
        latencies(T, 3, logs, events)


def test_segment_is_at_most_the_epochs_steps():
    assert segment({"wall_s": 11.0, "steps": 22}, 8) == {"step_s": 0.5, "segment_s": 4.0}
    assert segment({"wall_s": 3.0, "steps": 6}, 8)["segment_s"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="no steps"):
        segment({"epoch": 0, "wall_s": 0.0, "steps": 0}, 8)


def test_ratios_after_over_before():
    assert ratios({"up_s": 20.0, "joined_s": 0.0}, {"up_s": 5.0, "joined_s": 3.0}) == {
        "up_s": 0.25, "joined_s": None}

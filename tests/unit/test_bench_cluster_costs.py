"""bench/cluster.py's costs of a change of nodes and Gavel's time-sharing (issue 52, item 6
and the calibration): a resize costs dynabatch's measured figure, a peer's restart its
paper's, and the calibration row time-shares a GPU among waiting jobs as Gavel does."""

import json
from pathlib import Path

import pytest
from dynabatch.scheduler.core.cluster.throughput import ThroughputModel
from dynabatch.scheduler.core.cluster.values import ClusterNode

from bench.cluster import (
    ELASTIC_RESULTS,
    PEER_RESTART_S,
    TraceJob,
    measured_resize_s,
    pause_for,
    simulate,
)
from bench.cluster_inputs import InputError


def test_the_resize_cost_is_the_committed_measurement():
    data = json.loads(ELASTIC_RESULTS.read_text())
    grow = data["scale_up"]["median_ready_to_first_step_s"]
    shrink = data["node_loss"]["median_removal_to_training_s"]
    assert measured_resize_s() == round(max(grow, shrink), 2)
    assert 0 < measured_resize_s() < PEER_RESTART_S


def test_a_missing_or_bad_measurement_is_one_line_naming_the_file(tmp_path: Path):
    with pytest.raises(InputError, match=r"nothing\.json") as exc:
        measured_resize_s(tmp_path / "nothing.json")
    assert "\n" not in str(exc.value)
    bad = tmp_path / "elastic.json"
    bad.write_text('{"scale_up": {}}')
    with pytest.raises(InputError, match=r"elastic\.json: no measured resize"):
        measured_resize_s(bad)


def test_peers_pay_a_restart_and_dynabatch_its_resize():
    assert pause_for("single_type", 2.25, 30.0, ("single_type",)) == 30.0
    assert pause_for("goodput", 2.25, 30.0, ("single_type",)) == 2.25


def _job(job_id: str, arrival: float, seconds: float) -> TraceJob:
    model = ThroughputModel.of({"gpu": 1.0}, ("gpu",), overhead_s=0.0, global_batch=1.0)
    return TraceJob(job_id, arrival, 1, model, seconds, min_workers=1, max_workers=1)


def _jct(res_jobs: list[TraceJob], timeshare: bool) -> dict:
    nodes = [ClusterNode("n0", "gpu", 1)]
    res, _ = simulate("fair", nodes, res_jobs, 100.0, 200.0, 0.0, {"gpu": 1.0}, timeshare=timeshare)
    return res


def test_timeshare_gives_a_waiting_job_turns_on_a_busy_gpu():
    # One GPU; a 10,000 s job arrives first, a 500 s job at 50 s. Without time-sharing the
    # short job waits for the long one (dynabatch never sends a running job back to the
    # queue); with Gavel's time-sharing it gets the GPU at the next round and finishes.
    jobs = [_job("long", 0.0, 10_000.0), _job("short", 50.0, 500.0)]
    kept = _jct(jobs, timeshare=False)
    shared = _jct(jobs, timeshare=True)
    # Kept: long ends at 10,000 s, short at 10,500 s: average (10,000 + 10,450) / 2.
    assert kept["avg_jct_s"] == pytest.approx(10_225.0, abs=1.0)
    assert shared["avg_jct_s"] < 0.6 * kept["avg_jct_s"]
    assert shared["resizes"] == 0  # a preemption is not a resize
    assert shared["makespan_s"] == pytest.approx(10_500.0, abs=1.0)  # no work lost at cost 0


def test_size_scale_is_the_same_trace_with_k_times_the_workers():
    from bench.cluster import make_jobs, make_nodes

    small = make_jobs(20, make_nodes(10), 1.5, seed=3)
    large = make_jobs(20, make_nodes(100), 1.5, seed=3, size_scale=10)
    assert [j.g * 10 for j in small] == [j.g for j in large]
    # Ten times the capacity, ten times each job's demand: the same arrivals.
    assert [j.arrival for j in small] == pytest.approx([j.arrival for j in large], rel=0.05)

"""bench/cluster_inputs.py: the cluster simulator's trace and cluster files (issue 52).
Bad input is one line naming the file, line and field."""

import json
from pathlib import Path

import pytest
from dynabatch.scheduler.core.cluster.throughput import ThroughputModel

from bench.cluster_inputs import (
    InputError,
    fit_gavel_job,
    gavel_nodes,
    read_gavel_throughputs,
    read_gavel_trace,
    read_jobs_csv,
    read_nodes_csv,
    type_speeds,
)

DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "gavel"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_gavel_trace_both_formats(tmp_path):
    ten = "ResNet-18 (batch size 16)\tcmd\tdir\t-n\t1\t1000\t2\t1\t-1\t30.5\n"
    seven = "LM (batch size 5)\tcmd\t-step\t1\t2000\t60.0\t1\n"
    rows = read_gavel_trace(_write(tmp_path, "t.trace", ten + seven))
    assert [(r.model, r.workers, r.steps, r.arrival_s) for r in rows] == [
        ("ResNet-18 (batch size 16)", 2, 1000.0, 30.5),
        ("LM (batch size 5)", 1, 2000.0, 60.0),
    ]
    assert rows[0].job_id == "job-00001"


def test_committed_gavel_traces_and_table_read():
    table = read_gavel_throughputs(DATA / "simulation_throughputs.json")
    assert set(table) == {"v100", "p100", "k80"}
    rows = read_gavel_trace(DATA / "msr" / "seed=0" / "103959.trace")
    assert len(rows) == 300 and all(r.steps and r.workers >= 1 for r in rows)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("a\tb\tc\n", "t.trace:1: line: 3 tab-separated fields"),
        ("LM\tcmd\t-step\t1\t2000\tsoon\t1\n", "t.trace:1: arrival_time: 'soon' is not a number"),
        (
            "LM\tcmd\t-step\t1\t2000\t0\t1\nLM\tcmd\t-step\t1\t2000\t0\t0\n",
            "t.trace:2: scale_factor: '0' is not >= 1",
        ),
        ("LM\tcmd\t-step\t1\t0\t0\t1\n", "t.trace:1: total_steps: '0' is not > 0"),
    ],
)
def test_gavel_trace_errors_name_file_line_field(tmp_path, text, where):
    with pytest.raises(InputError) as exc:
        read_gavel_trace(_write(tmp_path, "t.trace", text))
    assert where in _one_line(exc)


def test_throughput_errors(tmp_path):
    with pytest.raises(InputError) as exc:
        read_gavel_throughputs(_write(tmp_path, "t.json", "{oops"))
    assert "t.json:1: json:" in _one_line(exc)
    bad = {"v100": {"('LM', 1)": {"null": "fast"}}}
    with pytest.raises(InputError) as exc:
        read_gavel_throughputs(_write(tmp_path, "t.json", json.dumps(bad)))
    assert "v100.('LM', 1).null: 'fast' is not a number >= 0" in _one_line(exc)
    with pytest.raises(InputError) as exc:
        read_gavel_throughputs(tmp_path / "missing.json")
    assert "missing.json: file:" in _one_line(exc)


def test_jobs_csv(tmp_path):
    text = "arrival_s,workers,model,duration_s,max_workers\n0,2,resnet,3600,4\n10,1,lm,60,\n"
    rows = read_jobs_csv(_write(tmp_path, "jobs.csv", text))
    assert rows[0].duration_s == 3600 and rows[0].max_workers == 4 and rows[0].steps is None
    assert rows[1].max_workers is None and rows[1].job_id == "job-00003"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("arrival_s,model,steps\n0,lm,5\n", "jobs.csv:1: header: missing column 'workers'"),
        ("arrival_s,workers,model\n0,1,lm\n", "jobs.csv:1: header: needs exactly one of"),
        (
            "arrival_s,workers,model,steps\n0,1,lm,5\n0,two,lm,5\n",
            "jobs.csv:3: workers: 'two' is not a whole number",
        ),
        ("arrival_s,workers,model,steps\n-1,1,lm,5\n", "jobs.csv:2: arrival_s: '-1' is not >= 0"),
        (
            "arrival_s,workers,model,steps,min_workers\n0,1,lm,5,2\n",
            "jobs.csv:2: workers: 1 is not within min_workers 2",
        ),
        ("arrival_s,workers,model,steps\n0,1,lm,5,9\n", "jobs.csv:2: line: more fields"),
    ],
)
def test_jobs_csv_errors(tmp_path, text, where):
    with pytest.raises(InputError) as exc:
        read_jobs_csv(_write(tmp_path, "jobs.csv", text))
    assert where in _one_line(exc)


def test_nodes_csv_and_errors(tmp_path):
    nodes = read_nodes_csv(_write(tmp_path, "n.csv", "id,type,gpus,speed\na,v100,4,1\nb,k80,8,\n"))
    assert [(n.node_id, n.node_type, n.gpus, n.speed) for n in nodes] == [
        ("a", "v100", 4, 1.0),
        ("b", "k80", 8, None),
    ]
    for text, where in [
        ("id,type\na,v100\n", "n.csv:1: header: missing column 'gpus'"),
        ("id,type,gpus\na,v100,4\na,k80,1\n", "n.csv:3: id: 'a' appears twice"),
        ("id,type,gpus\na,v100,0\n", "n.csv:2: gpus: '0' is not >= 1"),
        ("id,type,gpus,speed\na,v100,1,1\nb,v100,1,2\n", "n.csv:3: speed: 2 differs"),
    ]:
        with pytest.raises(InputError) as exc:
            read_nodes_csv(_write(tmp_path, "n.csv", text))
        assert where in _one_line(exc)


def test_gavel_cluster_spec():
    nodes = gavel_nodes("6:4:0", "4:4:4")
    assert [(n.node_type, n.gpus) for n in nodes] == [("v100", 4), ("v100", 2), ("p100", 4)]
    with pytest.raises(InputError):
        gavel_nodes("6:x:0")


def test_fit_matches_gavel_exactly_at_the_jobs_size():
    table = {
        "v100": {("R", 1): 4.0, ("R", 4): 12.0},
        "k80": {("R", 1): 1.0, ("R", 4): 3.5},
    }
    rates, k = fit_gavel_job(table, "R", 4, ["k80", "v100"])
    model = ThroughputModel.of(rates, rates, overhead_s=k)
    for t in ("v100", "k80"):
        assert model.throughput({t: 4}) == pytest.approx(table[t][("R", 4)])
    assert type_speeds(table, ["k80", "v100"]) == {"k80": 0.25, "v100": 1.0}
    with pytest.raises(KeyError, match="no throughput"):
        fit_gavel_job(table, "R", 2, ["v100"])


"""bench/cluster_gavel.py's merge of earlier outputs (issue 52): runs of one trace each
become one results file, and only outputs made the same way are merged."""

import json
import sys
from pathlib import Path

import pytest

from bench import cluster_gavel
from bench.cluster_gavel import MergeError, merge


def output(*traces: tuple[str, float], round_s: float = 360.0) -> dict:
    """An output of the script with one entry per (trace, Gavel's avg JCT)."""
    return {
        "gavel_commit": "c4fa400",
        "gavel_command": "python driver.py -t TRACE",
        "settings": {"first": 60, "round_s": round_s},
        "traces": [
            {"trace": t, "cluster": "4:4:4", "gavel": {"max_min_fairness_perf": {"avg_jct_s": j}}}
            for t, j in traces
        ],
    }


def test_merge_keeps_order_and_a_later_run_of_a_trace_replaces_the_earlier():
    whole = merge(
        [
            ("a.json", output(("seed=0/x.trace", 1.0), ("seed=1/x.trace", 2.0))),
            ("b.json", output(("seed=0/y.trace", 3.0), ("seed=1/x.trace", 4.0))),
        ]
    )
    assert [
        (e["trace"], e["gavel"]["max_min_fairness_perf"]["avg_jct_s"]) for e in whole["traces"]
    ] == [
        ("seed=0/x.trace", 1.0),
        ("seed=1/x.trace", 4.0),
        ("seed=0/y.trace", 3.0),
    ]
    assert whole["settings"] == {"first": 60, "round_s": 360.0}
    assert whole["gavel_commit"] == "c4fa400"


def test_outputs_made_differently_are_not_merged():
    with pytest.raises(MergeError) as caught:
        merge([("a.json", output(("x", 1.0))), ("b.json", output(("y", 2.0), round_s=60.0))])
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("b.json: settings: ")
    assert "a.json" in message


def run_main(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["cluster_gavel.py", *argv])
    cluster_gavel.main()


def test_merge_alone_writes_one_file(tmp_path: Path, monkeypatch, capsys):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    a.write_text(json.dumps(output(("x", 1.0))))
    b.write_text(json.dumps(output(("y", 2.0))))
    run_main(monkeypatch, "--merge", str(a), "--merge", str(b), "--out", str(out))
    written = json.loads(out.read_text())
    assert [e["trace"] for e in written["traces"]] == ["x", "y"]
    assert json.loads(capsys.readouterr().out) == written


@pytest.mark.parametrize(
    ("text", "problem"),
    [("not json", "cannot be read as JSON"), ('{"settings": {}}', "traces: missing")],
)
def test_a_file_that_is_not_an_output_is_one_line_naming_it(
    tmp_path: Path, monkeypatch, text: str, problem: str
):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    with pytest.raises(SystemExit) as caught:
        run_main(monkeypatch, "--merge", str(bad))
    message = str(caught.value.code)
    assert message.startswith(f"error: --merge: {bad}: ") and problem in message
    assert "\n" not in message


def test_a_case_run_with_other_settings_is_refused_before_it_runs(tmp_path: Path, monkeypatch):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(output(("x", 1.0))))
    with pytest.raises(SystemExit) as caught:
        run_main(
            monkeypatch,
            "--case",
            "missing.trace@4:4:4",
            "--throughputs",
            "bench/data/gavel/simulation_throughputs.json",
            "--gavel-results",
            str(earlier),
            "--merge",
            str(earlier),
        )
    assert str(caught.value.code).startswith(f"error: --merge: {earlier}: settings: ")

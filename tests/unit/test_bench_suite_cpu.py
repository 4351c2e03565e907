"""bench/suite_cpu.py: one run summarised per file, two runs compared, and a file it did not
write refused with its name (the plugin's recording is exercised by using it)."""

import json

from bench.suite_cpu import busy_seconds, main, summary

RUN = [
    {"test": "tests/a.py::t1", "cpu_s": 3.0, "wall_s": 2.0},
    {"test": "tests/a.py::t2", "cpu_s": 1.0, "wall_s": 1.0},
    {"test": "tests/b.py::t3", "cpu_s": 5.0, "wall_s": 4.0},
]


def test_a_run_is_summed_per_file_largest_first():
    s = summary(RUN)
    assert (s["tests"], s["cpu_s"], s["wall_s"]) == (3, 9.0, 7.0)
    assert list(s["files"].items()) == [("tests/b.py", {"cpu_s": 5.0, "wall_s": 4.0}),
                                        ("tests/a.py", {"cpu_s": 4.0, "wall_s": 3.0})]


def test_two_runs_compare_the_tests_they_share_and_list_the_rest(tmp_path, capsys):
    after = [dict(RUN[0], cpu_s=3.6), dict(RUN[2], cpu_s=6.0),
             {"test": "tests/c.py::t4", "cpu_s": 2.0, "wall_s": 1.0}]
    (tmp_path / "a.json").write_text(json.dumps(RUN))
    (tmp_path / "b.json").write_text(json.dumps(after))
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tests_in_both_cpu_ratio"] == round(9.6 / 8.0, 3)
    assert out["only_before"] == {"tests/a.py::t2": 1.0}
    assert out["only_after"] == {"tests/c.py::t4": 2.0}


def test_a_file_it_did_not_write_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"test": "x"}]))
    assert main([str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_the_machines_busy_time_only_grows():
    a = busy_seconds()
    sum(i * i for i in range(200_000))
    assert busy_seconds() >= a > 0

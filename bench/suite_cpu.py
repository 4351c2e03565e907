"""What each test costs the machine: CPU seconds (every process's, from ``/proc/stat``) and
wall seconds, per test and per file.

The suite is CPU-bound on a 2-core machine (``docs/testing.md``, suite time): most of a Ray
test's CPU is spent outside pytest (Ray's worker processes, raylets, agents), so a test's
own duration says little about what it costs. Run a part of the suite serially, with
nothing else on the machine, as a plugin::

    PYTHONPATH=bench RAY_AUTH_MODE=disabled SUITE_CPU_OUT=/tmp/cpu.json \\
        .venv/bin/python -m pytest -q -p suite_cpu tests/integration

then summarise one run (totals and per file), or compare two: their totals, the tests only
one of them ran, and the CPU ratio of the tests both ran (how far the machine itself moved
between the runs, which any saving must be read against)::

    .venv/bin/python bench/suite_cpu.py /tmp/cpu.json [/tmp/cpu-after.json]

Each test's figure is the machine's busy time between its start and its end (setup, call
and teardown), so it includes whatever else ran: only a serial run on a quiet machine
attributes it to the test.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_RECORDS: list[tuple[str, float, float]] = []


def busy_seconds() -> float:
    """The machine's CPU seconds spent outside idle and I/O wait since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    cpu, wall = busy_seconds(), time.monotonic()
    yield
    _RECORDS.append((item.nodeid, busy_seconds() - cpu, time.monotonic() - wall))


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("SUITE_CPU_OUT", "suite-cpu.json")
    with open(out, "w") as f:
        json.dump([{"test": t, "cpu_s": round(c, 2), "wall_s": round(w, 2)}
                   for t, c, w in _RECORDS], f, indent=0)


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in records:
        f = files[r["test"].split("::", 1)[0]]
        f[0] += r["cpu_s"]
        f[1] += r["wall_s"]
    return {
        "tests": len(records),
        "cpu_s": round(sum(r["cpu_s"] for r in records), 1),
        "wall_s": round(sum(r["wall_s"] for r in records), 1),
        "files": {k: {"cpu_s": round(c, 1), "wall_s": round(w, 1)}
                  for k, (c, w) in sorted(files.items(), key=lambda kv: -kv[1][0])},
    }


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: suite_cpu.py RUN.json [AFTER.json]", file=sys.stderr)
        return 2
    runs = []
    for p in argv:
        try:
            runs.append([{k: r[k] for k in ("test", "cpu_s", "wall_s")}
                         for r in json.loads(Path(p).read_text())])
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"{p}: not a run this plugin wrote ({type(err).__name__}: {err})",
                  file=sys.stderr)
            return 2
    if len(runs) == 1:
        print(json.dumps(summary(runs[0]), indent=1))
        return 0
    before = {r["test"]: r["cpu_s"] for r in runs[0]}
    after = {r["test"]: r["cpu_s"] for r in runs[1]}
    both = sorted(set(before) & set(after))
    # Tests present in both runs, as a ratio: how much the machine's speed moved between
    # the runs, which the tests that differ must be read against.
    same = sum(after[t] for t in both) / max(1e-9, sum(before[t] for t in both))
    print(json.dumps({
        "before": summary(runs[0]) | {"files": None},
        "after": summary(runs[1]) | {"files": None},
        "tests_in_both_cpu_ratio": round(same, 3),
        "only_before": {t: before[t] for t in sorted(set(before) - set(after))},
        "only_after": {t: after[t] for t in sorted(set(after) - set(before))},
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

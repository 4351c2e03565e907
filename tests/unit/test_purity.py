"""The scheduling core stays pure: no ray, no torch; policy/model use numpy only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The engine's machines: events in, decisions out; the Ray coordinator and the fakes (and
# a simulator) drive the same objects.
MACHINES = (
    "scheduler.policy", "scheduler.model", "scheduler.ledger", "scheduler.membership",
    "scheduler.protocols.sync", "scheduler.failures", "scheduler.tracker", "actors.contracts",
    "scheduler.protocols.ps", "scheduler.ps_ledger", "scheduler.policy_ji", "scheduler.ps_core",
)
PURE_MODULES = (*MACHINES, "scheduler.state", "scheduler.telemetry")


def test_core_modules_import_neither_ray_nor_torch():
    code = (
        f"import {', '.join(PURE_MODULES)}; import sys; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch')); "
        "assert not bad, bad"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


# Standard-library modules the policy and the model may use; anything else (time, random,
# os, io, logging, ...) would bring in a clock, randomness or I/O.
ALLOWED = {
    "__future__",
    "math",
    "dataclasses",
    "collections",
    "operator",
    "typing",
    "itertools",
    "numpy",
    "pydantic",
    "scheduler",
    "actors",
}
FORBIDDEN_NAMES = {"open", "print", "input", "time", "random", "datetime", "perf_counter"}


@pytest.mark.parametrize("path", [m.replace(".", "/") + ".py" for m in MACHINES])
def test_machines_use_numpy_and_pure_stdlib_only(path):
    tree = ast.parse((ROOT / path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            roots = [(node.module or "").split(".")[0]]
        else:
            if isinstance(node, ast.Name):
                assert node.id not in FORBIDDEN_NAMES, f"{path}: uses {node.id}"
            continue
        for root in roots:
            assert root in ALLOWED, f"{path} imports {root}"
        local = isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0]
        if local in ("scheduler", "actors"):
            assert node.module in MACHINES, node.module

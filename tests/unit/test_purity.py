"""The engine's core stays pure: no ray, no torch, no clock, no I/O.

Every module under ``scheduler/core/`` is checked (the folder is the list), plus the two
contract modules the core's values cross processes in.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "scheduler" / "core"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return "dynabatch." + ".".join(parts)


CORE_FILES = sorted(CORE.rglob("*.py"))
# The machines: events in, decisions out; the Ray driver, the fakes and the simulator drive
# the same objects.
MACHINES = (*(_module(p) for p in CORE_FILES), "dynabatch.actors.contracts")
PURE_MODULES = (*MACHINES, "dynabatch.scheduler.telemetry")


def test_the_core_folder_is_what_is_checked():
    # A module added to scheduler/core/ is checked without anyone editing a list.
    assert len(CORE_FILES) >= 15
    assert "dynabatch.scheduler.core.sync.policy" in MACHINES


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


# Standard-library modules the machines may use; anything else (time, random, os, io,
# logging, ...) would bring in a clock, randomness or I/O.
ALLOWED = {
    "__future__",
    "math",
    "dataclasses",
    "collections",
    "enum",
    "operator",
    "typing",
    "itertools",
    "numpy",
    # scipy.optimize.milp / sparse: the cluster policy's solver (no clock, no I/O).
    "scipy",
    "pydantic",
    "dynabatch",
}
FORBIDDEN_NAMES = {"open", "print", "input", "time", "random", "datetime", "perf_counter"}
PATHS = [*CORE_FILES, ROOT / "actors" / "contracts.py"]


@pytest.mark.parametrize("path", PATHS, ids=[p.relative_to(ROOT).as_posix() for p in PATHS])
def test_machines_use_numpy_and_pure_stdlib_only(path):
    tree = ast.parse(path.read_text())
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
        if isinstance(node, ast.ImportFrom) and root == "dynabatch":
            assert node.module in MACHINES, f"{path} imports {node.module}, outside the core"

"""Imports run one way: api → service → scheduler → actors.

Each contract type sits in the lowest layer that uses it (``actors.spec.JobSpec``,
``actors.contracts``, ``scheduler.telemetry``, ``service.schemas``), so no layer has to
climb to reach it. Lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["actors", "scheduler", "service", "api"]  # each may import those before it

# The one place a lower layer reaches up: ``dynabatch serve`` is the composition root that
# starts the HTTP layer over the service it built.
ALLOWED = {("service/cli/jobs.py", "api.app")}


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def test_layers_import_only_downward():
    wrong = []
    for rank, layer in enumerate(LAYERS):
        above = set(LAYERS[rank + 1:])
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for mod in _imports(path):
                if mod.split(".")[0] in above and (rel, mod) not in ALLOWED:
                    wrong.append(f"{rel} imports {mod}")
    assert not wrong, "imports that climb a layer:\n" + "\n".join(wrong)


def test_the_checker_sees_a_climbing_import(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from service.jobs import JobService\n")
    assert "service.jobs" in _imports(bad)

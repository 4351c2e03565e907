"""Imports run one way: api → service → scheduler → actors, all under ``dynabatch``.

Each contract type sits in the lowest layer that uses it (``dynabatch.actors.spec.JobSpec``,
``dynabatch.actors.contracts``, ``dynabatch.scheduler.telemetry``,
``dynabatch.service.schemas``), so no layer has to climb to reach it. Lazy imports inside
functions count too. Our own modules are imported only as ``dynabatch.<layer>``: a bare
``import scheduler`` would find a user's ``scheduler.py`` first when a job ships one.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["actors", "scheduler", "service", "api"]  # each may import those before it
SOURCES = [*LAYERS, "tests", "bench", "examples"]


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "dynabatch":
        return None
    # ``dynabatch`` itself and its own modules (``dynabatch.client``) are api/public/: the top.
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "api"


def _climbing(root: Path) -> list[str]:
    """Every import under ``root``'s layer folders that names a layer above its own. None is
    excused: the ``dynabatch`` command, ``serve`` included, lives in the top layer (api/cli/)."""
    wrong = []
    for rank, layer in enumerate(LAYERS):
        above = set(LAYERS[rank + 1 :])
        for path in sorted((root / layer).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            wrong += [f"{rel} imports {mod}" for mod in _imports(path) if _layer(mod) in above]
    return wrong


def test_layers_import_only_downward():
    wrong = _climbing(ROOT)
    assert not wrong, "imports that climb a layer:\n" + "\n".join(wrong)


def test_our_packages_are_imported_only_under_dynabatch():
    bare = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            for mod in _imports(path):
                if mod.split(".")[0] in LAYERS:
                    bare.append(f"{path.relative_to(ROOT).as_posix()} imports {mod}")
    assert not bare, "bare imports a user's module could shadow:\n" + "\n".join(bare)


def test_the_checker_sees_a_climbing_import(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from dynabatch.service.job_service import JobService\n")
    assert "dynabatch.service.job_service" in _imports(bad)
    assert _layer("dynabatch.service.job_service") == "service"
    assert _layer("dynabatch.client") == _layer("dynabatch") == "api"


def test_the_walk_reports_a_lower_layer_reaching_up(tmp_path):
    # What the CLI did while it lived in service/: ``serve`` importing the HTTP app.
    (tmp_path / "service" / "cli").mkdir(parents=True)
    (tmp_path / "service" / "cli" / "jobs.py").write_text(
        "def serve():\n    from dynabatch.api.app import create_app\n"
    )
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "ok.py").write_text(
        "from dynabatch.service.job_service import JobService\n"
    )
    assert _climbing(tmp_path) == ["service/cli/jobs.py imports dynabatch.api.app"]

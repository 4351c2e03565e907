"""The docs name only what exists (issue 51, item 9): every repository path that README.md or
a page under docs/ names in backticks (``scheduler/core/cluster/ray_nodes.py``,
``bench/faults.py``, ``tests/unit/``) is a file or folder of the tree, and every dotted
module path (``dynabatch.scheduler.core.cluster.decision``, with or without a name after it)
is a module, and the name one it defines. A rename or a removal that forgets a page fails
here. Relative links are test_readme.py's.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from tests.unit.test_readme import prose_lines

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# The top-level folders a path in the docs starts with; a bare "core/..." or "JOB_ID/" is not
# a repository path.
TOP = ("scheduler", "actors", "service", "api", "bench", "tests", "docs", "deploy",
       "examples", "requirements", ".ci")
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP)
                  + r")/[^\s'\"(),;:]*)")
# Not "dynabatch.io/node-type", a Ray node label.
DOTTED = re.compile(r"(?<![\w.])dynabatch(?:\.\w+)+(?![\w/])")
# A placeholder in a path: `bench/results-X.json`, `seed=S/VC.trace`.
PLACEHOLDER = re.compile(r"[*<>{}=@]|\.\.\.|\b(?!README\b)[A-Z][A-Z_]*\b")
# Paths the docs name that are not in the tree, on purpose: a git-ignored output folder, and
# a module docs/testing.md describes as measured and left out.
NOT_IN_TREE = {"tests/artifacts/", "tests/artifacts/job-page.png", "scheduler/runtime/warm.py"}
# The import package's top folders (setup.py); any other dynabatch.X is api/public/X.
PACKAGES = ("scheduler", "actors", "service", "api")


def code_spans(text: str) -> list[str]:
    """The inline code spans of a page, outside fenced blocks."""
    return [m for line in prose_lines(text) for m in CODE.findall(line)]


def _module_file(parts: list[str]) -> Path | None:
    """The file of the module ``dynabatch.<parts>`` (a package's __init__.py), or None."""
    if parts and parts[0] in PACKAGES:
        base = ROOT / parts[0]
        rest = parts[1:]
    else:
        base = ROOT / "api" / "public"
        rest = parts
    path = base.joinpath(*rest)
    if path.is_dir() and (path / "__init__.py").exists():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return None


@functools.cache
def _defines(module: Path) -> frozenset[str]:
    """The names a module binds at its top level (functions, classes, assignments, imports),
    plus the string keys it hands out lazily where it defines ``__getattr__``."""
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    if "__getattr__" in names:
        names.update(n.value for n in ast.walk(tree)
                     if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return frozenset(names)


def dotted_problem(name: str) -> str | None:
    """Why ``dynabatch.a.b.c`` names nothing, or None: its longest module prefix must exist
    and the first name after it must be a module beside it or a name the module binds."""
    parts = name.split(".")[1:]
    for cut in range(len(parts), -1, -1):
        module = _module_file(parts[:cut])
        if module is not None:
            break
    else:  # pragma: no cover - "dynabatch" itself always resolves
        return "no such module"
    if cut == len(parts):
        return None
    attr = parts[cut]
    if attr not in _defines(module):
        where = module.relative_to(ROOT)
        return f"no module {'.'.join(['dynabatch', *parts[:cut + 1]])}, nor {attr} in {where}"
    return None


def missing(text: str) -> list[str]:
    """Each path or dotted module in ``text``'s code spans that names nothing, with why."""
    out = []
    for span in code_spans(text):
        for path in PATH.findall(span):
            path = path.rstrip(".")
            if PLACEHOLDER.search(path) or path in NOT_IN_TREE:
                continue
            if not (ROOT / path).exists():
                out.append(f"{path}: no such file or folder")
        for name in DOTTED.findall(span):
            if (why := dotted_problem(name)) is not None:
                out.append(f"{name}: {why}")
    return out


def test_every_path_and_module_the_docs_name_exists() -> None:
    assert len(PAGES) > 5
    problems = {str(p.relative_to(ROOT)): m for p in PAGES if (m := missing(p.read_text()))}
    assert problems == {}


def test_a_gone_path_or_module_is_found() -> None:
    """The checker itself: a wrong file, folder, module or name is reported; real ones, a
    name after a real module, patterns and fenced code are not."""
    page = (
        "`scheduler/core/cluster/ray_nodes.py` `bench/faults.py` `tests/unit/`\n"
        "`api/cli/run.py:40` `tests/unit/test_readme.py::test_readme_is_at_most_300_lines`\n"
        "`dynabatch.scheduler.core.cluster.decision` `dynabatch.service.rest_client.ApiError`\n"
        "`dynabatch.client` `dynabatch.ApiError` `bench/results-*.json` `python bench/faults.py`\n"
        "`bench/results-X.json` `dynabatch.io/node-type` `tests/artifacts/`\n"
        "`scheduler/core/cluster/policy.py` `bench/nowhere/`\n"
        "`dynabatch.scheduler.core.cluster.policy` `dynabatch.service.rest_client.NoSuchThing`\n"
        "```\n`scheduler/gone.py`\n```\n"
    )
    assert missing(page) == [
        "scheduler/core/cluster/policy.py: no such file or folder",
        "bench/nowhere/: no such file or folder",
        "dynabatch.scheduler.core.cluster.policy: no module "
        "dynabatch.scheduler.core.cluster.policy, nor policy in scheduler/core/cluster/__init__.py",
        "dynabatch.service.rest_client.NoSuchThing: no module "
        "dynabatch.service.rest_client.NoSuchThing, nor NoSuchThing in service/rest_client.py",
    ]

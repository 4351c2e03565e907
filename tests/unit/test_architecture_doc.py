"""docs/architecture.md stays true to the tree: every file it names in backticks exists
(a path under ``core/`` is the scheduler's), and the step loop it draws is the one in the
code: each of the reducer's states and each event it takes is named in the doc."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from dynabatch.scheduler.core.sync import loop

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def test_every_file_the_architecture_names_exists():
    named = set(re.findall(r"`([\w./-]+/[\w.-]+\.(?:py|md|yaml|json|sh))`", DOC))
    assert named, "the pattern no longer finds the doc's file names"
    missing = sorted(f for f in named
                     if not (ROOT / f).exists() and not (ROOT / "scheduler" / f).exists())
    assert not missing, f"docs/architecture.md names files that are gone: {missing}"


def test_the_drawn_engine_has_the_codes_states_and_events():
    state_names = [t.__name__ for t in typing.get_args(loop.LoopState)]
    event_names = [t.__name__ for t in typing.get_args(loop.Event)]
    absent = [n for n in [*state_names, *event_names] if not re.search(rf"\b{n}\b", DOC)]
    assert not absent, f"docs/architecture.md does not draw: {absent}"


def _tree_files() -> list[tuple[str, str]]:
    """(folder, file) for every ``.py`` file the doc's tree names: a name in a line's
    description belongs to the folder that line is in (its own, for a folder's line; a
    continuation line's, the line above's)."""
    block = DOC.split("## The tree", 1)[1].split("```", 2)[1]
    stack: list[tuple[int, str]] = []  # (indent, folder path) of the folders open
    folder, named = "", []
    for line in block.splitlines():
        entry = re.match(r"^( *)(\S+)", line[:25]) if line[:25].strip() else None
        if entry is not None:
            indent, name = len(entry.group(1)), entry.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else ""
            if name.endswith("/"):
                stack.append((indent, parent + name))
                folder = parent + name
            else:
                folder = parent
                named += [(folder, f) for f in re.findall(r"\w+\.py", line[:25])]
        named += [(folder, f) for f in re.findall(r"(?<![\w/.])\w+\.py\b", line[25:])]
    return named


def test_every_file_the_tree_names_is_in_its_folder():
    named = _tree_files()
    assert len(named) > 50, "the tree's parser no longer finds its file names"
    missing = sorted({f"{folder}{name}" for folder, name in named
                      if name != "setup.py" and not any((ROOT / folder).rglob(name))})
    assert not missing, f"docs/architecture.md's tree names files that are gone: {missing}"

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

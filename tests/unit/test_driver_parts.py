"""The synchronous driver's parts (``scheduler/sync/``) never call one another, and reach the
job control's state only through :class:`~dynabatch.scheduler.sync.job.Part`: what one part
needs of another goes through the coordinator (which passes one's answer to the other) or
the step loop's engine (a command of its own)."""

from __future__ import annotations

import ast
from pathlib import Path

SYNC = Path(__file__).resolve().parents[2] / "scheduler" / "sync"
PARTS = {"pipeline", "roster", "epochs", "checkpoints", "artifacts"}


def _reaches(source: str) -> list[str]:
    """Every ``self.c.X`` (and ``c.X`` after ``c = self.c``) that names a part or a private
    field of the coordinator, as ``line: X``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        via_self_c = (isinstance(base, ast.Attribute) and base.attr == "c"
                      and isinstance(base.value, ast.Name) and base.value.id == "self")
        via_c = isinstance(base, ast.Name) and base.id == "c"
        if (via_self_c or via_c) and (node.attr in PARTS or node.attr.startswith("_")):
            out.append((node.lineno, node.attr))
    return [f"{line}: {attr}" for line, attr in sorted(out)]


def test_no_part_calls_a_sibling_or_reads_the_coordinators_privates() -> None:
    found = {p: r for p in sorted(PARTS) if (r := _reaches((SYNC / f"{p}.py").read_text()))}
    assert found == {}


def test_the_check_sees_a_sibling_call_and_a_private_read() -> None:
    src = ("class Pipeline:\n"
           "    def f(self):\n"
           "        self.c.roster.remove('w0')\n"
           "        c = self.c\n"
           "        with c._lock:\n"
           "            pass\n"
           "        self.c.reason = 'fine: a public field'\n")
    assert _reaches(src) == ["3: roster", "5: _lock"]

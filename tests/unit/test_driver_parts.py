"""The synchronous driver's parts (``scheduler/sync/``) never call one another, and reach the
job control's state only through :class:`~dynabatch.scheduler.sync.job.Part`: what one part
needs of another goes through the coordinator (which passes one's answer to the other) or
the step loop's engine (a command of its own)."""

from __future__ import annotations

import ast
from pathlib import Path

SYNC = Path(__file__).resolve().parents[2] / "scheduler" / "sync"
PARTS = {"pipeline", "roster", "epochs", "checkpoints", "final_model"}


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


SCHEDULER = SYNC.parent


def _foreign_privates(source: str) -> list[str]:
    """Every ``x._name`` on an object other than ``self``/``cls``/``super()`` whose ``_name``
    this module does not define itself (a method ``def _name``, a field ``self._name``, a
    dataclass field ``_name:``): a private read of another module's object."""
    tree = ast.parse(source)
    own = {n.name for n in ast.walk(tree)
           if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    own |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
    own |= {n.target.id for n in ast.walk(tree)
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if isinstance(base, ast.Call) and getattr(base.func, "id", None) == "super":
            continue
        if node.attr not in own:
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_module_of_the_scheduler_reads_another_objects_privates() -> None:
    """The parts, the artifacts, the simulator and the drivers reach the job control and the
    coordinator through their public surface (``publish_model``, ``records``, ``lock``...)."""
    found = {str(f.relative_to(SCHEDULER)): r for f in sorted(SCHEDULER.rglob("*.py"))
             if (r := _foreign_privates(f.read_text()))}
    assert found == {}


def test_the_privates_check_sees_a_foreign_read() -> None:
    src = ("def publish(control):\n"
           "    control._log('INFO', 'x')\n"
           "class A:\n"
           "    def f(self, other):\n"
           "        self._own = 1\n"
           "        return other._own, other._theirs\n")
    assert _foreign_privates(src) == ["2: control._log", "6: other._theirs"]

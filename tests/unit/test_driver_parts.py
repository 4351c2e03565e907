"""The synchronous driver's parts (``scheduler/sync/``) know neither the coordinator nor one
another: each is given the job's machines, its control and what else it uses, and what one
part needs of another goes through the coordinator (which passes one's answer to the other)
or the step loop's reducer (an effect of its own)."""

from __future__ import annotations

import ast
from pathlib import Path

SYNC = Path(__file__).resolve().parents[2] / "scheduler" / "sync"
PARTS = {"pipeline", "roster", "epochs", "checkpoints"}


def _reaches(source: str) -> list[str]:
    """What a part's module imports of the coordinator or of another part (type-only
    imports included), and every base class of its classes, as ``line: name``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            leaf = node.module.rsplit(".", 1)[-1]
            if node.module.startswith("dynabatch.scheduler.sync.") \
                    and (leaf == "coordinator" or leaf in PARTS):
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.ClassDef):
            out.extend((node.lineno, f"{node.name}({ast.unparse(b)})") for b in node.bases)
    return [f"{line}: {name}" for line, name in sorted(out)]


def test_no_part_knows_the_coordinator_or_a_sibling() -> None:
    found = {p: r for p in sorted(PARTS) if (r := _reaches((SYNC / f"{p}.py").read_text()))}
    assert found == {}


def test_the_check_sees_a_sibling_the_coordinator_and_a_shared_base() -> None:
    src = ("from typing import TYPE_CHECKING\n"
           "from dynabatch.scheduler.sync.roster import Roster\n"
           "if TYPE_CHECKING:\n"
           "    from dynabatch.scheduler.sync.coordinator import Coordinator\n"
           "from dynabatch.scheduler.sync.workforce import Workforce\n"
           "class Pipeline(Part):\n"
           "    pass\n")
    assert _reaches(src) == ["2: dynabatch.scheduler.sync.roster",
                             "4: dynabatch.scheduler.sync.coordinator", "6: Pipeline(Part)"]


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


def _foreign_writes(source: str) -> list[str]:
    """Every assignment to a field of an object the part was given or was handed back
    (``self.evals.behind = ...``, ``m.dirty = ...``, ``self.protocol = ...`` through another
    object): a machine's state changes through its own methods, and no part holds a slot
    another part fills. A part's own fields (``self.x = ...``) are its to set."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        flat = [t for x in targets for t in (x.elts if isinstance(x, ast.Tuple) else [x])]
        out += [f"{node.lineno}: {ast.unparse(t)}" for t in flat
                if isinstance(t, ast.Attribute) and ast.unparse(t.value) != "self"]
    return out


def test_no_part_sets_a_field_of_another_object() -> None:
    found = {p: r for p in sorted(PARTS) if (r := _foreign_writes((SYNC / f"{p}.py").read_text()))}
    assert found == {}


def test_the_writes_check_sees_a_field_set_through_another_object() -> None:
    src = ("def f(self, job, rnd):\n"
           "    self.ahead = 1\n"
           "    job.start = 2\n"
           "    self.job.protocol = 3\n"
           "    self.evals.behind, x = None, 4\n"
           "    job.membership.dirty = True\n"
           "    rnd.record = 5\n"
           "    self.workforce.attempts += 1\n")
    assert _foreign_writes(src) == [
        "3: job.start", "4: self.job.protocol", "5: self.evals.behind",
        "6: job.membership.dirty", "7: rnd.record", "8: self.workforce.attempts"]


def test_each_part_is_given_the_machines_it_uses_not_a_shared_holder() -> None:
    """No part's constructor takes the job's machines as one object (``job``, the
    ``SyncJob`` that was a blackboard the parts filled): each names the ones it uses."""
    given = {}
    for p in sorted(PARTS):
        tree = ast.parse((SYNC / f"{p}.py").read_text())
        init = next(n for n in ast.walk(tree)
                    if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        given[p] = [a.arg for a in init.args.args[1:]]
    assert all("job" not in args for args in given.values()), given
    assert given["checkpoints"][:4] == ["protocol", "membership", "regime", "ledger"]

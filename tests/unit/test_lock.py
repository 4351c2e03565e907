"""The committed lock (requirements/*.lock) is what every install takes, and it still satisfies
pyproject.toml: a range changed there without `make lock` fails here, before a fresh machine
would install something nobody tested."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "requirements" / "runtime.lock"
TEST = ROOT / "requirements" / "test.lock"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(\S+)")


def pins(lock: Path) -> dict[str, Version]:
    """The lock's ``name==version`` lines, by canonical name; every one carries a hash."""
    out: dict[str, Version] = {}
    entries = re.split(r"\n(?=[A-Za-z0-9])", lock.read_text())
    for entry in entries:
        m = PIN.match(entry)
        if m:
            assert "--hash=sha256:" in entry, f"{lock.name}: {m.group(1)} has no hash"
            out[canonicalize_name(m.group(1))] = Version(m.group(2))
    assert out, f"{lock.name} pins nothing"
    return out


def requirements(*extras: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    for extra in extras:
        listed += project["optional-dependencies"][extra]
    env = {"python_version": "3.11", "sys_platform": "linux", "platform_system": "Linux"}
    return [r for r in map(Requirement, listed) if r.marker is None or r.marker.evaluate(env)]


def makefile_value(name: str) -> str:
    return re.search(rf"^{name} \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


@pytest.mark.parametrize(("lock", "extras"), [(RUNTIME, ("hf",)), (TEST, ("hf", "test"))])
def test_the_lock_satisfies_pyproject(lock: Path, extras: tuple[str, ...]) -> None:
    locked = pins(lock)
    for req in requirements(*extras):
        name = canonicalize_name(req.name)
        if name == "torch":  # pinned by the Makefile, outside the lock (the CPU wheel)
            version = Version(makefile_value("TORCH_VERSION"))
        else:
            assert name in locked, f"{req} is in pyproject.toml but not in {lock.name}: make lock"
            version = locked[name]
        assert req.specifier.contains(version, prereleases=True), (
            f"{lock.name} pins {name}=={version}, outside pyproject.toml's {req}: make lock")


def test_the_runtime_lock_is_the_test_locks_versions() -> None:
    """One tested set: what `make run` and the image install is what `make test` ran."""
    runtime, test = pins(RUNTIME), pins(TEST)
    differ = {n: (v, test.get(n)) for n, v in runtime.items() if test.get(n) != v}
    assert not differ, f"runtime.lock and test.lock disagree: {differ}"


def test_no_cuda_build_and_no_torch_in_the_lock() -> None:
    for lock in (RUNTIME, TEST):
        names = pins(lock)
        assert "torch" not in names
        assert not [n for n in names if n.startswith(("nvidia-", "triton", "cuda-"))], lock.name


def test_every_install_takes_the_lock() -> None:
    """The Makefile installs from the lock without resolving, the image too; `make lock` is
    the one place that resolves."""
    makefile = (ROOT / "Makefile").read_text()
    assert "--require-hashes --no-deps -r $(1)" in makefile
    assert "$(call install_lock,$(RUNTIME_LOCK))" in makefile
    assert "$(call install_lock,$(TEST_LOCK))" in makefile
    assert re.search(r"^run: \$\(VENV\)/\.runtime", makefile, re.M)
    assert re.search(r"^test: \$\(STAMP\)", makefile, re.M) and "STAMP := $(VENV)/.test" in makefile
    # Nothing else installs by name, unpinned.
    for line in makefile.splitlines():
        m = re.search(r"pip install (?:-q )?(.*)", line)
        if m and "-r $(1)" not in line and "-e ." not in line:
            assert "==" in m.group(1), f"unpinned install in the Makefile: {line.strip()}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci

"""deploy/bundle.py (make bundle): the lock's pins and hashes, the dependency closure, and the
slimming of a wheel: the member left out, its RECORD line gone, the rest untouched, and the
slimmed wheel installs (pip, no index) and imports. On small wheels made here: no network."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bundle", ROOT / "deploy" / "bundle.py")
bundle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bundle)


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, name: str, files: dict[str, bytes], requires=()) -> Path:
    """A wheel of ``files`` (paths inside it) with a correct RECORD."""
    info = f"{name}-1.0.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    members = {
        **files,
        f"{info}/METADATA": meta.encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{p},{_digest(d)},{len(d)}\n" for p, d in members.items())
    record += f"{info}/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, d in members.items():
            z.writestr(p, d)
        z.writestr(f"{info}/RECORD", record)
    return path


def test_slimmed_wheel_drops_the_member_and_its_record_line_and_installs(tmp_path):
    src = make_wheel(
        tmp_path,
        "slimpkg",
        {
            "slimpkg/__init__.py": b"VALUE = 42\n",
            "slimpkg/jars/big.jar": b"\0" * 100_000,
        },
    )
    assert bundle.check_record(src) == []
    out = tmp_path / "out"
    out.mkdir()
    dropped = bundle.slim_wheel(src, out / src.name, ("slimpkg/jars/big.jar",))
    assert dropped == ["slimpkg/jars/big.jar"]
    slim = out / src.name
    with zipfile.ZipFile(slim) as z:
        assert "slimpkg/jars/big.jar" not in z.namelist()
        record = z.read("slimpkg-1.0.dist-info/RECORD").decode()
    assert "big.jar" not in record and "slimpkg/__init__.py" in record
    assert bundle.check_record(slim) == []  # every member listed, every hash right
    assert slim.stat().st_size < src.stat().st_size
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(slim),
        ],
        check=True,
    )
    assert not (target / "slimpkg" / "jars").exists()
    got = subprocess.run(
        [sys.executable, "-c", "import slimpkg; print(slimpkg.VALUE)"],
        cwd=target,
        capture_output=True,
        text=True,
        check=True,
    )
    assert got.stdout.strip() == "42"


def test_check_record_finds_a_wheel_whose_record_was_not_fixed(tmp_path):
    """What slimming by deleting the member alone (zip -d) would leave: a RECORD line for a
    member that is gone."""
    src = make_wheel(tmp_path, "slimpkg", {"slimpkg/__init__.py": b"", "slimpkg/a.jar": b"x"})
    broken = tmp_path / "broken.whl"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(broken, "w") as zout:
        for info in zin.infolist():
            if info.filename != "slimpkg/a.jar":
                zout.writestr(info, zin.read(info))
    assert bundle.check_record(broken) == ["in RECORD, not in the wheel: slimpkg/a.jar"]


def test_slimming_a_member_the_wheel_lacks_is_refused(tmp_path):
    src = make_wheel(tmp_path, "slimpkg", {"slimpkg/__init__.py": b""})
    with pytest.raises(bundle.BundleError, match=re.escape("has no ray/jars/ray_dist.jar")):
        bundle.slim_wheel(src, tmp_path / "x.whl", (bundle.RAY_JAR,))


def test_the_lock_parses_pins_and_hashes_and_the_real_lock_pins_ray(tmp_path):
    lock = tmp_path / "x.lock"
    lock.write_text(
        "# header\nfoo-bar==1.2 \\\n    --hash=sha256:"
        + "a" * 64
        + " \\\n    --hash=sha256:"
        + "b" * 64
        + "\n    # via x\nbaz==3 \\\n    --hash=sha256:"
        + "c" * 64
        + "\n"
    )
    got = bundle.parse_lock(lock)
    assert got == {
        "foo-bar": ("1.2", frozenset({"a" * 64, "b" * 64})),
        "baz": ("3", frozenset({"c" * 64})),
    }
    real = bundle.parse_lock(ROOT / "requirements" / "runtime.lock")
    assert real["ray"][0] == "2.60.0" and real["ray"][1]
    assert all(n in real for n in bundle.ROOTS)


def test_closure_follows_requirements_at_the_lock_versions_and_skips_the_image(tmp_path):
    wheels = {
        "app": make_wheel(
            tmp_path,
            "app",
            {"app.py": b""},
            ["lib>=1", "present", "win; sys_platform == 'win32'", "extra-only; extra == 'x'"],
        ),
        "lib": make_wheel(tmp_path, "lib", {"lib.py": b""}),
    }
    locked = {n: ("1.0", frozenset()) for n in ("app", "lib", "present")}
    asked = []

    def fetch(name: str, version: str) -> Path:
        asked.append((name, version))
        return wheels[name]

    got = bundle.closure(("app",), locked, fetch, frozenset({"present"}))
    assert sorted(got) == ["app", "lib"] and sorted(asked) == [("app", "1.0"), ("lib", "1.0")]
    with pytest.raises(bundle.BundleError, match="lib is needed but not in the lock"):
        bundle.closure(("app",), {"app": ("1.0", frozenset())}, fetch, frozenset({"present"}))

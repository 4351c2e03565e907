"""Shipped code: the CLI's zip of a directory, the service's checks and store, and what the
coordinator's runtime_env gets (service/code_store.py, scheduler/runtime/launch.py)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
from dynabatch.actors.data.fs import is_uri
from dynabatch.scheduler.runtime.launch import shipped_code
from dynabatch.service.code_store import (
    MAX_UNPACKED_BYTES,
    TOP_LEVEL,
    CodeRejected,
    check_archive,
    store_code,
    zip_directory,
)


def _tree(root: Path) -> Path:
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text("VALUE = 7\n")
    (root / "pkg" / "mod.pyc").write_bytes(b"\0")
    (root / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "data.txt").write_text("hello\n")
    return root


def test_a_directory_zips_under_one_top_level_directory_the_same_way_each_time(
    tmp_path: Path,
) -> None:
    src = _tree(tmp_path / "code")
    data = zip_directory(src)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.namelist() == [f"{TOP_LEVEL}/data.txt", f"{TOP_LEVEL}/pkg/__init__.py",
                                f"{TOP_LEVEL}/pkg/mod.py"]
        assert z.read(f"{TOP_LEVEL}/pkg/mod.py") == b"VALUE = 7\n"
    (src / "pkg" / "mod.py").touch()  # a new mtime: same content, same bytes
    assert zip_directory(src) == data
    assert check_archive(data) == 3


def test_store_keeps_one_file_per_content_and_names_it_by_uri(tmp_path: Path) -> None:
    data = zip_directory(_tree(tmp_path / "code"))
    root = tmp_path / "store" / "code"  # created on first use
    first = store_code(data, str(root))
    again = store_code(data, str(root))
    assert first == again and first.files == 3 and first.bytes == len(data)
    path = root / f"{first.sha256}.zip"
    assert first.working_dir == path.resolve().as_uri() and path.read_bytes() == data
    assert [p.name for p in root.iterdir()] == [path.name]  # no temporary file left behind


def test_an_archive_that_unpacks_too_large_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("w/zeros.bin", b"\0" * 200_000)  # a small zip, a large file
    monkeypatch.setattr("dynabatch.service.code_store.MAX_UNPACKED_BYTES", 100_000)
    with pytest.raises(CodeRejected, match="unpacks to 200000 bytes: at most 100000"):
        check_archive(buf.getvalue())
    assert MAX_UNPACKED_BYTES == 512 * 2**20


def test_the_coordinator_gets_a_uri_as_its_runtime_env() -> None:
    uri = "file:///data/code/ab12.zip"
    assert is_uri(uri) and is_uri("gcs://_ray_pkg_1.zip") and not is_uri("/data/code")
    assert shipped_code(uri) == {"working_dir": uri}
    assert shipped_code("https://example.org/code.zip") == {
        "working_dir": "https://example.org/code.zip"}

"""Code shipped with a job: the zip ``dynabatch submit --working-dir`` makes of a directory
and uploads (``POST /v1/code``), checked and stored under the operator's code root.

Ray takes a per-actor ``working_dir`` only as a URI, so the service keeps each upload as
``<code_root>/<sha256>.zip`` (content-addressed: the same code is stored once) and names it
``file://<code_root>/<sha256>.zip`` in the job's spec. Every Ray node must read the code root
at the same path (one machine, or a volume they all mount). Ray unpacks the zip on each node,
removing a single top-level directory, which is how :func:`zip_directory` lays it out.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

from dynabatch.actors.spec import URI_PATTERN
from dynabatch.service.schemas import CodeUploaded

# What one upload may unpack to on every node (Ray's own bound on a working_dir is 500 MiB).
MAX_UNPACKED_BYTES = 512 * 2**20
MAX_MEMBERS = 50_000
TOP_LEVEL = "working_dir"  # the archive's single top-level directory (Ray removes it)
SKIPPED_DIRS = frozenset({".git", "__pycache__", ".venv", ".mypy_cache", ".pytest_cache"})


class CodeRejected(ValueError):
    """The upload is not a zip the nodes can unpack safely (one line: why)."""


def check_archive(data: bytes) -> int:
    """The number of files in ``data``, a zip archive; :class:`CodeRejected` naming the
    problem when it is not one, is corrupt, names a path outside itself, or unpacks to
    more than :data:`MAX_UNPACKED_BYTES`."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, ValueError) as err:
        raise CodeRejected(f"not a zip archive ({err})") from None
    with archive:
        members = archive.infolist()
        if len(members) > MAX_MEMBERS:
            raise CodeRejected(f"{len(members)} entries: at most {MAX_MEMBERS}")
        files, unpacked = 0, 0
        for m in members:
            path = PurePosixPath(m.filename.replace("\\", "/"))
            if path.is_absolute() or ".." in path.parts or ":" in (path.parts or ("",))[0]:
                raise CodeRejected(f"the entry {m.filename!r} points outside the archive")
            if not m.is_dir():
                files += 1
                unpacked += m.file_size
        if unpacked > MAX_UNPACKED_BYTES:
            raise CodeRejected(f"it unpacks to {unpacked} bytes: at most {MAX_UNPACKED_BYTES}")
        if not files:
            raise CodeRejected("the archive holds no file")
        try:
            bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError) as err:
            raise CodeRejected(f"the archive cannot be read ({err})") from None
        if bad is not None:
            raise CodeRejected(f"the entry {bad!r} is corrupt (CRC mismatch)")
    return files


def store_code(data: bytes, code_root: str) -> CodeUploaded:
    """Check ``data`` (:func:`check_archive`) and keep it under ``code_root``."""
    files = check_archive(data)
    digest = hashlib.sha256(data).hexdigest()
    root = Path(code_root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{digest}.zip"
    if not path.exists():  # written whole, then renamed: a node never sees half a zip
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".upload-", suffix=".zip")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return CodeUploaded(working_dir=path.resolve().as_uri(), sha256=digest, bytes=len(data),
                        files=files)


def local_working_dir(value: Any) -> bool:
    """Whether a spec's ``working_dir`` names a directory on this machine (not a URI): the
    code a client zips and uploads."""
    return isinstance(value, str) and bool(value) and not re.match(URI_PATTERN, value)


def zip_directory(directory: Path) -> bytes:
    """``directory`` as a zip whose single top-level directory holds its files (sorted, so
    the same code gives the same bytes and the same URI). Caches and version-control
    folders (:data:`SKIPPED_DIRS`) and compiled files stay out."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for dirpath, dirnames, filenames in os.walk(directory, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
            for name in sorted(filenames):
                if name.endswith((".pyc", ".pyo")):
                    continue
                full = Path(dirpath) / name
                if not full.is_file():  # a broken link, a socket...
                    continue
                rel = full.relative_to(directory).as_posix()
                info = zipfile.ZipInfo(f"{TOP_LEVEL}/{rel}", date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = 0o644 << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, full.read_bytes())
    return buf.getvalue()

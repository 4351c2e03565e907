"""Paths: local, or any URI that ``pyarrow.fs`` opens (``s3://``, ``gs://``, ``hdfs://``,
``file://``). One helper to open the filesystem and one to list a directory's files."""

from __future__ import annotations

import os
import re
from typing import Any

from dynabatch.actors.data.source import DataError
from dynabatch.actors.errors import first_line

# What a URI looks like (a scheme, then ://): anything else is a local path. Here, with no
# import beyond the standard library, so that what reads data needs no spec (a bare GPU
# machine has no pydantic).
URI_PATTERN = r"^[A-Za-z][A-Za-z0-9+.-]*://"


def is_uri(path: str) -> bool:
    """Whether ``path`` starts with a URI scheme (``s3://``, ``file://``): the spec's rule."""
    return re.match(URI_PATTERN, path) is not None


def open_fs(path: str, field: str = "dataset.path") -> tuple[Any, str]:
    """(filesystem, path inside it) for a local path or a URI."""
    from pyarrow import fs

    if not is_uri(path):
        return fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    try:
        return fs.FileSystem.from_uri(path)
    except Exception as err:
        raise DataError(f"{field}: cannot open {path!r} ({first_line(err)})") from err


def kind_of(filesystem: Any, path: str) -> str:
    """``file``, ``dir`` or ``missing``."""
    from pyarrow import fs

    info = filesystem.get_file_info(path)
    return {fs.FileType.File: "file", fs.FileType.Directory: "dir"}.get(info.type, "missing")


def list_files(filesystem: Any, path: str, suffixes: tuple[str, ...],
               field: str = "dataset.path") -> list[str]:
    """The files under ``path`` (itself when it is a file) ending in one of ``suffixes``,
    sorted; a DataError naming ``field`` when there is nothing to read."""
    from pyarrow import fs

    k = kind_of(filesystem, path)
    if k == "missing":
        raise DataError(f"{field}: {path} does not exist")
    if k == "file":
        return [path]
    infos = filesystem.get_file_info(fs.FileSelector(path, recursive=True))
    out = sorted(i.path for i in infos if i.type == fs.FileType.File
                 and i.path.lower().endswith(suffixes)
                 and not os.path.basename(i.path).startswith((".", "_")))
    if not out:
        raise DataError(f"{field}: no {'/'.join(suffixes)} files under {path}")
    return out


def join(base: str, *names: str) -> str:
    """``base/name/...`` for a local path or a URI alike (a trailing ``/`` on ``base`` is
    not doubled): the one way a job's directory under a root is named."""
    return "/".join([str(base).rstrip("/"), *names])


def child(filesystem: Any, path: str, name: str) -> str | None:
    """``path/name`` when it exists (a file or directory), else None."""
    p = join(path, name)
    return p if kind_of(filesystem, p) != "missing" else None

"""Job checkpoints: one file per job, written atomically.

A checkpoint holds tensors and plain data only, so it is loaded with ``weights_only=True``:
a file that would make the unpickler build any other object (run code) is refused with a
:class:`CheckpointError` (checkpoint directories are shared storage others may write to).
Saving checks the payload against the same rule, so what a load would refuse fails when it
is written, not at resume.

A checkpoint directory is a local path or a URI that ``pyarrow.fs`` opens
(:func:`dynabatch.actors.data.fs.open_fs`). A reader sees the old checkpoint or the new one,
never half of one: a local file is written to a temporary file, fsynced and renamed; on
any other filesystem it is written to a temporary name beside it and moved over the old
one (one put is not all-or-nothing: after a failure, closing its stream completes the
upload with what was written).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import tempfile
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

import torch
from dynabatch.actors.data.fs import is_uri, join, kind_of
from dynabatch.actors.data.source import DataError
from dynabatch.actors.errors import first_line

# What torch's weights-only unpickler rebuilds (exact types: subclasses such as namedtuples
# or numpy scalars are refused by it).
_CONTAINERS = (dict, OrderedDict, list, tuple, torch.Size)
_ATOMS = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (safely), or a payload that could not be loaded
    back; the one-line message names the file, or the value by its key path."""


# The latest checkpoint, and the best epoch's by a metric (checkpoint.keep_best).
LATEST, BEST = "checkpoint.pt", "best.pt"


def checkpoint_path(directory: str | Path, job_id: str, name: str = LATEST) -> Path | str:
    """Where the job's checkpoint ``name`` is: a Path under a local ``directory``, the URI
    under a URI one."""
    if is_uri(str(directory)):
        return join(str(directory), job_id, name)
    return Path(directory) / job_id / name


def _open(location: str | Path) -> tuple[Any | None, str]:
    """(filesystem, path in it) for a URI; (None, local path) for a local path or a URI on
    the local filesystem (``file://``), which is written with the local, fsynced write.
    :class:`CheckpointError` naming ``location`` when the URI cannot be opened."""
    from dynabatch.actors.data.fs import open_fs  # looked up per call: tests stand one in
    from pyarrow import fs

    if not is_uri(str(location)):
        return None, str(location)
    try:
        filesystem, path = open_fs(str(location), "checkpoint")
    except DataError as err:
        raise CheckpointError(
            f"{location}: cannot open it ({first_line(err.__cause__ or err)})"
        ) from None
    return (None, path) if isinstance(filesystem, fs.LocalFileSystem) else (filesystem, path)


def _kind(location: str | Path) -> tuple[Any | None, str, str]:
    """(filesystem, path, ``file``/``dir``/``missing``) of ``location`` (see :func:`_open`);
    :class:`CheckpointError` naming it when it cannot be looked at."""
    filesystem, path = _open(location)
    if filesystem is None:
        local = Path(path)
        return None, path, "file" if local.is_file() else "dir" if local.is_dir() else "missing"
    try:
        return filesystem, path, kind_of(filesystem, path)
    except OSError as err:
        raise CheckpointError(f"{location}: cannot look at it ({first_line(err)})") from None


def checkpoint_exists(directory: str | Path, job_id: str, name: str = LATEST) -> bool:
    """Whether the job's checkpoint ``name`` is there (False when it cannot be looked at)."""
    try:
        return _kind(checkpoint_path(directory, job_id, name))[2] == "file"
    except CheckpointError:
        return False


def save_checkpoint(
    directory: str | Path, job_id: str, payload: dict[str, Any], name: str = LATEST
) -> Path | str:
    """Write ``payload`` atomically (as ``name``: the latest or the best) under a local
    ``directory`` or a URI. Raises :class:`CheckpointError` (and writes nothing) when it holds
    a value that :func:`load_checkpoint` would refuse."""
    _check_plain(payload, "payload")
    where = checkpoint_path(directory, job_id, name)
    filesystem, path = _open(where)
    if filesystem is None:
        _save_local(Path(path), payload)
    else:
        _save_moved(filesystem, path, payload)
    return where


def _save_local(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        # A reader sees the old checkpoint or the new one, never half of one.
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _save_moved(filesystem: Any, path: str, payload: dict[str, Any]) -> None:
    """Write to a temporary name beside ``path``, then move it there (see the module's
    docstring: why not one put). A failed write leaves ``path`` as it was."""
    parent = path.rsplit("/", 1)[0]
    filesystem.create_dir(parent, recursive=True)
    tmp = f"{parent}/.checkpoint-{uuid.uuid4().hex}"
    try:
        with filesystem.open_output_stream(tmp) as out:
            torch.save(payload, out)
        filesystem.move(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the error that got us here matters, not this
            filesystem.delete_file(tmp)
        raise


def _check_plain(value: Any, where: str) -> None:
    """Raise CheckpointError naming the first value (by its key path) that is not a tensor or
    plain data."""
    kind = type(value)
    if isinstance(value, torch.Tensor) or kind in _ATOMS:
        return
    if kind not in _CONTAINERS:
        raise CheckpointError(
            f"cannot checkpoint {where}: a {kind.__module__}.{kind.__qualname__} is not a "
            "tensor or plain data (a weights-only load would refuse it)"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, f"{where} key {key!r}")
            _check_plain(item, f"{where}.{key}")
    else:
        for i, item in enumerate(value):
            _check_plain(item, f"{where}.{i}")


def load_checkpoint(directory: str | Path, job_id: str, name: str = LATEST
                    ) -> dict[str, Any] | None:
    """The job's checkpoint ``name`` (under a local ``directory`` or a URI), None when it has
    none. Raises :class:`CheckpointError` for a file that holds anything but tensors and
    plain data, or that cannot be read."""
    path = checkpoint_path(directory, job_id, name)
    found = _kind(path)  # one lookup: on an object store each is a request
    return None if found[2] == "missing" else _load_found(path, *found)


def load_checkpoint_file(path: str | Path) -> dict[str, Any]:
    """The checkpoint in the file ``path`` (a local path or a URI; another job's, for
    ``checkpoint.from``). Raises :class:`CheckpointError` naming the file when it is not
    there, cannot be read, or holds anything but tensors and plain data."""
    return _load_found(path, *_kind(path))


def _load_found(path: str | Path, filesystem: Any | None, where: str, kind: str
                ) -> dict[str, Any]:
    if kind != "file":
        why = "it is a directory, not a checkpoint file" if kind == "dir" else "no such file"
        raise CheckpointError(f"{path}: {why}")
    if filesystem is None:
        return _load(where, path)
    try:
        with filesystem.open_input_stream(where) as f:
            data = f.read()
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({first_line(err)})") from None
    return _load(io.BytesIO(data), path)


def _load(source: str | BinaryIO, path: str | Path) -> dict[str, Any]:
    """The checkpoint in ``source`` (a local file's path, or its bytes), checked; errors
    name ``path``."""
    try:
        # map_location: a checkpoint written from a GPU worker loads where there is none;
        # load_state_dict puts the tensors back on the worker's device.
        payload = torch.load(source, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        detail = _refused(err)
        if "Unsupported operand" in detail:  # not a pickle stream at all
            raise CheckpointError(f"{path}: cannot read the checkpoint ({detail})") from None
        raise CheckpointError(
            f"{path}: refused to load: it holds objects other than tensors and plain data "
            f"({detail})"
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({_one_line(err)})") from None
    if not isinstance(payload, dict):
        raise CheckpointError(
            f"{path}: not a dynabatch checkpoint (a {type(payload).__name__}, not a dict)"
        )
    return payload


def _one_line(err: BaseException, limit: int = 200) -> str:
    """The first sentence of the error, on one line (torch's go on with advice)."""
    text = " ".join(str(err).split()).split(". ")[0] or type(err).__name__
    return text[:limit]


def _refused(err: pickle.UnpicklingError) -> str:
    """What was refused (``... GLOBAL posix.system ...``), without the advice around it in
    torch's message (which suggests ``weights_only=False``)."""
    text = " ".join(str(err).split())
    for marker in ("trusted source.", "WeightsUnpickler error:"):
        at = text.rfind(marker)
        if at >= 0:
            text = text[at + len(marker) :]
    text = text.split("Check the documentation")[0].strip()
    return text[:200] or "refused by the weights-only unpickler"

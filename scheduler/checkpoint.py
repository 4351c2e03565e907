"""Job checkpoints: one file per job, written atomically (temp file, fsync, rename).

A checkpoint holds tensors and plain data only (dicts, lists, tuples, numbers, strings, None:
the model and optimizer state dicts, the plan, the history), so it is loaded with
``weights_only=True``: a file that would make the unpickler build any other object (run code)
is refused with a :class:`CheckpointError`. Checkpoint directories are shared storage that
others may be able to write to. Saving checks the payload against the same rule, so that a
value the load would refuse (a numpy scalar, say) fails when it is written, not at resume.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

# What torch's weights-only unpickler rebuilds (exact types: subclasses such as namedtuples
# or numpy scalars are refused by it).
_CONTAINERS = (dict, OrderedDict, list, tuple, torch.Size)
_ATOMS = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (safely), or a payload that could not be loaded
    back; the one-line message names the file, or the value by its key path."""


# The latest checkpoint, and the best epoch's by a metric (checkpoint.keep_best).
LATEST, BEST = "checkpoint.pt", "best.pt"


def checkpoint_path(directory: str | Path, job_id: str, name: str = LATEST) -> Path:
    return Path(directory) / job_id / name


def save_checkpoint(directory: str | Path, job_id: str, payload: dict[str, Any],
                    name: str = LATEST) -> Path:
    """Write ``payload`` atomically (as ``name``: the latest or the best). Raises
    :class:`CheckpointError` (and writes nothing) when it holds a value that
    :func:`load_checkpoint` would refuse."""
    _check_plain(payload, "payload")
    path = checkpoint_path(directory, job_id, name)
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
    return path


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


def load_checkpoint(directory: str | Path, job_id: str) -> dict[str, Any] | None:
    """The job's checkpoint, None when it has none. Raises :class:`CheckpointError` for a file
    that holds anything but tensors and plain data, or that cannot be read."""
    path = checkpoint_path(directory, job_id)
    if not path.exists():
        return None
    return load_checkpoint_file(path)


def load_checkpoint_file(path: str | Path) -> dict[str, Any]:
    """The checkpoint in the file ``path`` (another job's, for ``checkpoint.from``). Raises
    :class:`CheckpointError` naming the file when it is not there, cannot be read, or holds
    anything but tensors and plain data."""
    path = Path(path)
    if not path.is_file():
        why = "it is a directory, not a checkpoint file" if path.is_dir() else "no such file"
        raise CheckpointError(f"{path}: {why}")
    try:
        # map_location: a checkpoint written from a GPU worker loads where there is none;
        # load_state_dict puts the tensors back on the worker's device.
        payload = torch.load(path, weights_only=True, map_location="cpu")
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

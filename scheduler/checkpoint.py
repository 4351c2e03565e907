"""Job checkpoints: one file per job, written atomically (temp file, fsync, rename)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def checkpoint_path(directory: str | Path, job_id: str) -> Path:
    return Path(directory) / job_id / "checkpoint.pt"


def save_checkpoint(directory: str | Path, job_id: str, payload: dict[str, Any]) -> Path:
    path = checkpoint_path(directory, job_id)
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


def load_checkpoint(directory: str | Path, job_id: str) -> dict[str, Any] | None:
    path = checkpoint_path(directory, job_id)
    if not path.exists():
        return None
    return torch.load(path, weights_only=False)

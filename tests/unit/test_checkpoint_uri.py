"""Checkpoints under a URI (``file://``, or any filesystem ``pyarrow.fs`` opens): saved and
loaded whole, never seen half-written, resumed from, and confined over REST like
``artifacts.dir``. There is no network here: an object store is stood in for by a
``SubTreeFileSystem`` that the one URI opener (``dynabatch.actors.data.fs.open_fs``) returns
for ``s3://bucket/...``; its paths are not local paths, so any write that bypassed
``pyarrow.fs`` would miss it."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from dynabatch.actors.data import fs as data_fs
from dynabatch.actors.spec import parse_spec
from dynabatch.scheduler.checkpoint import (
    CheckpointError,
    checkpoint_exists,
    checkpoint_path,
    load_checkpoint,
    load_checkpoint_file,
    save_checkpoint,
)

from tests.unit.test_checkpoint import _fake_job

JOB = "0123456789ab"
BUCKET = "s3://bucket"


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``s3://bucket/...`` opens as a pyarrow filesystem rooted at the returned directory
    (other URIs and local paths open as they always do)."""
    from pyarrow import fs

    root = tmp_path / "store"
    root.mkdir()
    real = data_fs.open_fs

    def open_fs(path: str, field: str = "dataset.path") -> tuple[Any, str]:
        if path.startswith(f"{BUCKET}/"):
            sub = fs.SubTreeFileSystem(str(root), fs.LocalFileSystem())
            return sub, "bucket/" + path[len(BUCKET) + 1 :]
        return real(path, field)

    monkeypatch.setattr(data_fs, "open_fs", open_fs)
    return root


def _payload(epoch: int) -> dict[str, Any]:
    model = torch.nn.Linear(4, 3)
    return {
        "epoch": epoch,
        "step": 0,
        "weights": {"model": model.state_dict()},
        "history": [],
        "note": "x" * 10_000,
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["epoch"] == b["epoch"] and all(
        torch.equal(a["weights"]["model"][k], v) for k, v in b["weights"]["model"].items()
    )


def test_a_checkpoint_round_trips_through_a_file_uri(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/ckpt"
    payload = _payload(3)
    where = save_checkpoint(uri, JOB, payload)
    assert where == f"{uri}/{JOB}/checkpoint.pt" == checkpoint_path(uri, JOB)
    assert (tmp_path / "ckpt" / JOB / "checkpoint.pt").is_file()
    assert checkpoint_exists(uri, JOB) and not checkpoint_exists(uri, "other")
    assert _same(load_checkpoint(uri, JOB), payload)
    assert _same(load_checkpoint_file(where), payload)  # checkpoint.from as a URI
    assert load_checkpoint(uri, "other") is None


def test_a_checkpoint_round_trips_through_a_pyarrow_filesystem(store: Path) -> None:
    uri = f"{BUCKET}/ckpt"
    payload = _payload(2)
    where = save_checkpoint(uri, JOB, payload)
    assert where == f"{uri}/{JOB}/checkpoint.pt"
    # Written through the filesystem, under its root, and nothing else left beside it.
    assert [p.name for p in (store / "bucket" / "ckpt" / JOB).iterdir()] == ["checkpoint.pt"]
    assert checkpoint_exists(uri, JOB) and not checkpoint_exists(uri, "other")
    assert _same(load_checkpoint(uri, JOB), payload)
    assert _same(load_checkpoint_file(where), payload)
    assert load_checkpoint(uri, "other") is None
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_file(f"{uri}/nope/checkpoint.pt")
    assert str(info.value) == f"{uri}/nope/checkpoint.pt: no such file"


def _half_then_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save writes half of the real file into the stream, then the write fails (a
    full disk, a dropped connection)."""
    real = torch.save

    def save(obj: Any, f: Any, *args: Any, **kw: Any) -> None:
        buf = io.BytesIO()
        real(obj, buf, *args, **kw)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        raise OSError("no space left on device")

    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize("where", ["file", "filesystem"])
def test_a_reader_never_sees_a_half_written_checkpoint(
    tmp_path: Path, store: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    uri = f"file://{tmp_path}/ckpt" if where == "file" else f"{BUCKET}/ckpt"
    first = _payload(1)
    save_checkpoint(uri, JOB, first)
    real_save = torch.save
    _half_then_fail(monkeypatch)
    with pytest.raises(OSError, match="no space left"):
        save_checkpoint(uri, JOB, _payload(2))
    monkeypatch.setattr(torch, "save", real_save)
    assert _same(load_checkpoint(uri, JOB), first), "the previous checkpoint is still loaded"
    folder = (tmp_path / "ckpt" if where == "file" else store / "bucket" / "ckpt") / JOB
    assert [p.name for p in folder.iterdir()] == ["checkpoint.pt"], "no temporary file left"


def test_a_uri_that_cannot_be_opened_is_one_line_naming_it() -> None:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint("nosuchscheme://x/ckpt", JOB)
    text = str(info.value)
    assert text.startswith(f"nosuchscheme://x/ckpt/{JOB}/checkpoint.pt: cannot open it (")
    assert "\n" not in text


def test_a_job_resumes_and_starts_from_checkpoints_under_a_uri(store: Path) -> None:
    from dynabatch.service.reconciler import checkpoint_exists as service_finds

    uri = f"{BUCKET}/ckpt"
    first, _ = _fake_job("job-a", checkpoint={"dir": uri})
    first.run()
    assert first.snapshot().state.value == "SUCCEEDED", first.snapshot().reason
    assert (store / "bucket" / "ckpt" / "job-a" / "checkpoint.pt").is_file()
    # `dynabatch resume` asks the service whether the job has a checkpoint to resume from.
    rec = SimpleNamespace(id="job-a", spec=parse_spec({"checkpoint": {"dir": uri}}))
    assert service_finds(rec)
    assert not service_finds(SimpleNamespace(id="job-z", spec=rec.spec))

    again, _ = _fake_job("job-a", epochs=2, checkpoint={"dir": uri})  # a new coordinator
    assert "resuming from checkpoint at epoch 1 step 0" in [x.message for x in again.logs()]
    again.run()
    assert again.snapshot().state.value == "SUCCEEDED", again.snapshot().reason
    assert [r.epoch for r in again.history()] == [0, 1]  # epoch 0 from the checkpoint

    source = f"{uri}/job-a/checkpoint.pt"
    other, _ = _fake_job("job-b", checkpoint={"from": source})
    assert other.checkpoints.weights is not None
    assert any(f"starting from checkpoint {source}" in x.message for x in other.logs())


def test_checkpoint_dir_uris_are_confined_like_artifacts_dir(tmp_path: Path) -> None:
    from dynabatch.service.settings import Settings
    from dynabatch.service.submit_policy import SpecNotAllowed, check_paths

    def problems(value: str, root: str | None) -> list[tuple[str, str]]:
        return check_paths(parse_spec({"checkpoint": {"dir": value}}), [], root)

    local = str(tmp_path / "ckpt")
    assert problems(f"{local}/runs", local) == []  # local paths as before
    assert problems(f"file://{local}/runs", local) == []  # the local path it names
    (problem,) = problems("s3://bucket/ckpt", local)
    assert problem[0] == "checkpoint.dir" and "outside the allowed locations" in problem[1]
    root = "s3://bucket/ckpt"
    assert problems("s3://bucket/ckpt/runs", root) == []
    for bad in ("s3://bucket/ckpt2", "s3://bucket/ckpt/../x", local):
        (problem,) = problems(bad, root)
        assert problem[0] == "checkpoint.dir", problem
    text = str(SpecNotAllowed(problems("s3://bucket/ckpt2", root)))
    assert text.startswith("checkpoint.dir: 's3://bucket/ckpt2' is outside the allowed")
    assert "\n" not in text
    # checkpoint.from under a URI root, and the setting that allows it.
    spec = parse_spec({"checkpoint": {"from": "s3://bucket/ckpt/a/checkpoint.pt"}})
    assert check_paths(spec, [], root) == []
    assert Settings(checkpoint_root=root).submit_policy.checkpoint_root == root
    with pytest.raises(ValueError, match="not an absolute path nor a URI"):
        Settings(checkpoint_root="relative/ckpt")

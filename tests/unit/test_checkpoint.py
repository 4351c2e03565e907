"""Checkpoints load with torch's weights-only unpickler: the coordinator's real payload
round-trips, and a file that would build any other object (run code) is refused."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dynabatch.actors.contracts import StepTelemetry
from dynabatch.actors.spec import parse_spec
from dynabatch.actors.workloads import build_model
from dynabatch.scheduler.checkpoint import (
    CheckpointError,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
)
from dynabatch.scheduler.core.ledger import Ledger
from dynabatch.scheduler.core.sync.allocation import WorkerTelemetry
from dynabatch.scheduler.core.sync.policy import make_policy
from dynabatch.scheduler.core.sync.protocol import Position, SyncProtocol
from dynabatch.scheduler.telemetry import EpochRecord, WorkerEpochStats

JOB = "0123456789ab"


def _worker_state() -> dict[str, Any]:
    """What Worker.state() returns: a model's state dict and an SGD-with-momentum optimizer's
    after one step (so it has momentum buffers)."""
    model = build_model(parse_spec({"model": {"name": "mlp", "hidden": 8}}).model, (1, 8, 8), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return {
        "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
    }


def _payload() -> dict[str, Any]:
    """The dict scheduler/sync/coordinator.py's _checkpoint saves, built from the real parts."""
    spec = parse_spec({"epochs": 3, "checkpoint": {"dir": "/ckpt"}, "workers": 2})
    # A ledger mid-epoch, filled from real worker reports (as the coordinator keeps it).
    protocol = SyncProtocol(global_batch=64, dataset_size=1000, seed=0,
                            position=Position(1, 0))
    protocol.replan(make_policy("affine"), [WorkerTelemetry(worker="w0"),
                                            WorkerTelemetry(worker="w1")])
    ledger = Ledger()
    ledger.begin_epoch(1, 1000)
    for step in zip(*(p.steps for p in protocol.plan_segment().values()), strict=True):
        ledger.commit([StepTelemetry(
            worker=f"w{i}", epoch=1, step=sp.step, batch=sp.own_size, samples=sp.own_size,
            compute_s=0.01, wait_s=0.0, loss_sum=1.5, start=sp.own_start, step_start=sp.start,
            step_size=sp.size, coverage=((1, sp.size),)) for i, sp in enumerate(step)])
    ledger.retry(64)
    stats = WorkerEpochStats(
        worker="w0", node="n0", batch=32, partition=500, steps=16, compute_s=0.5, wait_s=0.1,
        throughput=1000.0,
    )
    record = EpochRecord(
        epoch=0, wall_s=1.5, steps=16, dataset_size=1000, samples_trained=1000,
        train_loss=0.7, test_loss=None, test_accuracy=0.9, utilization=0.8,
        compute_balance=0.95, policy="affine", workers=[stats],
    )
    return {
        "job_id": JOB,
        "spec": spec.model_dump(mode="json"),
        "epoch": 1,
        "step": 0,
        "weights": _worker_state(),
        "ledger": ledger.to_state(),
        "history": [record.model_dump(mode="json")],
        "counters": {"rebalances_total": 2, "retried_samples_total": 0, "next_ordinal": 2},
        "time": 1_700_000_000.5,
        "reason": "epoch",
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_the_coordinators_payload_loads_weights_only(tmp_path: Path) -> None:
    payload = _payload()
    assert payload["weights"]["optimizer"]["state"], "the optimizer has momentum buffers"
    save_checkpoint(tmp_path, JOB, payload)
    loaded = load_checkpoint(tmp_path, JOB)
    assert loaded is not None and _same(payload, loaded)
    # It restores: a fresh model and optimizer take the loaded state.
    state = _worker_state()
    model = build_model(parse_spec({"model": {"hidden": 8}}).model, (1, 8, 8), 10)
    model.load_state_dict(loaded["weights"]["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(loaded["weights"]["optimizer"])
    assert set(state["optimizer"]["state"]) == set(opt.state_dict()["state"])


def test_no_checkpoint_is_none(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path, JOB) is None


class _RunsCode:
    """Unpickling this calls os.system: what a crafted checkpoint file can do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = checkpoint_path(tmp_path, JOB)
    path.parent.mkdir(parents=True)
    torch.save({"epoch": 1, "weights": _RunsCode(marker)}, path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, JOB)
    assert not marker.exists(), "the unpickler ran the file's code"
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"{path}: refused to load: it holds objects other than tensors")
    assert "system" in text and "weights_only" not in text, text  # no unsafe advice
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"not a checkpoint at all", "cannot read the checkpoint (Unsupported operand"),
        (b"PK\x03\x04 truncated zip", "cannot read the checkpoint (PytorchStreamReader"),
        (b"", "cannot read the checkpoint (EOFError)"),
    ],
)
def test_a_damaged_checkpoint_is_one_clear_error(
    tmp_path: Path, content: bytes, needle: str
) -> None:
    path = checkpoint_path(tmp_path, JOB)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, JOB)
    text = str(info.value)
    assert "\n" not in text and text.startswith(str(path)) and needle in text, text


def test_a_checkpoint_that_is_not_a_dict_is_refused(tmp_path: Path) -> None:
    path = checkpoint_path(tmp_path, JOB)
    path.parent.mkdir(parents=True)
    torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointError, match="not a dynabatch checkpoint"):
        load_checkpoint(tmp_path, JOB)


@pytest.mark.parametrize(
    ("value", "where", "kind"),
    [
        ({"steps": [[1, np.int64(2)]]}, "payload.ledger.steps.0.1", "numpy.int64"),
        ({"seen": {1, 2}}, "payload.ledger.seen", "builtins.set"),
        (np.zeros(3), "payload.ledger", "numpy.ndarray"),
    ],
)
def test_saving_what_a_load_would_refuse_fails_at_once(
    tmp_path: Path, value: Any, where: str, kind: str
) -> None:
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, JOB, {"epoch": 1, "ledger": value})
    assert str(info.value).startswith(f"cannot checkpoint {where}: a {kind} is not a tensor")
    assert not checkpoint_path(tmp_path, JOB).parent.exists(), "nothing is written"

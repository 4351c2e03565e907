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
from dynabatch.actors.workloads.models import build_model
from dynabatch.scheduler.checkpoint import (
    CheckpointError,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
)
from dynabatch.scheduler.core.ledger import Ledger
from dynabatch.scheduler.core.sync.allocation import WorkerTelemetry
from dynabatch.scheduler.core.sync.policy import policy_for
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
    protocol = SyncProtocol(global_batch=64, dataset_size=1000, seed=0, position=Position(1, 0))
    protocol.replan(
        policy_for("affine"), [WorkerTelemetry(worker="w0"), WorkerTelemetry(worker="w1")]
    )
    ledger = Ledger()
    ledger.begin_epoch(1, 1000)
    for step in zip(*(p.steps for p in protocol.plan_segment().values()), strict=True):
        ledger.commit(
            [
                StepTelemetry(
                    worker=f"w{i}",
                    epoch=1,
                    step=sp.step,
                    batch=sp.own_size,
                    samples=sp.own_size,
                    compute_s=0.01,
                    wait_s=0.0,
                    loss_sum=1.5,
                    start=sp.own_start,
                    step_start=sp.start,
                    step_size=sp.size,
                    coverage=((1, sp.size),),
                )
                for i, sp in enumerate(step)
            ]
        )
    ledger.retry(64)
    stats = WorkerEpochStats(
        worker="w0",
        node="n0",
        batch=32,
        partition=500,
        steps=16,
        compute_s=0.5,
        wait_s=0.1,
        throughput=1000.0,
    )
    record = EpochRecord(
        epoch=0,
        wall_s=1.5,
        steps=16,
        dataset_size=1000,
        samples_trained=1000,
        train_loss=0.7,
        test_loss=None,
        test_accuracy=0.9,
        utilization=0.8,
        compute_balance=0.95,
        policy="affine",
        workers=[stats],
    )
    return {
        "job_id": JOB,
        "spec": spec.model_dump(mode="json"),
        "epoch": 1,
        "step": 0,
        "weights": _worker_state(),
        "ledger": ledger.to_state(),
        "history": [record.model_dump(mode="json")],
        "counters": {"epoch_rebalances": 0, "next_ordinal": 2},
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


# checkpoint.from: a new job starts from another job's checkpoint ---------------------
def _fake_job(job_id: str, **kw: Any) -> tuple[Any, Any]:
    """The real coordinator on the simulator's runtime, whose workers' "weights" (the test's
    :class:`~tests.fakes.Lineages`) are the list of the (epoch, step) updates they applied."""
    from dynabatch.scheduler.sync.coordinator import Coordinator

    from tests.fakes import Lineages, sim_runtime

    spec = parse_spec(
        {
            "workers": 2,
            "min_workers": 1,
            "global_batch": 64,
            "epochs": 1,
            "collective_timeout_s": 2,
            "worker_wait_timeout_s": 5,
            "start_timeout_s": 5,
            **kw,
        }
    )
    lineages = Lineages()
    rt = sim_runtime(spec, n_train=256, speeds={0: 1000, 1: 500}, gradients=lineages)
    return Coordinator(job_id, spec, runtime=rt, clock=rt.clock), lineages


def test_checkpoint_from_round_trips_and_is_named_on_error() -> None:
    from dynabatch.actors.spec import JobSpec, SpecError

    spec = parse_spec({"checkpoint": {"from": "/ckpt/a/checkpoint.pt"}})
    assert spec.checkpoint.from_ == "/ckpt/a/checkpoint.pt"
    dumped = spec.model_dump(mode="json")["checkpoint"]
    assert dumped["from"] == "/ckpt/a/checkpoint.pt" and "from_" not in dumped
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec
    for bad, needle in (({"from": ""}, "checkpoint.from: "), ({"from": 3}, "checkpoint.from: ")):
        with pytest.raises(SpecError) as info:
            parse_spec({"checkpoint": bad})
        assert str(info.value).startswith(needle) and "\n" not in str(info.value)
    with pytest.raises(SpecError) as info:
        parse_spec({"checkpoint": {"from": "/c.pt"}, "workers": 2, "protocol": {"name": "ps"}})
    assert "checkpoint.from: protocol ps" in str(info.value)


def test_checkpoint_from_must_resolve_under_an_allowed_root(tmp_path: Path) -> None:
    from dynabatch.service.submit_policy import check_paths

    ckpt, data = tmp_path / "ckpt", tmp_path / "data"

    def problems(path: str, root: str | None) -> list[tuple[str, str]]:
        return check_paths(parse_spec({"checkpoint": {"from": path}}), [str(data)], root)

    assert problems(str(ckpt / "a" / "checkpoint.pt"), str(ckpt)) == []
    assert problems(str(data / "pretrained.pt"), None) == []  # a data root allows reading
    (problem,) = problems(str(ckpt / ".." / "secret.pt"), str(ckpt))
    assert problem[0] == "checkpoint.from" and "outside the allowed directories" in problem[1]
    (problem,) = problems("a/checkpoint.pt", str(ckpt))
    assert problem == ("checkpoint.from", "'a/checkpoint.pt' must be an absolute path")


def test_a_job_starts_from_another_jobs_checkpoint(tmp_path: Path) -> None:
    first, lin1 = _fake_job("job-a", checkpoint={"dir": str(tmp_path)})
    first.run()
    assert first.snapshot().state.value == "SUCCEEDED", first.snapshot().reason
    trained = lin1.lineage(first.membership.worker_ids[0])
    assert trained, "the first job trained"

    source = checkpoint_path(tmp_path, "job-a")
    second, lin2 = _fake_job("job-b", epochs=2, checkpoint={"from": str(source)})
    second.run()
    snap = second.snapshot()
    assert snap.state.value == "SUCCEEDED", snap.reason
    # Its weights went on from the first job's: those updates, then its own two epochs.
    lineage = lin2.lineage(second.membership.worker_ids[0])
    assert lineage[: len(trained)] == trained
    assert [e for e, _ in lineage[len(trained) :]] == sorted(e for e, _ in lineage[len(trained) :])
    assert {e for e, _ in lineage[len(trained) :]} == {0, 1}
    assert [r.epoch for r in second.history()] == [0, 1]  # its own history, from epoch 0
    assert any(f"starting from checkpoint {source}" in x.message for x in second.logs())


def test_a_checkpoint_from_that_cannot_be_loaded_fails_the_job_naming_it(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "nope" / "checkpoint.pt"
    job, _ = _fake_job("job-c", checkpoint={"from": str(missing)})
    job.run()
    snap = job.snapshot()
    assert snap.state.value == "FAILED"
    assert snap.reason is not None and "\n" not in snap.reason
    assert snap.reason.startswith(f"checkpoint.from: {missing}: no such file")


@pytest.mark.parametrize(("optimizer", "keeps"), [("sgd", True), ("adam", False)])
def test_checkpoint_from_keeps_the_optimizer_state_only_for_the_same_optimizer(
    tmp_path: Path, optimizer: str, keeps: bool
) -> None:
    save_checkpoint(tmp_path, JOB, _payload())  # written by an SGD job
    job, _ = _fake_job(
        "job-d",
        optimizer={"name": optimizer},
        checkpoint={"from": str(checkpoint_path(tmp_path, JOB))},
    )
    weights = job.checkpoints.weights
    assert weights is not None and set(weights["model"]) == set(_payload()["weights"]["model"])
    assert ("optimizer" in weights) is keeps
    (line,) = [x.message for x in job.logs() if x.message.startswith("starting from")]
    assert line.endswith(
        "weights and optimizer state"
        if keeps
        else "weights (its sgd optimizer state does not fit adam: not loaded)"
    )


@pytest.mark.parametrize(
    ("write", "needle"),
    [
        (lambda p: p.write_bytes(b"not a checkpoint at all"), "cannot read the checkpoint"),
        (lambda p: torch.save({"epoch": 1}, p), "not a dynabatch checkpoint"),
    ],
)
def test_a_damaged_checkpoint_of_its_own_fails_the_job_not_the_coordinator(
    tmp_path: Path, write: Any, needle: str
) -> None:
    """Resuming from its own checkpoint that cannot be loaded: the coordinator is built (an
    actor whose constructor raised could not report anything) and the job is FAILED with one
    line naming the file and the problem."""
    path = checkpoint_path(tmp_path, "job-e")
    path.parent.mkdir(parents=True)
    write(path)
    job, _ = _fake_job("job-e", checkpoint={"dir": str(tmp_path)})
    job.run()
    snap = job.snapshot()
    assert snap.state.value == "FAILED"
    assert snap.reason is not None and "\n" not in snap.reason
    assert snap.reason.startswith(f"checkpoint: {path}: ") and needle in snap.reason, snap.reason

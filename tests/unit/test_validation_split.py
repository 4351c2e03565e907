"""A validation split apart from the test set (issue 54, item 2): ``dataset.validation`` as a
seeded fraction of train or a named split of every kind of source; early stopping and
keep_best judge on it, the test set is scored once at the end (every epoch when asked), and
every view names the split a number comes from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dynabatch.actors.data.open import open_dataset
from dynabatch.actors.data.source import DataError, holdout_ids
from dynabatch.actors.spec import JobSpec, SpecError, parse_spec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sim.cluster_spec import parse_cluster
from dynabatch.scheduler.sim.simulator import simulate
from dynabatch.scheduler.sync.evaluation import due_for_test
from dynabatch.scheduler.tracking import epoch_scalars


def _spec(**kw: Any) -> JobSpec:
    base = dict(workers=2, global_batch=64, epochs=3, policy="affine",
                dataset={"name": "digits", "limit": 640, "validation": 0.2},
                collective_timeout_s=5, worker_wait_timeout_s=30)
    base.update(kw)
    return JobSpec.model_validate(base)


def _cluster() -> Any:
    return parse_cluster({"classes": [
        {"name": "fast", "count": 1, "a_ms": 2, "c_ms_per_sample": 0.1, "cpus": 4},
        {"name": "slow", "count": 1, "a_ms": 6, "c_ms_per_sample": 0.4}],
        "recovery": {"start_s": 0.5}})


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, 0.0])
def test_a_validation_fraction_outside_0_1_is_one_line_naming_the_field(bad: float):
    with pytest.raises(SpecError) as err:
        parse_spec({"dataset": {"name": "digits", "validation": bad}})
    assert err.value.problems == [
        f"dataset.validation: a fraction of the training samples must be in (0, 1), got {bad}"]


def test_an_unknown_split_name_is_named(tmp_path: Path):
    spec = parse_spec({"dataset": {"name": "digits", "validation": "dev"}}).dataset
    with pytest.raises(DataError, match=r"^dataset.validation: digits is in memory, with no "
                       r"split named 'dev'"):
        open_dataset(spec)
    _npy(tmp_path)
    spec = parse_spec({"dataset": {"name": "npy", "path": str(tmp_path),
                                   "validation": "dev"}}).dataset
    with pytest.raises(DataError, match=r"^dataset.validation: no split 'dev' under "):
        open_dataset(spec)
    spec = parse_spec({"dataset": {"name": "tests.unit.test_validation_split:hf_style",
                                   "validation": "dev"}}).dataset
    with pytest.raises(DataError, match=r"returned no split 'dev' \(its splits: test, train, "
                       r"validation\)"):
        open_dataset(spec)


def test_a_validation_split_that_leaves_fewer_samples_than_the_global_batch_fails_at_load():
    from dynabatch.actors.workloads import WorkloadError
    from dynabatch.scheduler.runtime.ray_runtime import open_checked

    # 100 samples: 80 without the validation split, fewer than the global batch of 90.
    spec = _spec(global_batch=90, dataset={"name": "digits", "limit": 100,
                                           "validation": 0.2})
    with pytest.raises(WorkloadError, match=r"^global_batch: global_batch 90 is larger than "
                       r"the training set \(80 samples\); dataset.validation held 20 out "
                       r"of it$"):
        open_checked(spec)


# ------------------------------------------------------------------ the split itself
def test_a_validation_fraction_is_a_seeded_part_of_train_for_every_source(tmp_path: Path):
    whole = open_dataset(parse_spec({"dataset": {"name": "digits"}}).dataset, seed=3)
    spec = parse_spec({"dataset": {"name": "digits", "validation": 0.25}}).dataset
    o = open_dataset(spec, seed=3)
    keep, held = holdout_ids(len(whole.train), 0.25, 3)
    assert len(o.validation) == len(held) == round(0.25 * len(whole.train))
    assert len(o.train) + len(o.validation) == len(whole.train)
    xa, _ = whole.train.read(np.arange(len(whole.train)))
    np.testing.assert_array_equal(o.validation.read(np.arange(len(held)))[0], xa[held])
    np.testing.assert_array_equal(o.train.read(np.arange(len(keep)))[0], xa[keep])
    assert len(o.test) == len(whole.test)  # the test set is untouched
    # The same seed holds out the same samples; another seed others.
    assert np.array_equal(holdout_ids(100, 0.2, 3)[1], holdout_ids(100, 0.2, 3)[1])
    assert not np.array_equal(holdout_ids(100, 0.2, 3)[1], holdout_ids(100, 0.2, 4)[1])
    # File-backed (npy) and map-style sources hold out the same way; workers open it by ref.
    _npy(tmp_path)
    # npy: 40 samples, the test set their last 8, a quarter of the other 32 held out.
    for ds, n_val, n_train in (({"name": "npy", "path": str(tmp_path)}, 8, 24),
                               ({"name": "tests.unit.test_validation_split:hf_style"}, 10, 30)):
        o = open_dataset(parse_spec({"dataset": {**ds, "validation": 0.25}}).dataset)
        assert (len(o.validation), len(o.train)) == (n_val, n_train)
        assert (len(o.validation_ref.open()), len(o.refs[0].open())) == (n_val, n_train)


def test_a_named_validation_split_for_files_and_hf_style_dicts(tmp_path: Path):
    _npy(tmp_path / "train", 40)
    _npy(tmp_path / "test", 12)
    _npy(tmp_path / "validation", 8)
    o = open_dataset(parse_spec({"dataset": {"name": "npy", "path": str(tmp_path),
                                             "validation": "validation"}}).dataset)
    assert (len(o.train), len(o.validation), len(o.test)) == (40, 8, 12)
    assert len(o.validation_ref.open()) == 8
    _npy(tmp_path / "elsewhere", 5)  # its own path
    o = open_dataset(parse_spec({"dataset": {
        "name": "npy", "path": str(tmp_path), "validation": str(tmp_path / "elsewhere")}}).dataset)
    assert len(o.validation) == 5
    o = open_dataset(parse_spec({"dataset": {"name": "tests.unit.test_validation_split:hf_style",
                                             "validation": "validation"}}).dataset)
    assert (len(o.train), len(o.validation), len(o.test)) == (40, 6, 9)
    assert len(o.validation_ref.open()) == 6


# ------------------------------------------------------------------ judged on validation
def test_test_set_scored_only_at_the_end_and_every_view_names_the_split():
    res = simulate(_spec(), _cluster(), real_gradients=True)
    assert res.snapshot.state == JobState.SUCCEEDED, res.snapshot.reason
    hist = res.history
    assert [r.epoch for r in hist] == [0, 1, 2]
    assert all(r.validation_metrics.get("accuracy") is not None for r in hist)
    assert all(r.validation_loss is not None for r in hist)
    # The test set once, on the final weights.
    assert [bool(r.test_metrics) for r in hist] == [False, False, True]
    assert hist[-1].test_loss is not None and hist[-1].test_accuracy is not None
    # Views: TensorBoard tags, the snapshot, the log line.
    tags = epoch_scalars(hist[0])
    assert "epoch/validation_accuracy" in tags and "epoch/validation_loss" in tags
    assert not any(t.startswith("epoch/test_") for t in tags)
    assert "epoch/test_accuracy" in epoch_scalars(hist[-1])
    assert res.snapshot.validation_metrics == hist[-1].validation_metrics
    assert res.snapshot.test_metrics == hist[-1].test_metrics
    lines = [x.message for x in res.coordinator.logs()] if hasattr(res, "coordinator") else []
    assert not lines or any("validation accuracy" in m for m in lines)


def test_test_every_epoch_when_asked():
    res = simulate(_spec(evaluation={"test_every_epoch": True}), _cluster(),
                   real_gradients=True)
    assert res.snapshot.state == JobState.SUCCEEDED, res.snapshot.reason
    assert all(r.test_metrics and r.validation_metrics for r in res.history)


def test_without_validation_the_test_set_is_judged_every_epoch_as_today():
    res = simulate(_spec(dataset={"name": "digits", "limit": 640}), _cluster(),
                   real_gradients=True)
    assert all(r.test_metrics and not r.validation_metrics for r in res.history)
    tags = epoch_scalars(res.history[0])
    assert "epoch/test_accuracy" in tags and "epoch/validation_accuracy" not in tags


def test_early_stopping_judges_on_validation_and_the_test_set_scores_the_stop():
    # min_delta 1: accuracy never improves by a whole 1, so the job stops after epoch 1.
    spec = _spec(epochs=5, early_stopping={"metric": "accuracy", "mode": "max",
                                           "patience": 1, "min_delta": 1.0})
    res = simulate(spec, _cluster(), real_gradients=True)
    assert res.snapshot.state == JobState.SUCCEEDED, res.snapshot.reason
    hist = res.history
    assert [r.epoch for r in hist] == [0, 1]
    assert "accuracy has not improved on epoch 0's " in res.snapshot.reason
    assert str(round(hist[0].validation_metrics["accuracy"], 4))[:5] in res.snapshot.reason
    assert [bool(r.test_metrics) for r in hist] == [False, True]


def test_test_due():
    assert not due_for_test(validation=False, every_epoch=True, last=True, stopped=True)
    assert due_for_test(validation=True, every_epoch=False, last=True, stopped=False)
    assert due_for_test(validation=True, every_epoch=False, last=False, stopped=True)
    assert not due_for_test(validation=True, every_epoch=False, last=False, stopped=False)
    assert due_for_test(validation=True, every_epoch=True, last=False, stopped=False)


# ------------------------------------------------------------------ helpers
def _npy(path: Path, n: int = 40) -> None:
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(n)
    np.save(path / "x0.npy", rng.standard_normal((n, 4)).astype(np.float32))
    np.save(path / "y0.npy", (np.arange(n) % 3).astype(np.int64))


class _Pairs:
    """A map-style dataset of ``n`` (input, label) pairs."""

    num_classes = 3

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.full(4, i, dtype=np.float32), i % 3


def hf_style() -> dict[str, _Pairs]:
    """An HF-style dict of splits, as a DatasetDict gives them."""
    return {"train": _Pairs(40), "validation": _Pairs(6), "test": _Pairs(9)}

"""Sources read by position (dynabatch.actors.data): Parquet, .npy, image folders,
map-style datasets; the block order, augmentation keys and the loader; bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dynabatch.actors.data.loader import Loader
from dynabatch.actors.data.open import DataRef, materialise, open_dataset, open_source
from dynabatch.actors.data.order import block_order
from dynabatch.actors.data.source import DataError, augment_keys
from dynabatch.actors.spec.sections import DatasetSpec
from dynabatch.actors.workloads import WorkloadError

from bench.data_files import write_imagefolder, write_npy, write_parquet

P = "tests.unit.data_plugins"


def _images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), (np.arange(n) % 10)


@pytest.fixture
def parquet_dir(tmp_path):
    x, y = _images(300)
    xt, yt = _images(50, 1)
    write_parquet(str(tmp_path / "train"), x, y, row_group_size=32, rows_per_file=128)
    write_parquet(str(tmp_path / "test"), xt, yt, row_group_size=32)
    return tmp_path, x, y


def test_parquet_reads_rows_by_position_across_files(parquet_dir):
    path, x, y = parquet_dir
    o = open_dataset(DatasetSpec(name="parquet", path=str(path),
                                 options={"shape": [1, 28, 28]}))
    assert (len(o.train), len(o.test), o.meta.num_classes) == (300, 50, 10)
    assert o.meta.sample_shape == (1, 28, 28) and o.train.block == 32
    ids = np.array([299, 0, 130, 127, 128, 5])
    xb, yb = o.train.read(ids)
    np.testing.assert_allclose(xb[:, 0], x[ids] / 255.0, atol=1e-6)
    np.testing.assert_array_equal(yb, y[ids])
    assert xb.dtype == np.float32 and yb.dtype == np.int64


def test_parquet_uri_and_single_directory_split(tmp_path):
    x, y = _images(100)
    write_parquet(str(tmp_path / "all"), x, y, row_group_size=16)
    spec = DatasetSpec(name="parquet", path=f"file://{tmp_path}/all", test_fraction=0.2)
    o = open_dataset(spec)
    assert (len(o.train), len(o.test)) == (80, 20)
    np.testing.assert_array_equal(o.test.read(np.arange(20))[1], y[80:])
    np.testing.assert_array_equal(DataRef(spec, 0, "train").open().read(np.array([3]))[1],
                                  y[[3]])


def test_parquet_missing_column_names_the_columns_that_exist(parquet_dir):
    path, _, _ = parquet_dir
    with pytest.raises(DataError, match=r"dataset.options.x: no column 'pixels' in .*"
                                        r"its columns: image, label"):
        open_dataset(DatasetSpec(name="parquet", path=str(path), options={"x": "pixels"}))


def test_the_early_check_and_the_job_refuse_an_unknown_option_in_one_line(parquet_dir):
    """One table per file kind: the check before the job starts (no file opened) and the
    job's own opening of the files say the same."""
    from dynabatch.actors.data.open import check_file_options

    path, _, _ = parquet_dir
    spec = DatasetSpec(name="parquet", path=str(path), options={"shape": [1, 28, 28],
                                                                "colour": "red"})
    line = ("dataset.options: unknown option 'colour' for parquet (allowed: cache_groups, "
            "num_classes, scale, shape, targets, x, y)")
    with pytest.raises(DataError) as early:
        check_file_options(DatasetSpec(name="parquet", path="/not/there", options=spec.options))
    with pytest.raises(DataError) as opened:
        DataRef(spec, 0, "train").open()
    assert str(early.value) == str(opened.value) == line
    check_file_options(spec.model_copy(update={"options": {"shape": [1, 28, 28]}}))


def test_corrupt_parquet_file_is_named(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad.parquet: not a readable Parquet file"):
        open_dataset(DatasetSpec(name="parquet", path=str(tmp_path)))


def test_npy_shards_are_memory_mapped(tmp_path):
    x, y = _images(90)
    write_npy(str(tmp_path / "train"), x, y, shards=3)
    write_npy(str(tmp_path / "test"), x[:10], y[:10], shards=1)
    o = open_dataset(DatasetSpec(name="npy", path=str(tmp_path)))
    src = o.train
    assert all(isinstance(a, np.memmap) for a in src.x)
    ids = np.array([89, 0, 31, 30, 60])
    xb, yb = src.read(ids)
    np.testing.assert_allclose(xb, x[ids] / 255.0, atol=1e-6)
    np.testing.assert_array_equal(yb, y[ids])


def test_imagefolder_transforms_are_seeded_by_key(tmp_path):
    x, y = _images(20)
    write_imagefolder(str(tmp_path / "train"), x, y % 3)
    write_imagefolder(str(tmp_path / "test"), x[:6], y[:6] % 3)
    spec = DatasetSpec(name="imagefolder", path=str(tmp_path), options={"transforms": [
        {"resize": 32}, {"random_crop": 28, "padding": 2}, "flip", "normalize"]})
    o = open_dataset(spec)
    assert o.meta.sample_shape == (1, 28, 28) and o.meta.num_classes == 3
    keys = augment_keys(7, 1, np.arange(4))
    a, la = o.train.read(np.arange(4), keys)
    b, _ = o.train.read(np.arange(4), keys)
    c, _ = o.train.read(np.arange(4), augment_keys(7, 2, np.arange(4)))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert la.tolist() == [0, 0, 0, 0]  # ids follow the sorted class folders
    assert o.test.read(np.arange(2))[0].shape == (2, 1, 28, 28)


def test_corrupt_image_names_the_file_and_the_position(tmp_path):
    x, y = _images(8)
    write_imagefolder(str(tmp_path), x, y % 2)
    bad = sorted((tmp_path / "1").iterdir())[0]
    bad.write_bytes(b"garbage")
    src = open_source(DatasetSpec(name="imagefolder", path=str(tmp_path), test_fraction=0.2),
                      0, "train")
    loader = Loader(src, torch.device("cpu"), seed=0)
    loader.set_order("k", np.arange(len(src)), 0)
    with pytest.raises(DataError, match=rf"dataset.path: sample \d+ \(epoch 0, order position "
                                        rf"\d+\): .*{bad.name}: cannot decode image"):
        loader.gather(0, len(src))


def test_map_style_dataset_seeded_augmentation():
    spec = DatasetSpec(name=f"{P}:noisy", options={"n": 40})
    o = open_dataset(spec)
    assert o.arrays is None and o.meta.num_classes == 4 and o.meta.sample_shape == (8,)
    keys = augment_keys(3, 0, np.arange(5))
    a = o.train.read(np.arange(5), keys)[0]
    b = DataRef(spec, 0, "train").open().read(np.arange(5), keys)[0]  # another worker
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, o.train.read(np.arange(5), augment_keys(3, 1, np.arange(5)))[0])
    assert len(o.train) + len(o.test) == 40


def test_map_style_pair_and_regression_targets():
    o = open_dataset(DatasetSpec(name=f"{P}:noisy_split"))
    assert (len(o.train), len(o.test)) == (64, 16)
    r = open_dataset(DatasetSpec(name=f"{P}:regression"))
    assert r.meta.targets == "values" and r.train.read(np.arange(2))[1].dtype == np.float32


def _loader_for(spec: DatasetSpec) -> Loader:
    src = open_source(spec, 0, "train")
    loader = Loader(src, torch.device("cpu"), seed=0)
    loader.set_order("k", np.arange(len(src)), 0)
    return loader


def test_getitem_error_names_the_position_the_first_line_and_the_field():
    from dynabatch.actors.data.source import split_ids

    train, _ = split_ids(64, 0.2, 0)
    loader = _loader_for(DatasetSpec(name=f"{P}:noisy", options={"bad_at": int(train[9])},
                                     test_fraction=0.2))
    loader.plan([(0, 16)])
    with pytest.raises(DataError) as info:
        loader.gather(0, 16)
    msg = str(info.value)
    assert msg.startswith("dataset.name: sample 9 (epoch 0, order position 9)")
    assert f"__getitem__ raised ValueError: cannot decode record {train[9]}" in msg
    assert "second line" not in msg


def test_sample_of_another_shape_names_the_position_and_both_shapes():
    loader = _loader_for(DatasetSpec(name=f"{P}:noisy", options={"odd_shape_at": 3}))
    with pytest.raises(DataError, match=r"sample 3 .*input has shape \(9,\), but the first "
                                        r"sample has \(8,\)"):
        loader.gather(0, 8)


def test_regression_tuple_message_points_to_the_fix():
    with pytest.raises(WorkloadError, match=r'targets=\\?"values"'):
        from dynabatch.actors.workloads.datasets import user_arrays

        user_arrays(DatasetSpec(name=f"{P}:noisy"),
                    (np.zeros((4, 2)), np.array(["a", "b", "c", "d"], dtype=object),
                     np.zeros((2, 2)), np.zeros(2)), 0)


def test_materialise_for_the_simulator(parquet_dir):
    path, _x, _y = parquet_dir
    ds = materialise(DatasetSpec(name="parquet", path=str(path)))
    assert ds.x_train.shape == (300, 784) and ds.num_classes == 10


def test_block_order_is_a_permutation_with_locality():
    o = block_order(1, 0, 1000, 32)
    assert sorted(o.tolist()) == list(range(1000))
    assert np.array_equal(o, block_order(1, 0, 1000, 32))
    assert not np.array_equal(o, block_order(1, 1, 1000, 32))
    blocks_per_step = [len(set((o[s:s + 64] // 32).tolist())) for s in range(0, 1000, 64)]
    assert max(blocks_per_step) <= 16 + 1


def test_loader_reads_planned_shares_ahead_and_replans(parquet_dir):
    path, x, y = parquet_dir
    src = open_source(DatasetSpec(name="parquet", path=str(path)), 0, "train")
    loader = Loader(src, torch.device("cpu"), seed=0, depth=2)
    order = np.random.default_rng(0).permutation(len(src))
    loader.set_order("e0", order, 0)
    loader.plan([(0, 10), (64, 74), (128, 140)])
    _xb, yb = loader.gather(0, 5)
    xb2, _ = loader.gather(5, 10)  # a micro-batch of the same share
    np.testing.assert_array_equal(yb.numpy(), y[order[:5]])
    np.testing.assert_allclose(xb2.numpy().reshape(5, -1), x[order[5:10]].reshape(5, -1) / 255,
                               atol=1e-6)
    loader.plan([(200, 210)])  # a re-plan: only what is fetched next changes
    assert list(loader._inflight) == [(200, 210)]
    np.testing.assert_array_equal(loader.gather(200, 210)[1].numpy(), y[order[200:210]])
    np.testing.assert_array_equal(loader.gather(3, 7)[1].numpy(), y[order[3:7]])  # unplanned
    wait, rate = loader.take_stats()
    assert wait >= 0 and rate is not None and rate > 0
    loader.close()


def test_augment_keys_differ_by_seed_epoch_and_position():
    k = augment_keys(1, 0, np.arange(1000))
    assert len(set(k.tolist())) == 1000 and (k >= 0).all()
    assert not np.array_equal(k, augment_keys(2, 0, np.arange(1000)))
    assert not np.array_equal(k, augment_keys(1, 1, np.arange(1000)))


def test_data_roots_confine_uris_by_prefix():
    from dynabatch.service.submit_policy import path_problem

    roots = ["s3://bucket/data", "/srv/data"]
    assert path_problem("s3://bucket/data/mnist", roots, "dataset paths") is None
    assert "outside" in path_problem("s3://bucket/data2", roots, "dataset paths")
    assert "'..'" in path_problem("s3://bucket/data/../x", roots, "dataset paths")
    assert path_problem("file:///srv/data/x", roots, "dataset paths") is None
    assert path_problem("/srv/data/x", roots, "dataset paths") is None
    assert "outside" in path_problem("gs://bucket/data/x", roots, "dataset paths")

"""Datasets: the IDX and CIFAR formats byte for byte, the built-ins, and user loaders."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from dynabatch.actors.spec import DatasetSpec
from dynabatch.actors.workloads import WorkloadError
from dynabatch.actors.workloads.datasets import DatasetArrays, load_dataset
from dynabatch.actors.workloads.formats import FormatError
from dynabatch.actors.workloads.formats.cifar import read_cifar10, read_cifar10_meta
from dynabatch.actors.workloads.formats.idx import MNIST_FILES, decode_idx
from dynabatch.actors.workloads.images import channel_stats, generate_mnist
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.formats import (
    CIFAR10_LABELS,
    encode_idx,
    read_idx,
    write_cifar10,
    write_cifar_batch,
    write_idx,
    write_mnist,
)

PLUGINS = "tests.unit.workload_plugins"


def _mnist_arrays(
    n_train: int = 20, n_test: int = 10, seed: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_train, dtype=np.uint8),
        rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_test, dtype=np.uint8),
    )


def _mnist_spec(path: Path, **kw: object) -> DatasetSpec:
    return DatasetSpec(name="mnist", path=str(path), **kw)


# --------------------------------------------------------------------------------------------
# IDX format


def test_idx_bytes_are_exactly_the_published_layout() -> None:
    arr = np.arange(6, dtype=np.uint8).reshape(2, 3)
    assert encode_idx(arr) == b"\x00\x00\x08\x02" + b"\x00\x00\x00\x02\x00\x00\x00\x03" + bytes(
        range(6)
    )
    # Multi-byte types are big-endian whatever the array's own byte order.
    assert encode_idx(np.array([1, -2], dtype="<i2"))[-4:] == b"\x00\x01\xff\xfe"
    assert encode_idx(np.zeros((5, 28, 28), np.uint8))[:8] == b"\x00\x00\x08\x03\x00\x00\x00\x05"


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "float32", "float64"])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_roundtrip(tmp_path: Path, dtype: str, suffix: str) -> None:
    arr = (np.arange(2 * 3 * 4) - 5).astype(dtype).reshape(2, 3, 4)
    path = write_idx(tmp_path / f"a.idx{suffix}", arr)
    if suffix:
        assert path.read_bytes()[:2] == b"\x1f\x8b"
    back = read_idx(path)
    assert back.dtype == np.dtype(dtype) and back.dtype.isnative
    np.testing.assert_array_equal(back, arr)


def test_idx_gzip_is_detected_from_content_not_name(tmp_path: Path) -> None:
    arr = np.arange(10, dtype=np.uint8)
    (tmp_path / "labels").write_bytes(gzip.compress(encode_idx(arr)))
    np.testing.assert_array_equal(read_idx(tmp_path / "labels"), arr)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x00\x00", "truncated: 2 bytes"),
        (b"\x12\x34\x08\x01\x00\x00\x00\x01\x00", "bad magic 0x12340801: not an IDX file"),
        (b"\x00\x00\x07\x01\x00\x00\x00\x01\x00", "unknown IDX type 0x07"),
        (b"\x00\x00\x08\x00", "0 dimensions"),
        (b"\x00\x00\x08\x03\x00\x00\x00\x01", "truncated header"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x04\x01\x02", "truncated: header declares shape (4,)"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x01\x01\x02", "1 unexpected bytes after the data"),
    ],
)
def test_idx_rejects_malformed_bytes(data: bytes, message: str) -> None:
    with pytest.raises(FormatError, match=r"^f\.idx: ") as info:
        decode_idx(data, source="f.idx")
    assert message in str(info.value)


def test_idx_expected_magic() -> None:
    data = encode_idx(np.zeros((2, 28, 28), np.int8))
    with pytest.raises(FormatError, match=r"bad magic 0x00000903 \(expected 0x00000803: unsigned"):
        decode_idx(data, magic=0x00000803)


def test_idx_corrupt_gzip(tmp_path: Path) -> None:
    blob = gzip.compress(encode_idx(np.zeros((50, 28, 28), np.uint8)))
    (tmp_path / "x.gz").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(WorkloadError, match="corrupt or truncated gzip"):
        read_idx(tmp_path / "x.gz")


def test_idx_writer_rejects_unstorable_dtype(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot store dtype"):
        write_idx(tmp_path / "x", np.zeros(3, dtype=np.int64))


# --------------------------------------------------------------------------------------------
# MNIST from files


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_files_load(tmp_path: Path, gz: bool) -> None:
    xtr, ytr, xte, yte = _mnist_arrays()
    paths = write_mnist(tmp_path, xtr, ytr, xte, yte, gz=gz)
    assert {p.name for p in paths.values()} == {
        n + (".gz" if gz else "") for n in MNIST_FILES.values()
    }
    data = load_dataset(_mnist_spec(tmp_path))
    assert data.x_train.shape == (20, 1, 28, 28) and data.x_test.shape == (10, 1, 28, 28)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10
    np.testing.assert_allclose(data.x_train[:, 0], xtr / 255.0, atol=1e-7)
    np.testing.assert_allclose(data.x_test[:, 0], xte / 255.0, atol=1e-7)
    np.testing.assert_array_equal(data.y_train, ytr)
    np.testing.assert_array_equal(data.y_test, yte)
    assert data.x_train.min() >= 0.0 and data.x_train.max() <= 1.0


def test_mnist_files_written_by_hand_with_mixed_compression(tmp_path: Path) -> None:
    xtr, ytr, xte, yte = _mnist_arrays(7, 3)
    # The exact header a real train-images file has, written without the library's writer.
    header = struct.pack(">IIII", 0x00000803, 7, 28, 28)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(header + xtr.tobytes())
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", ytr)
    # Some mirrors use dots in the names.
    write_idx(tmp_path / "t10k-images.idx3-ubyte", xte)
    write_idx(tmp_path / "t10k-labels.idx1-ubyte", yte)
    data = load_dataset(_mnist_spec(tmp_path))
    np.testing.assert_array_equal(np.round(data.x_train[:, 0] * 255), xtr)
    np.testing.assert_array_equal(data.y_test, yte)


def test_mnist_torchvision_layout(tmp_path: Path) -> None:
    write_mnist(tmp_path / "MNIST" / "raw", *_mnist_arrays(4, 2), gz=True)
    assert load_dataset(_mnist_spec(tmp_path)).x_train.shape == (4, 1, 28, 28)


def test_mnist_bad_magic_names_the_file(tmp_path: Path) -> None:
    write_mnist(tmp_path, *_mnist_arrays())
    f = tmp_path / "train-labels-idx1-ubyte"
    f.write_bytes(b"\x00\x00\x08\x03" + f.read_bytes()[4:])
    with pytest.raises(WorkloadError) as info:
        load_dataset(_mnist_spec(tmp_path))
    msg = str(info.value)
    assert msg.startswith(f"dataset.path: {f}: bad magic 0x00000803 (expected 0x00000801")
    assert "\n" not in msg


def test_mnist_truncated_images(tmp_path: Path) -> None:
    write_mnist(tmp_path, *_mnist_arrays())
    f = tmp_path / "t10k-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(WorkloadError, match=r"t10k-images-idx3-ubyte: truncated: header declares"):
        load_dataset(_mnist_spec(tmp_path))


def test_mnist_count_mismatch(tmp_path: Path) -> None:
    xtr, ytr, xte, yte = _mnist_arrays()
    write_mnist(tmp_path, xtr, ytr[:-1], xte, yte)
    with pytest.raises(
        WorkloadError, match=r"19 labels but .*train-images-idx3-ubyte has 20 images"
    ):
        load_dataset(_mnist_spec(tmp_path))


def test_mnist_label_out_of_range(tmp_path: Path) -> None:
    xtr, ytr, xte, yte = _mnist_arrays()
    ytr[3] = 12
    write_mnist(tmp_path, xtr, ytr, xte, yte)
    with pytest.raises(WorkloadError, match=r"label 12 is out of range 0\.\.9"):
        load_dataset(_mnist_spec(tmp_path))


def test_mnist_missing_file_and_bad_directory(tmp_path: Path) -> None:
    write_mnist(tmp_path, *_mnist_arrays())
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(WorkloadError, match=r"^dataset.path: .*no t10k-labels-idx1-ubyte"):
        load_dataset(_mnist_spec(tmp_path))
    with pytest.raises(WorkloadError, match="not a directory"):
        load_dataset(_mnist_spec(tmp_path / "nope"))


def test_mnist_generation_options_with_path_warn(tmp_path: Path) -> None:
    write_mnist(tmp_path, *_mnist_arrays())
    with pytest.warns(UserWarning, match="ignored when dataset.path is set"):
        load_dataset(_mnist_spec(tmp_path, options={"n_train": 5}))


# --------------------------------------------------------------------------------------------
# Generated MNIST


def test_generated_mnist_is_deterministic_and_well_formed() -> None:
    spec = DatasetSpec(name="mnist", options={"n_train": 300, "n_test": 100})
    a, b = load_dataset(spec, seed=3), load_dataset(spec, seed=3)
    assert a.x_train.shape == (300, 1, 28, 28) and a.x_test.shape == (100, 1, 28, 28)
    assert a.x_train.dtype == np.float32 and a.x_train.min() >= 0.0 and a.x_train.max() <= 1.0
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert np.bincount(a.y_train, minlength=10).tolist() == [30] * 10
    c = load_dataset(spec, seed=4)
    assert not np.array_equal(a.x_train, c.x_train)


def test_generated_mnist_test_set_does_not_depend_on_train_size() -> None:
    _, _, xa, ya = generate_mnist(50, 20, seed=0)
    _, _, xb, yb = generate_mnist(80, 20, seed=0)
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)


def test_generated_mnist_matches_written_files(tmp_path: Path) -> None:
    # The generator's output, written as files, loads to exactly what path=None gives.
    write_mnist(tmp_path, *generate_mnist(40, 20, seed=5), gz=True)
    from_files = load_dataset(_mnist_spec(tmp_path), seed=5)
    generated = load_dataset(
        DatasetSpec(name="mnist", options={"n_train": 40, "n_test": 20}), seed=5
    )
    np.testing.assert_array_equal(from_files.x_train, generated.x_train)
    np.testing.assert_array_equal(from_files.y_test, generated.y_test)


def test_generated_mnist_is_learnable() -> None:
    d = load_dataset(DatasetSpec(name="mnist", options={"n_train": 1000, "n_test": 400}), seed=0)
    xtr, xte = d.x_train.reshape(len(d.x_train), -1), d.x_test.reshape(len(d.x_test), -1)
    centroids = np.stack([xtr[d.y_train == c].mean(axis=0) for c in range(10)])
    dist = ((xte[:, None, :] - centroids[None]) ** 2).sum(axis=-1)
    accuracy = float((dist.argmin(axis=1) == d.y_test).mean())
    assert accuracy > 0.5  # chance is 0.1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n_train": 0}, r"dataset.options.n_train: must be an integer from 1"),
        ({"n_test": True}, r"dataset.options.n_test: must be an integer"),
        (
            {"n_trian": 5},
            r"dataset.options: unknown option 'n_trian' for mnist \(allowed: n_test, n_train\)",
        ),
    ],
)
def test_generated_mnist_bad_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_dataset(DatasetSpec(name="mnist", options=options))


# --------------------------------------------------------------------------------------------
# CIFAR-10


def _cifar_arrays(
    n_train: int = 23, n_test: int = 7
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    return (
        rng.integers(0, 256, (n_train, 3, 32, 32), dtype=np.uint8),
        rng.integers(0, 10, n_train),
        rng.integers(0, 256, (n_test, 3, 32, 32), dtype=np.uint8),
        rng.integers(0, 10, n_test),
    )


def test_cifar_batch_is_a_bytes_keyed_pickle(tmp_path: Path) -> None:
    x = np.zeros((2, 3, 32, 32), np.uint8)
    x[:, 0], x[:, 1], x[:, 2] = 10, 20, 30
    write_cifar_batch(tmp_path / "data_batch_1", x, [3, 4], "training batch 1 of 5")
    with (tmp_path / "data_batch_1").open("rb") as f:
        batch = pickle.load(f, encoding="bytes")
    assert set(batch) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape == (2, 3072)
    assert batch[b"labels"] == [3, 4] and batch[b"batch_label"] == b"training batch 1 of 5"
    # R, G and B planes of 1024 bytes each.
    row = batch[b"data"][0]
    assert (row[:1024] == 10).all() and (row[1024:2048] == 20).all() and (row[2048:] == 30).all()


@pytest.mark.parametrize("nested", [True, False])
def test_cifar_roundtrip(tmp_path: Path, nested: bool) -> None:
    xtr, ytr, xte, yte = _cifar_arrays()
    write_cifar10(tmp_path / "cifar-10-batches-py" if nested else tmp_path, xtr, ytr, xte, yte)
    raw = read_cifar10(tmp_path)
    np.testing.assert_array_equal(raw[0], xtr)
    np.testing.assert_array_equal(raw[3], yte)
    assert read_cifar10_meta(tmp_path) == list(CIFAR10_LABELS)

    data = load_dataset(DatasetSpec(name="cifar10", path=str(tmp_path)))
    assert data.x_train.shape == (23, 3, 32, 32) and data.x_test.shape == (7, 3, 32, 32)
    assert data.input_shape == (3, 32, 32) and data.num_classes == 10
    np.testing.assert_array_equal(data.y_train, ytr)
    # Per-channel standardisation with training-set statistics, undone exactly.
    mean, std = channel_stats(xtr)
    np.testing.assert_allclose(data.x_train.mean(axis=(0, 2, 3)), 0.0, atol=1e-4)
    np.testing.assert_allclose(data.x_train.std(axis=(0, 2, 3)), 1.0, atol=1e-4)
    restored = data.x_test * std[None, :, None, None] + mean[None, :, None, None]
    np.testing.assert_allclose(restored, xte, atol=1e-3)


def test_cifar_channel_stats_are_exact() -> None:
    x = np.random.default_rng(0).integers(0, 256, (5, 3, 4, 4), dtype=np.uint8)
    mean, std = channel_stats(x)
    np.testing.assert_allclose(mean, x.astype(float).mean(axis=(0, 2, 3)))
    np.testing.assert_allclose(std, x.astype(float).std(axis=(0, 2, 3)))


def _cifar_dir(tmp_path: Path) -> Path:
    d = tmp_path / "cifar-10-batches-py"
    write_cifar10(d, *_cifar_arrays())
    return d


def test_cifar_missing_batch(tmp_path: Path) -> None:
    (_cifar_dir(tmp_path) / "data_batch_4").unlink()
    with pytest.raises(
        WorkloadError, match=r"^dataset.path: .*missing CIFAR-10 batch file\(s\): data_batch_4"
    ):
        load_dataset(DatasetSpec(name="cifar10", path=str(tmp_path)))


def test_cifar_label_count_mismatch(tmp_path: Path) -> None:
    d = _cifar_dir(tmp_path)
    write_cifar_batch(d / "test_batch", np.zeros((4, 3072), np.uint8), [1, 2, 3])
    with pytest.raises(WorkloadError, match="test_batch: 3 labels but 4 images"):
        load_dataset(DatasetSpec(name="cifar10", path=str(tmp_path)))


def test_cifar_wrong_data_shape(tmp_path: Path) -> None:
    d = _cifar_dir(tmp_path)
    with (d / "data_batch_2").open("wb") as f:
        pickle.dump({b"data": np.zeros((2, 1000), np.uint8), b"labels": [0, 1]}, f, protocol=2)
    with pytest.raises(
        WorkloadError, match=r"data_batch_2: b'data' must be uint8 of shape \(N, 3072\)"
    ):
        load_dataset(DatasetSpec(name="cifar10", path=str(tmp_path)))


def test_cifar_truncated_and_foreign_pickles(tmp_path: Path) -> None:
    d = _cifar_dir(tmp_path)
    blob = (d / "data_batch_1").read_bytes()
    (d / "data_batch_1").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(WorkloadError, match="data_batch_1: not a CIFAR-10 python batch"):
        load_dataset(DatasetSpec(name="cifar10", path=str(tmp_path)))
    # A pickle that would call a function on load is refused, not executed.
    with (d / "data_batch_1").open("wb") as f:
        pickle.dump({b"data": Path("/etc/passwd")}, f, protocol=2)
    with pytest.raises(WorkloadError, match="refusing to load pathlib"):
        load_dataset(DatasetSpec(name="cifar10", path=str(tmp_path)))


def test_cifar_needs_a_path() -> None:
    with pytest.raises(WorkloadError, match=r"^dataset\.path: cifar10 needs"):
        load_dataset(DatasetSpec(name="cifar10"))


# --------------------------------------------------------------------------------------------
# digits and synthetic


def test_digits_split() -> None:
    d = load_dataset(DatasetSpec(name="digits", test_fraction=0.25), seed=0)
    assert len(d.x_train) + len(d.x_test) == 1797
    assert len(d.x_test) == 450
    assert d.input_shape == (64,) and d.num_classes == 10
    assert d.x_train.min() == 0.0 and d.x_train.max() == 1.0
    # Stratified: every digit is in the test set in about its share.
    assert np.bincount(d.y_test, minlength=10).min() >= 40
    again = load_dataset(DatasetSpec(name="digits", test_fraction=0.25), seed=0)
    np.testing.assert_array_equal(d.y_train, again.y_train)
    other = load_dataset(DatasetSpec(name="digits", test_fraction=0.25), seed=1)
    assert not np.array_equal(d.y_train, other.y_train)


def test_digits_are_scikit_learns_rows() -> None:
    from dynabatch.actors.workloads.datasets import _digits_arrays
    from sklearn.datasets import load_digits

    x, y = _digits_arrays()
    ref_x, ref_y = load_digits(return_X_y=True)
    np.testing.assert_array_equal(x, ref_x)
    np.testing.assert_array_equal(y, ref_y)


def test_loading_the_built_in_tables_imports_no_scikit_learn() -> None:
    """Every job's coordinator loads its dataset: scikit-learn's import cost it about a second
    of CPU, for a file read and a split numpy does alone."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from dynabatch.actors.spec import DatasetSpec\n"
        "from dynabatch.actors.workloads.datasets import load_dataset\n"
        "for name in ('digits', 'synthetic'):\n"
        "    load_dataset(DatasetSpec(name=name), seed=0)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@settings(max_examples=60)
@given(
    counts=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    fraction=st.floats(0.05, 0.95),
    seed=st.integers(0, 2**31),
)
def test_split_is_a_seeded_partition_stratified_when_it_can_be(counts, fraction, seed) -> None:
    from dynabatch.actors.workloads.datasets import _split

    y = np.repeat(np.arange(len(counts)), counts)
    n = len(y)
    if n < 2:
        return
    x = np.arange(n)  # a sample's features name it, so the parts can be traced back
    x_tr, y_tr, x_te, y_te = _split(x, y, fraction, seed)
    n_test = min(max(1, int(np.ceil(n * fraction))), n - 1)
    assert len(x_te) == n_test and len(x_tr) == n - n_test
    assert sorted(np.concatenate([x_tr, x_te]).tolist()) == list(range(n))  # each once
    np.testing.assert_array_equal(y[x_tr], y_tr)
    np.testing.assert_array_equal(y[x_te], y_te)
    if min(counts) >= 2 and min(n_test, n - n_test) >= len(counts):
        share = np.asarray(counts) * n_test / n
        got = np.bincount(y_te, minlength=len(counts))
        assert np.all(got >= np.floor(share)) and np.all(got <= np.ceil(share)), (got, share)
    again = _split(x, y, fraction, seed)
    np.testing.assert_array_equal(again[0], x_tr)
    np.testing.assert_array_equal(again[2], x_te)


def test_digits_warns_about_path() -> None:
    with pytest.warns(UserWarning, match="dataset.path is ignored by the digits dataset"):
        load_dataset(DatasetSpec(name="digits", path="/data"))


def test_synthetic_deterministic_shapes_and_balance() -> None:
    spec = DatasetSpec(
        name="synthetic",
        test_fraction=0.25,
        options={"n_samples": 400, "n_features": 6, "n_classes": 3},
    )
    a, b = load_dataset(spec, seed=7), load_dataset(spec, seed=7)
    assert a.x_train.shape == (300, 6) and a.x_test.shape == (100, 6) and a.num_classes == 3
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert np.bincount(a.y_train, minlength=3).min() > 50
    assert not np.array_equal(a.x_train, load_dataset(spec, seed=8).x_train)


def test_synthetic_defaults_and_learnable() -> None:
    from sklearn.linear_model import LogisticRegression

    d = load_dataset(DatasetSpec(name="synthetic"), seed=0)
    assert len(d.x_train) + len(d.x_test) == 2048 and d.input_shape == (32,)
    assert d.num_classes == 4
    score = LogisticRegression(max_iter=300).fit(d.x_train, d.y_train).score(d.x_test, d.y_test)
    assert score > 0.6  # chance is about 0.25


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n_classes": 1}, "dataset.options.n_classes: must be an integer from 2"),
        ({"n_samples": 10, "n_classes": 8}, "n_samples: 10 is too few for 8 classes"),
        ({"classes": 3}, "unknown option 'classes' for synthetic"),
        ({"n_features": 2.5}, "dataset.options.n_features"),
    ],
)
def test_synthetic_bad_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_dataset(DatasetSpec(name="synthetic", options=options))


def test_limit_is_a_seeded_subset() -> None:
    full = load_dataset(DatasetSpec(name="digits"), seed=0)
    a = load_dataset(DatasetSpec(name="digits", limit=100), seed=0)
    b = load_dataset(DatasetSpec(name="digits", limit=100), seed=0)
    assert len(a.x_train) == 100 and len(a.x_test) == len(full.x_test)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    # Every sample of the subset is a training sample of the full set, in the same order.
    rows = {r.tobytes(): i for i, r in enumerate(full.x_train)}
    idx = [rows[r.tobytes()] for r in a.x_train]
    assert idx == sorted(idx)
    assert len(load_dataset(DatasetSpec(name="digits", limit=10**6)).x_train) == len(full.x_train)


# --------------------------------------------------------------------------------------------
# DatasetArrays and user loaders


def test_dataset_arrays_converts_and_validates() -> None:
    x = np.zeros((4, 2, 3), dtype=np.float64)
    d = DatasetArrays("t", x, [0, 1, 2, 1], x[:2], np.array([1.0, 0.0]), 3)
    assert d.x_train.dtype == np.float32 and d.y_test.dtype == np.int64
    assert d.input_shape == (2, 3)
    with pytest.raises(WorkloadError, match=r"y_train has label 3, outside 0\.\.2"):
        DatasetArrays("t", x, [0, 1, 3, 1], x, [0, 0, 0, 0], 3)
    with pytest.raises(WorkloadError, match="x_train contains NaN"):
        DatasetArrays("t", np.full((1, 2), np.nan), [0], x[:1, 0], [0], 2)
    with pytest.raises(
        WorkloadError, match=r"x_test samples have shape \(2,\) but x_train .* \(3,\)"
    ):
        DatasetArrays("t", x[:, 0], [0, 1, 1, 1], x[:, :, 0], [0, 1, 1, 1], 2)
    with pytest.raises(WorkloadError, match="y_test must hold integer class labels"):
        DatasetArrays("t", x, [0, 1, 1, 1], x, [0.5, 1, 1, 1], 2)


def test_user_loader_returning_dataset_arrays() -> None:
    d = load_dataset(DatasetSpec(name=f"{PLUGINS}:arrays_loader", options={"n": 60, "classes": 4}))
    assert d.name == "plugin" and d.num_classes == 4 and d.x_train.shape == (30, 5)
    limited = load_dataset(DatasetSpec(name=f"{PLUGINS}:arrays_loader", limit=7))
    assert len(limited.x_train) == 7


def test_dataset_limit_applies_to_a_user_loaders_arrays_in_the_job() -> None:
    # The sync job opens its data with open_dataset, not load_dataset: the limit holds there too.
    from dynabatch.actors.data.open import open_dataset

    for loader in ("arrays_loader", "tuple_loader"):
        spec = DatasetSpec(name=f"{PLUGINS}:{loader}", limit=7)
        opened = open_dataset(spec, seed=0)
        assert len(opened.train) == 7 and len(opened.arrays.y_train) == 7
        assert np.array_equal(opened.arrays.y_train, load_dataset(spec, seed=0).y_train)


def test_user_loader_returning_a_tuple() -> None:
    d = load_dataset(DatasetSpec(name=f"{PLUGINS}:tuple_loader"))
    assert d.name == f"{PLUGINS}:tuple_loader"
    assert d.x_train.shape == (20, 2, 2) and d.x_train.dtype == np.float32
    assert d.y_train.dtype == np.int64 and d.num_classes == 4


@pytest.mark.parametrize(
    ("target", "options", "message"),
    [
        (
            "tests.unit.no_such_module:load",
            {},
            "dataset.name: cannot import module 'tests.unit.no_such_module' "
            "(No module named 'tests.unit.no_such_module')",
        ),
        (
            "no_such_top_level_pkg.data:load",
            {},
            "dataset.name: cannot import module 'no_such_top_level_pkg.data' "
            "(No module named 'no_such_top_level_pkg')",
        ),
        (f"{PLUGINS}:missing", {}, f"dataset.name: module '{PLUGINS}' has no attribute 'missing'"),
        (
            f"{PLUGINS}:NOT_CALLABLE",
            {},
            f"dataset.name: '{PLUGINS}:NOT_CALLABLE' is not callable (it is a int)",
        ),
        (f"{PLUGINS}:dict_loader", {}, "returned a dict; expected DatasetArrays, a tuple"),
        (f"{PLUGINS}:short_tuple_loader", {}, "returned a 2-tuple; expected DatasetArrays"),
        (
            f"{PLUGINS}:mismatched_loader",
            {},
            "returned invalid data: x_train has 5 samples but y_train has 4",
        ),
        (f"{PLUGINS}:invalid_arrays_loader", {}, "returned invalid data: y_train has label 5"),
        (
            f"{PLUGINS}:failing_loader",
            {},
            f"dataset.name: '{PLUGINS}:failing_loader' raised RuntimeError: disk on fire",
        ),
        (
            f"{PLUGINS}:arrays_loader",
            {"bogus": 1},
            f"dataset.options: unknown option 'bogus' for '{PLUGINS}:arrays_loader' (it "
            "takes: n, classes, features)",
        ),
    ],
)
def test_user_loader_errors(target: str, options: dict[str, object], message: str) -> None:
    with pytest.raises(WorkloadError) as info:
        load_dataset(DatasetSpec(name=target, options=options))
    assert message in str(info.value)
    assert str(info.value).startswith(("dataset.name: ", "dataset.options: "))
    assert "\n" not in str(info.value)


def test_user_module_failing_at_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dynabatch_broken_plugin.py").write_text("raise RuntimeError('boom\\nat import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(WorkloadError) as info:
        load_dataset(DatasetSpec(name="dynabatch_broken_plugin:load"))
    assert str(info.value) == (
        "dataset.name: importing module 'dynabatch_broken_plugin' failed "
        "(RuntimeError: boom at import)"
    )


def test_user_loader_warns_that_path_is_not_passed() -> None:
    with pytest.warns(UserWarning, match="dataset.path is not passed to user loaders"):
        load_dataset(DatasetSpec(name=f"{PLUGINS}:tuple_loader", path="/data"))

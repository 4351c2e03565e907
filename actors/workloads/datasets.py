"""Datasets as normalised in-memory numpy arrays: the built-ins (nothing is ever downloaded;
what each reads or generates: docs/spec.md) and a user loader ``"pkg.mod:function"``, called
with ``dataset.options`` as keyword arguments, returning a :class:`DatasetArrays` or a tuple
``(x_train, y_train, x_test, y_test)``.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from dynabatch.actors.data.open import FILE_KINDS
from dynabatch.actors.spec import DatasetSpec
from dynabatch.actors.workloads import WorkloadError, check_option_names, int_option
from dynabatch.actors.workloads.arrays import DatasetArrays, InvalidArrays, as_labels
from dynabatch.actors.workloads.formats import FormatError
from dynabatch.actors.workloads.formats.cifar import read_cifar10
from dynabatch.actors.workloads.formats.idx import read_mnist
from dynabatch.actors.workloads.images import (
    channel_stats,
    generate_mnist,
    standardise,
    unit_images,
)
from dynabatch.actors.workloads.imports import call_user, check_user_options, resolve_callable

BUILTIN_DATASETS = ("synthetic", "digits", "mnist", "cifar10", "pysource")

# Distinct RNG stream tags, so that e.g. changing the limit never changes the data itself.
_TAG_SYNTHETIC = 0x53594E
_TAG_LIMIT = 0x4C494D
_TAG_SPLIT = 0x53504C

_MAX_GENERATED = 1_000_000


# The built-ins' options: {name: (default, minimum, maximum)}, all integers.
INT_OPTIONS: dict[str, dict[str, tuple[int, int, int]]] = {
    "synthetic": {
        "n_samples": (2048, 4, 10_000_000),
        "n_features": (32, 1, 100_000),
        "n_classes": (4, 2, 1000),
    },
    "digits": {},
    "mnist": {"n_train": (12000, 1, _MAX_GENERATED), "n_test": (2000, 1, _MAX_GENERATED)},
    "cifar10": {},
    "pysource": {"chars": (400_000, 1_000, 5_000_000), "seq_len": (64, 2, 4096)},
}


def _int_options(spec: DatasetSpec, allowed: dict[str, tuple[int, int, int]]) -> dict[str, int]:
    """Validate ``spec.options`` against ``{name: (default, minimum, maximum)}``."""
    check_option_names("dataset.options", spec.name, spec.options, allowed)
    return {key: int_option(spec.options.get(key, default), f"dataset.options.{key}", lo, hi)
            for key, (default, lo, hi) in allowed.items()}


def _warn_unused_path(spec: DatasetSpec) -> None:
    if spec.path is not None:
        warnings.warn(
            f"dataset.path is ignored by the {spec.name} dataset", UserWarning, stacklevel=3
        )


def _split(
    x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A seeded, shuffled train/test split, stratified when every class can appear in both parts.

    Stratified: each class gives the test part its proportional share of ``n_test``, rounded
    down, and the samples left over go to the classes with the largest remainders (ties in a
    seeded order). Numpy alone: importing scikit-learn for its splitter cost each process
    that loads the dataset (every job's coordinator) about a second of CPU.
    """
    n = len(y)
    n_test = min(max(1, math.ceil(n * test_fraction)), n - 1)
    rng = np.random.default_rng([seed, _TAG_SPLIT])
    classes, counts = np.unique(y, return_counts=True)
    if counts.min() >= 2 and min(n_test, n - n_test) >= len(classes):
        share = counts * (n_test / n)
        take = np.floor(share).astype(np.int64)
        tie_order = rng.permutation(len(classes))
        by_remainder = tie_order[np.argsort(-(share - take)[tie_order], kind="stable")]
        take[by_remainder[: n_test - int(take.sum())]] += 1
        test_parts, train_parts = [], []
        for label, k in zip(classes, take, strict=True):
            members = rng.permutation(np.flatnonzero(y == label))
            test_parts.append(members[:k])
            train_parts.append(members[k:])
        test = rng.permutation(np.concatenate(test_parts))
        train = rng.permutation(np.concatenate(train_parts))
    else:
        order = rng.permutation(n)
        test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _limit(arrays: DatasetArrays, limit: int | None, seed: int) -> DatasetArrays:
    n = len(arrays.y_train)
    if limit is None or limit >= n:
        return arrays
    # A seeded random subset rather than the first `limit`, so files sorted by class still give
    # every class; indices stay in order so the subset keeps the file's order otherwise.
    rng = np.random.default_rng([seed, _TAG_LIMIT])
    idx = np.sort(rng.choice(n, size=limit, replace=False))
    return dataclasses.replace(arrays, x_train=arrays.x_train[idx], y_train=arrays.y_train[idx])


# --------------------------------------------------------------------------------------------
# synthetic


def _synthetic(spec: DatasetSpec, seed: int) -> DatasetArrays:
    """A seeded classification problem labelled by a random teacher network."""
    _warn_unused_path(spec)
    opts = _int_options(spec, INT_OPTIONS["synthetic"])
    n, d, k = opts["n_samples"], opts["n_features"], opts["n_classes"]
    if n < 2 * k:
        raise WorkloadError(
            f"dataset.options.n_samples: {n} is too few for {k} classes (need at least {2 * k})"
        )
    rng = np.random.default_rng([seed, _TAG_SYNTHETIC])
    hidden = max(8, 2 * k)
    x = rng.standard_normal((n, d), dtype=np.float32)
    w_lin = rng.standard_normal((d, k)) / math.sqrt(d)
    w_in = rng.standard_normal((d, hidden)) * (2.0 / math.sqrt(d))
    w_out = rng.standard_normal((hidden, k)) / math.sqrt(hidden)
    # A linear part (so a linear model is far above chance) plus a tanh layer (so depth helps).
    logits = x @ w_lin + np.tanh(x @ w_in) @ w_out
    # Shift per-class biases until the argmax classes are roughly balanced: a random teacher
    # alone can leave a class nearly empty. Standardised logits and a decaying step keep the
    # search from oscillating; a bounded sample keeps it cheap for large n.
    logits = (logits - logits.mean(axis=0)) / (logits.std() + 1e-12)
    sample = logits[:20000]
    bias = np.zeros(k)
    for it in range(300):
        frac = np.bincount(np.argmax(sample + bias, axis=1), minlength=k) / len(sample)
        bias -= (frac - 1.0 / k) / math.sqrt(1.0 + it)
    y = np.argmax(logits + bias, axis=1).astype(np.int64)
    x_tr, y_tr, x_te, y_te = _split(x, y, spec.test_fraction, seed)
    return DatasetArrays(spec.name, x_tr, y_tr, x_te, y_te, num_classes=k)


# --------------------------------------------------------------------------------------------
# digits


def _digits(spec: DatasetSpec, seed: int) -> DatasetArrays:
    _warn_unused_path(spec)
    _int_options(spec, INT_OPTIONS["digits"])
    x, y = _digits_arrays()
    # Pixel values are 0..16 in this dataset.
    x = (x / 16.0).astype(np.float32)
    x_tr, y_tr, x_te, y_te = _split(x, y, spec.test_fraction, seed)
    return DatasetArrays(spec.name, x_tr, y_tr, x_te, y_te, num_classes=10)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits file (the rows ``load_digits`` returns: 64 pixels, then
    the label), read from the installed package without importing it: ``import sklearn``
    costs about a second of CPU, paid by every process that loads this dataset."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise WorkloadError("dataset.name: digits needs scikit-learn installed (its data file)")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


# --------------------------------------------------------------------------------------------
# mnist

def _mnist(spec: DatasetSpec, seed: int) -> DatasetArrays:
    opts = _int_options(spec, INT_OPTIONS["mnist"])
    if spec.path is not None:
        if spec.options:
            warnings.warn(
                "dataset.options n_train/n_test are ignored when dataset.path is set "
                "(use dataset.limit to train on fewer samples)",
                UserWarning,
                stacklevel=3,
            )
        try:
            raw = read_mnist(spec.path)
        except FormatError as err:
            raise WorkloadError(f"dataset.path: {err}") from err
    else:
        raw = generate_mnist(opts["n_train"], opts["n_test"], seed)
    x_tr, y_tr, x_te, y_te = raw
    return DatasetArrays(
        spec.name, unit_images(x_tr), y_tr, unit_images(x_te), y_te, num_classes=10
    )


# --------------------------------------------------------------------------------------------
# cifar10


def _cifar10(spec: DatasetSpec, seed: int) -> DatasetArrays:
    _int_options(spec, INT_OPTIONS["cifar10"])
    if spec.path is None:
        raise WorkloadError(
            "dataset.path: cifar10 needs the directory holding cifar-10-batches-py "
            "(datasets are never downloaded)"
        )
    try:
        x_tr, y_tr, x_te, y_te = read_cifar10(spec.path)
    except FormatError as err:
        raise WorkloadError(f"dataset.path: {err}") from err
    # Statistics of the whole training set (before any limit), applied to both splits.
    mean, std = channel_stats(x_tr)
    return DatasetArrays(
        spec.name,
        standardise(x_tr, mean, std),
        y_tr,
        standardise(x_te, mean, std),
        y_te,
        num_classes=10,
    )


# --------------------------------------------------------------------------------------------
# user loaders


def check_dataset_options(spec: DatasetSpec) -> None:
    """Check ``dataset.options`` before anything is loaded: a built-in's against its table,
    a user loader's against its signature (WorkloadError naming the option). The file kinds
    (parquet, npy, imagefolder) check theirs when their files are opened."""
    if spec.name in INT_OPTIONS:
        _int_options(spec, INT_OPTIONS[spec.name])
    elif spec.name not in FILE_KINDS:
        fn = resolve_callable(spec.name, "dataset.name")
        check_user_options(fn, spec.name, "dataset.options", spec.options)


def _user(spec: DatasetSpec, seed: int) -> DatasetArrays:
    field = "dataset.name"
    if spec.path is not None:
        warnings.warn(
            "dataset.path is not passed to user loaders; put it in dataset.options",
            UserWarning,
            stacklevel=3,
        )
    fn = resolve_callable(spec.name, field)
    check_user_options(fn, spec.name, "dataset.options", spec.options)
    try:
        result = call_user(fn, spec.name, field, **spec.options)
    except InvalidArrays as err:  # the loader built a DatasetArrays that failed validation
        raise WorkloadError(f"{field}: {spec.name!r} returned invalid data: {err.problem}") from err
    return user_arrays(spec, result, seed)


_VALUES_HINT = ("; for regression targets return DatasetArrays(..., targets=\"values\") "
                "(from dynabatch.actors.workloads.datasets import DatasetArrays) or set "
                "dataset.targets: values")


def user_arrays(spec: DatasetSpec, result: Any, seed: int) -> DatasetArrays:
    """A user loader's return value as DatasetArrays, ``dataset.limit`` applied (a map-style
    dataset is read whole: only :func:`load_dataset`'s callers that need every sample in
    memory get here)."""
    field = "dataset.name"
    from dynabatch.actors.data.mapstyle import split_result

    if split_result(result) is not None:
        from dynabatch.actors.data.open import materialise

        return materialise(spec, seed)
    if isinstance(result, DatasetArrays):
        return _limit(result, spec.limit, seed)
    if not isinstance(result, tuple | list) or len(result) != 4:
        what = (
            f"a {len(result)}-tuple"
            if isinstance(result, tuple | list)
            else f"a {type(result).__name__}"
        )
        raise WorkloadError(
            f"{field}: {spec.name!r} returned {what}; expected DatasetArrays, a tuple "
            "(x_train, y_train, x_test, y_test) or a map-style dataset (__len__ and "
            "__getitem__ returning (input, target))"
        )
    x_tr, y_tr, x_te, y_te = result
    try:
        if spec.targets == "values" or (
                spec.targets is None and np.asarray(y_tr).dtype.kind == "f"
                and not np.all(np.asarray(y_tr) == np.round(np.asarray(y_tr)))):
            # Float targets that are not whole numbers are regression targets.
            width = 1 if np.ndim(y_tr) == 1 else int(np.shape(y_tr)[1])
            arrays = DatasetArrays(spec.name, x_tr, y_tr, x_te, y_te, num_classes=width,
                                   targets="values")
        elif np.ndim(y_tr) == 2 and np.asarray(y_tr).dtype.kind in "iu":
            # Integer (N, T) targets: token sequences; the vocabulary covers every id seen.
            top = max(int(np.max(a)) for a in (x_tr, y_tr, x_te, y_te))
            arrays = DatasetArrays(spec.name, x_tr, y_tr, x_te, y_te,
                                   num_classes=max(top + 1, 2), targets="tokens")
        else:
            labels = [as_labels(y_tr, "y_train"), as_labels(y_te, "y_test")]
            # A tuple carries no class count: infer it from the largest label seen.
            top = max((int(y.max()) for y in labels if len(y)), default=0)
            arrays = DatasetArrays(spec.name, x_tr, labels[0], x_te, labels[1],
                                   num_classes=spec.num_classes or top + 1)
    except InvalidArrays as err:
        hint = _VALUES_HINT if "class labels" in err.problem else ""
        raise WorkloadError(
            f"{field}: {spec.name!r} returned invalid data: {err.problem}{hint}") from err
    return _limit(arrays, spec.limit, seed)


def _pysource(spec: DatasetSpec, seed: int) -> DatasetArrays:
    """Character-level LM windows over the stdlib's source (see :mod:`.text`)."""
    from dynabatch.actors.workloads import text

    _warn_unused_path(spec)
    opts = _int_options(spec, INT_OPTIONS["pysource"])
    ids = text.encode(text.stdlib_text(opts["chars"]))
    cut = int(len(ids) * (1.0 - spec.test_fraction))
    return DatasetArrays("pysource", *text.windows(ids[:cut], opts["seq_len"]),
                         *text.windows(ids[cut:], opts["seq_len"]), num_classes=text.VOCAB,
                         targets="tokens")


_BUILTINS: dict[str, Callable[[DatasetSpec, int], DatasetArrays]] = {
    "pysource": _pysource,
    "synthetic": _synthetic,
    "digits": _digits,
    "mnist": _mnist,
    "cifar10": _cifar10,
}


def load_dataset(spec: DatasetSpec, seed: int = 0) -> DatasetArrays:
    """Load ``spec`` as normalised arrays; the same ``seed`` always gives the same data.

    Raises :class:`WorkloadError` naming the spec field at fault.
    """
    if spec.name in FILE_KINDS:  # read whole: the simulator and protocol: ps only
        from dynabatch.actors.data.open import materialise

        return materialise(spec, seed)
    if spec.name not in _BUILTINS:
        return _user(spec, seed)  # limited in user_arrays, as open_dataset's arrays are
    return _limit(_BUILTINS[spec.name](spec, seed), spec.limit, seed)

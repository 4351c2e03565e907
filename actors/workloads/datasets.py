"""Datasets as normalised in-memory numpy arrays.

Built-ins (nothing is ever downloaded):

* ``synthetic``: a seeded classification problem labelled by a random teacher network.
* ``digits``: scikit-learn's bundled 8x8 digits (1797 samples), as 64 features in [0, 1].
* ``mnist``: the four IDX files in ``dataset.path``; without a path, MNIST-format data is
  generated from the seed (seven-segment style digits with random slant, scale, stroke width
  and noise), written as real IDX bytes and parsed by the same reader as the files.
* ``cifar10``: the python pickle batches in ``dataset.path`` (or its ``cifar-10-batches-py``).

A user loader ``"pkg.mod:function"`` is called with ``dataset.options`` as keyword arguments
and returns a :class:`DatasetArrays` or a tuple ``(x_train, y_train, x_test, y_test)``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from dynabatch.actors.spec import DatasetSpec
from dynabatch.actors.workloads import WorkloadError
from dynabatch.actors.workloads.formats import (
    MNIST_FILES,
    FormatError,
    encode_mnist,
    parse_mnist,
    read_cifar10,
    read_mnist,
)
from dynabatch.actors.workloads.imports import call_user, resolve_callable

BUILTIN_DATASETS = ("synthetic", "digits", "mnist", "cifar10", "pysource")
FILE_DATASETS = ("parquet", "npy", "imagefolder")

# Distinct RNG stream tags, so that e.g. changing the limit never changes the data itself.
_TAG_SYNTHETIC = 0x53594E
_TAG_MNIST = 0x4D4E53
_TAG_LIMIT = 0x4C494D

_MAX_GENERATED = 1_000_000


class _InvalidArrays(WorkloadError):
    """Raised by DatasetArrays validation; ``problem`` is the message without a prefix."""

    def __init__(self, problem: str):
        self.problem = problem
        super().__init__(f"invalid DatasetArrays: {problem}")


def _as_features(x: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(x)
    except Exception as err:
        raise _InvalidArrays(f"{what} is not an array ({err})") from err
    if arr.dtype.kind not in "biuf":
        raise _InvalidArrays(f"{what} must be numeric, got dtype {arr.dtype}")
    # No copy when the data is already float32 and C-contiguous (all the built-ins).
    return np.ascontiguousarray(arr, dtype=np.float32)


def _as_labels(y: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(y)
    except Exception as err:
        raise _InvalidArrays(f"{what} is not an array ({err})") from err
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise _InvalidArrays(f"{what} must hold integer class labels")
    elif arr.dtype.kind not in "biu":
        raise _InvalidArrays(f"{what} must hold integer class labels, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise _InvalidArrays(f"{what} must be 1-dimensional, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _all_finite(x: np.ndarray) -> bool:
    # In slices: a full-size boolean temporary would be ~180 MB for CIFAR-10.
    step = max(1, (1 << 22) // max(1, math.prod(x.shape[1:])))
    return all(np.isfinite(x[i : i + step]).all() for i in range(0, len(x), step))


TARGET_KINDS = ("classes", "tokens", "values")


def _as_tokens(a: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(a)
    except Exception as err:
        raise _InvalidArrays(f"{what} is not an array ({err})") from err
    if arr.dtype.kind not in "iu":
        raise _InvalidArrays(f"{what} must hold integer token ids (int64), got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise _InvalidArrays(f"{what} must have shape (N, T) of token ids, got {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _as_values(y: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(y)
    except Exception as err:
        raise _InvalidArrays(f"{what} is not an array ({err})") from err
    if arr.dtype.kind not in "biuf":
        raise _InvalidArrays(f"{what} must hold numeric regression targets, got dtype {arr.dtype}")
    if arr.ndim not in (1, 2):
        raise _InvalidArrays(f"{what} must have shape (N,) or (N, k), got {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.float32)


@dataclass(frozen=True, eq=False, repr=False)
class DatasetArrays:
    """A dataset in memory. ``targets`` says what the samples hold:

    * ``classes`` (default): float32 features (N, *input_shape) and int64 labels (N,) in
      ``0..num_classes-1``;
    * ``tokens``: int64 token sequences x (N, T) and next tokens y (N, T), ids in
      ``0..num_classes-1`` (``num_classes`` is the vocabulary size);
    * ``values``: float32 features and float32 regression targets (N,) or (N, k);
      ``num_classes`` is the model's output width.

    Construction converts dtypes (C-contiguous) and validates shapes, ranges and
    finiteness, raising :class:`WorkloadError` on a problem.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    targets: str = "classes"

    def __post_init__(self) -> None:
        kind = self.targets
        if kind not in TARGET_KINDS:
            raise _InvalidArrays(f"targets must be one of {', '.join(TARGET_KINDS)}, got {kind!r}")
        fields: dict[str, np.ndarray] = {}
        for split in ("train", "test"):
            if kind == "tokens":
                x = _as_tokens(getattr(self, f"x_{split}"), f"x_{split}")
                y = _as_tokens(getattr(self, f"y_{split}"), f"y_{split}")
                if x.shape != y.shape:
                    raise _InvalidArrays(
                        f"x_{split} has shape {x.shape} but y_{split} has {y.shape}"
                    )
            else:
                x = _as_features(getattr(self, f"x_{split}"), f"x_{split}")
                y = (_as_labels if kind == "classes" else _as_values)(
                    getattr(self, f"y_{split}"), f"y_{split}"
                )
            if x.ndim < 2:
                raise _InvalidArrays(f"x_{split} must have shape (N, *input_shape), got {x.shape}")
            if len(x) != len(y):
                raise _InvalidArrays(f"x_{split} has {len(x)} samples but y_{split} has {len(y)}")
            if len(x) == 0:
                raise _InvalidArrays(f"x_{split} is empty")
            if kind != "tokens" and not _all_finite(x):
                raise _InvalidArrays(f"x_{split} contains NaN or infinite values")
            if kind == "values" and not np.isfinite(y).all():
                raise _InvalidArrays(f"y_{split} contains NaN or infinite values")
            fields[f"x_{split}"], fields[f"y_{split}"] = x, y
        if fields["x_test"].shape[1:] != fields["x_train"].shape[1:]:
            raise _InvalidArrays(
                f"x_test samples have shape {fields['x_test'].shape[1:]} but x_train samples "
                f"have {fields['x_train'].shape[1:]}"
            )
        k = self.num_classes
        least = 1 if kind == "values" else 2
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < least:
            raise _InvalidArrays(f"num_classes must be an int >= {least}, got {k!r}")
        ranged = {"classes": ("y",), "tokens": ("x", "y"), "values": ()}[kind]
        for split in ("train", "test"):
            for a in ranged:
                y = fields[f"{a}_{split}"]
                lo, hi = int(y.min()), int(y.max())
                if lo < 0 or hi >= k:
                    what = "label" if kind == "classes" else "token id"
                    raise _InvalidArrays(
                        f"{a}_{split} has {what} {lo if lo < 0 else hi}, outside 0..{k - 1} "
                        f"(num_classes={k})"
                    )
        for key, value in fields.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "num_classes", int(k))

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample, e.g. ``(1, 28, 28)`` or ``(64,)``."""
        return tuple(int(n) for n in self.x_train.shape[1:])

    def __repr__(self) -> str:
        # Shapes, not contents: this ends up in logs.
        return (
            f"DatasetArrays(name={self.name!r}, train={len(self.y_train)}, "
            f"test={len(self.y_test)}, input_shape={self.input_shape}, "
            f"num_classes={self.num_classes}, targets={self.targets!r})"
        )


# --------------------------------------------------------------------------------------------
# Options and helpers


def _int_options(spec: DatasetSpec, allowed: dict[str, tuple[int, int, int]]) -> dict[str, int]:
    """Validate ``spec.options`` against ``{name: (default, minimum, maximum)}``."""
    unknown = sorted(set(spec.options) - set(allowed))
    if unknown:
        names = ", ".join(sorted(allowed)) or "none"
        raise WorkloadError(
            f"dataset.options: unknown option {unknown[0]!r} for {spec.name} (allowed: {names})"
        )
    out = {}
    for key, (default, lo, hi) in allowed.items():
        v = spec.options.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise WorkloadError(
                f"dataset.options.{key}: must be an integer from {lo} to {hi}, got {v!r}"
            )
        out[key] = v
    return out


def _warn_unused_path(spec: DatasetSpec) -> None:
    if spec.path is not None:
        warnings.warn(
            f"dataset.path is ignored by the {spec.name} dataset", UserWarning, stacklevel=3
        )


def _split(
    x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A seeded train/test split, stratified when every class can appear in both parts."""
    from sklearn.model_selection import train_test_split

    n = len(y)
    n_test = min(max(1, math.ceil(n * test_fraction)), n - 1)
    counts = np.bincount(y)
    classes = int((counts > 0).sum())
    stratify = y if counts[counts > 0].min() >= 2 and min(n_test, n - n_test) >= classes else None
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=n_test, random_state=seed, shuffle=True, stratify=stratify
    )
    return x_tr, y_tr, x_te, y_te


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
    _warn_unused_path(spec)
    opts = _int_options(
        spec,
        {
            "n_samples": (2048, 4, 10_000_000),
            "n_features": (32, 1, 100_000),
            "n_classes": (4, 2, 1000),
        },
    )
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
    from sklearn.datasets import load_digits

    _warn_unused_path(spec)
    _int_options(spec, {})
    x, y = load_digits(return_X_y=True)
    # Pixel values are 0..16 in this dataset.
    x = (x / 16.0).astype(np.float32)
    x_tr, y_tr, x_te, y_te = _split(x, y.astype(np.int64), spec.test_fraction, seed)
    return DatasetArrays(spec.name, x_tr, y_tr, x_te, y_te, num_classes=10)


# --------------------------------------------------------------------------------------------
# mnist

# Seven-segment glyph: segment endpoints (x0, y0, x1, y1) in a box x in [-0.5, 0.5],
# y in [-1, 1] (y grows downwards, as image rows do), in the order a b c d e f g.
_SEGMENTS = np.array(
    [
        [-0.5, -1.0, 0.5, -1.0],  # a: top
        [0.5, -1.0, 0.5, 0.0],  # b: top right
        [0.5, 0.0, 0.5, 1.0],  # c: bottom right
        [-0.5, 1.0, 0.5, 1.0],  # d: bottom
        [-0.5, 0.0, -0.5, 1.0],  # e: bottom left
        [-0.5, -1.0, -0.5, 0.0],  # f: top left
        [-0.5, 0.0, 0.5, 0.0],  # g: middle
    ]
)
_DIGIT_SEGMENTS = np.array(
    [
        [c == "1" for c in bits]
        for bits in (
            "1111110",
            "0110000",
            "1101101",
            "1111001",
            "0110011",
            "1011011",
            "1011111",
            "1110000",
            "1111111",
            "1111011",
        )
    ]
)
_MNIST_SIZE = 28


def _render_digits(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 images (N, 28, 28) of the digits ``labels``, each with its own random distortion."""
    n = len(labels)
    n_seg = len(_SEGMENTS)
    # Per-image handwriting variation: wobbly endpoints, slant, rotation, size, aspect,
    # position, stroke width, and segments that are missing or stray.
    pts = _SEGMENTS.reshape(1, n_seg, 2, 2) + rng.normal(0.0, 0.07, (n, n_seg, 2, 2))
    half_h = rng.uniform(7.0, 9.5, n)
    half_w = half_h * rng.uniform(0.8, 1.4, n)
    shear = rng.uniform(-0.35, 0.15, n)
    angle = rng.uniform(-0.15, 0.15, n)
    cos, sin = np.cos(angle), np.sin(angle)
    # M = rotation @ shear @ scale, applied to glyph coordinates.
    m = np.empty((n, 2, 2))
    m[:, 0, 0] = cos * half_w
    m[:, 0, 1] = (cos * shear - sin) * half_h
    m[:, 1, 0] = sin * half_w
    m[:, 1, 1] = (sin * shear + cos) * half_h
    centre = (_MNIST_SIZE - 1) / 2 + rng.uniform(-2.5, 2.5, (n, 2))
    pix_pts = np.einsum("nij,nsej->nsei", m, pts) + centre[:, None, None, :]
    half_stroke = rng.uniform(0.6, 1.3, n)
    active = _DIGIT_SEGMENTS[labels]
    strength = np.where(active, rng.uniform(0.75, 1.0, (n, n_seg)), 0.0)
    dropped = active & (rng.random((n, n_seg)) < 0.06)
    stray = ~active & (rng.random((n, n_seg)) < 0.05)
    strength = np.where(dropped, rng.uniform(0.0, 0.25, (n, n_seg)), strength)
    strength = np.where(stray, rng.uniform(0.3, 0.7, (n, n_seg)), strength)
    noise = rng.normal(0.0, 0.06, (n, _MNIST_SIZE * _MNIST_SIZE))

    # float32 for the per-pixel work: it halves the time and the precision is ample for 8 bits.
    pix_pts = pix_pts.astype(np.float32)
    half_stroke = half_stroke.astype(np.float32)
    strength = strength.astype(np.float32)
    noise = noise.astype(np.float32)
    rows, cols = np.mgrid[0:_MNIST_SIZE, 0:_MNIST_SIZE]
    px = cols.ravel().astype(np.float32)
    py = rows.ravel().astype(np.float32)
    out = np.empty((n, _MNIST_SIZE * _MNIST_SIZE), dtype=np.uint8)
    chunk = 512  # bounds the (chunk, 7, 784) temporaries to a few tens of MB
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        ax, ay = pix_pts[s:e, :, 0, 0, None], pix_pts[s:e, :, 0, 1, None]
        vx = pix_pts[s:e, :, 1, 0, None] - ax
        vy = pix_pts[s:e, :, 1, 1, None] - ay
        wx, wy = px - ax, py - ay
        t = np.clip((wx * vx + wy * vy) / (vx * vx + vy * vy + np.float32(1e-9)), 0.0, 1.0)
        dist = np.hypot(wx - t * vx, wy - t * vy)
        # Anti-aliased stroke: full ink inside the stroke, fading over one pixel.
        ink = np.clip(half_stroke[s:e, None, None] + np.float32(0.5) - dist, 0.0, 1.0)
        img = (ink * strength[s:e, :, None]).max(axis=1) + noise[s:e]
        out[s:e] = np.round(np.clip(img, 0.0, 1.0) * np.float32(255.0)).astype(np.uint8)
    return out.reshape(n, _MNIST_SIZE, _MNIST_SIZE)


def generate_mnist(
    n_train: int = 12000, n_test: int = 2000, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic MNIST-like data: uint8 images (N, 28, 28) and uint8 labels 0..9.

    Train and test come from separate seeded streams, so the test set does not depend on
    ``n_train``. Labels are balanced (each digit appears n/10 times, rounded) and shuffled.
    """
    parts: list[np.ndarray] = []
    for split, n in ((0, n_train), (1, n_test)):
        rng = np.random.default_rng([seed, _TAG_MNIST, split])
        labels = rng.permutation(np.arange(n) % 10).astype(np.uint8)
        parts += [_render_digits(labels, rng), labels]
    x_train, y_train, x_test, y_test = parts
    return x_train, y_train, x_test, y_test


def _mnist(spec: DatasetSpec, seed: int) -> DatasetArrays:
    limits = (1, _MAX_GENERATED)
    opts = _int_options(spec, {"n_train": (12000, *limits), "n_test": (2000, *limits)})
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
        # Round-trip through real IDX bytes, so generated data takes the same path as files.
        blobs = encode_mnist(*generate_mnist(opts["n_train"], opts["n_test"], seed))
        raw = parse_mnist(blobs, {k: f"<generated {v}>" for k, v in MNIST_FILES.items()})
    x_tr, y_tr, x_te, y_te = raw
    return DatasetArrays(
        spec.name, _unit_images(x_tr), y_tr, _unit_images(x_te), y_te, num_classes=10
    )


def _unit_images(images: np.ndarray) -> np.ndarray:
    """uint8 (N, H, W) -> float32 (N, 1, H, W) in [0, 1]."""
    x = images.astype(np.float32)[:, None]
    x *= np.float32(1.0 / 255.0)
    return x


# --------------------------------------------------------------------------------------------
# cifar10


def channel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std (in 0..255 units) of uint8 images (N, C, H, W).

    Computed from a 256-bin histogram per channel: exact, and with no float copy of the data.
    """
    levels = np.arange(256, dtype=np.float64)
    means, stds = [], []
    for c in range(images.shape[1]):
        hist = np.bincount(images[:, c].ravel(), minlength=256).astype(np.float64)
        total = hist.sum()
        mean = (hist * levels).sum() / total
        var = (hist * (levels - mean) ** 2).sum() / total
        means.append(mean)
        stds.append(math.sqrt(var))
    return np.array(means), np.array(stds)


def _standardise(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    x = images.astype(np.float32)
    for c in range(x.shape[1]):
        # A constant channel (possible in tiny test files) is centred but not scaled.
        scale = std[c] if std[c] > 1e-6 else 1.0
        x[:, c] -= np.float32(mean[c])
        x[:, c] *= np.float32(1.0 / scale)
    return x


def _cifar10(spec: DatasetSpec, seed: int) -> DatasetArrays:
    _int_options(spec, {})
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
        _standardise(x_tr, mean, std),
        y_tr,
        _standardise(x_te, mean, std),
        y_te,
        num_classes=10,
    )


# --------------------------------------------------------------------------------------------
# user loaders


def _user(spec: DatasetSpec, seed: int) -> DatasetArrays:
    field = "dataset.name"
    if spec.path is not None:
        warnings.warn(
            "dataset.path is not passed to user loaders; put it in dataset.options",
            UserWarning,
            stacklevel=3,
        )
    fn = resolve_callable(spec.name, field)
    try:
        result = call_user(fn, spec.name, field, **spec.options)
    except _InvalidArrays as err:  # the loader built a DatasetArrays that failed validation
        raise WorkloadError(f"{field}: {spec.name!r} returned invalid data: {err.problem}") from err
    return user_arrays(spec, result, seed)


_VALUES_HINT = ("; for regression targets return DatasetArrays(..., targets=\"values\") "
                "(from dynabatch.actors.workloads.datasets import DatasetArrays) or set "
                "dataset.targets: values")


def user_arrays(spec: DatasetSpec, result: Any, seed: int) -> DatasetArrays:
    """A user loader's return value as DatasetArrays (a map-style dataset is read whole:
    only :func:`load_dataset`'s callers that need every sample in memory get here)."""
    field = "dataset.name"
    from dynabatch.actors.data.mapstyle import split_result

    if split_result(result) is not None:
        from dynabatch.actors.data.open import materialise

        return materialise(spec, seed)
    if isinstance(result, DatasetArrays):
        return result
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
            return DatasetArrays(spec.name, x_tr, y_tr, x_te, y_te, num_classes=width,
                                 targets="values")
        if np.ndim(y_tr) == 2 and np.asarray(y_tr).dtype.kind in "iu":
            # Integer (N, T) targets: token sequences; the vocabulary covers every id seen.
            top = max(int(np.max(a)) for a in (x_tr, y_tr, x_te, y_te))
            return DatasetArrays(spec.name, x_tr, y_tr, x_te, y_te, num_classes=max(top + 1, 2),
                                 targets="tokens")
        labels = [_as_labels(y_tr, "y_train"), _as_labels(y_te, "y_test")]
        # A tuple carries no class count: infer it from the largest label seen.
        top = max((int(y.max()) for y in labels if len(y)), default=0)
        return DatasetArrays(spec.name, x_tr, labels[0], x_te, labels[1],
                             num_classes=spec.num_classes or top + 1)
    except _InvalidArrays as err:
        hint = _VALUES_HINT if "class labels" in err.problem else ""
        raise WorkloadError(
            f"{field}: {spec.name!r} returned invalid data: {err.problem}{hint}") from err


def _pysource(spec: DatasetSpec, seed: int) -> DatasetArrays:
    """Character-level LM windows over the stdlib's source (see :mod:`.text`)."""
    from dynabatch.actors.workloads import text

    _warn_unused_path(spec)
    opts = _int_options(spec, {"chars": (400_000, 1_000, 5_000_000), "seq_len": (64, 2, 4096)})
    x_tr, y_tr, x_te, y_te = text.split_corpus(opts["chars"], opts["seq_len"], spec.test_fraction)
    return DatasetArrays("pysource", x_tr, y_tr, x_te, y_te, num_classes=text.VOCAB,
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
    if spec.name in FILE_DATASETS:  # read whole: the simulator and protocol: ps only
        from dynabatch.actors.data.open import materialise

        return materialise(spec, seed)
    loader = _BUILTINS.get(spec.name, _user)
    arrays = loader(spec, seed)
    return _limit(arrays, spec.limit, seed)

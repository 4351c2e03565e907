"""The one interface every training source implements, and the in-memory one.

A source is random access by sample id: ``len(source)`` samples, and ``read(ids, keys)``
returns the batch ``(x, y)`` of those samples, in that order, as numpy arrays (float32
features, or int64 token ids; int64 class labels, or float32 regression targets).
``keys`` (one int per sample, or None) seed the sample's random augmentation: the loader
derives them from (job seed, epoch, order position) (:func:`augment_keys`), so a sample
looks the same whoever reads it and whatever failed before; None means no augmentation
(evaluation). ``out`` (two arrays of at least ``len(ids)`` rows, or None) is where to write
the batch: the loader passes a reused, on a GPU node page-locked, staging buffer, so a
sample is copied once on the host, straight into the memory its device copy starts from
(:func:`batch_arrays`). ``block`` is how many consecutive ids a source reads together (a Parquet row
group): the epoch order keeps those near each other (:mod:`dynabatch.actors.data.order`).

What a bad sample raises is a :class:`DataError` naming the field, the file or the sample;
a :class:`SampleError` carries the sample id so the loader can name its order position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from dynabatch.actors.workloads import WorkloadError

TARGET_KINDS = ("classes", "tokens", "values")
Out = tuple[np.ndarray, np.ndarray]  # a batch's (x, y), or the buffer a read writes into


class DataError(WorkloadError):
    """A one-line problem with the data, naming the field, the file or the sample."""


class SampleError(DataError):
    """Reading sample ``sample`` failed; the loader adds its order position."""

    def __init__(self, sample: int, problem: str):
        self.sample = int(sample)
        self.problem = problem
        super().__init__(f"sample {self.sample}: {problem}")

    def __reduce__(self):  # crosses process boundaries (Ray) with its own arguments
        return (SampleError, (self.sample, self.problem))


@dataclass(frozen=True)
class Meta:
    """What the coordinator and the model need to know of a source."""

    name: str
    sample_shape: tuple[int, ...]
    num_classes: int
    targets: str = "classes"  # classes | tokens | values
    target_shape: tuple[int, ...] = ()
    # Dict or tuple inputs, or a dataset.collate: a read returns tensors, collated per share
    # (dynabatch.actors.data.structured); sample_shape is then the first input tensor's.
    structured: bool = False


def file_meta(name: str, x0: np.ndarray, y0: np.ndarray, targets: str | None,
              num_classes: int | None, largest_label: Any, structured: bool = False) -> Meta:
    """A file source's Meta from its first rows ``x0, y0`` and the spec's ``targets`` and
    ``num_classes`` (the defaults: from ``y0``'s dtype and shape; class labels count up to
    ``largest_label()``)."""
    kind = targets or ("values" if y0.dtype.kind == "f" else
                       "tokens" if y0.ndim == 2 else "classes")
    if kind == "classes" and num_classes is None:
        num_classes = largest_label() + 1
    k = int(num_classes) if num_classes is not None else (
        int(y0.shape[1]) if y0.ndim == 2 else 1)
    return Meta(name, tuple(x0.shape[1:]), max(k, 1), kind, tuple(y0.shape[1:]), structured)


class Source:
    """Random access by sample id (see the module docstring). Subclasses set ``meta``."""

    meta: Meta
    block: int = 1
    field: str = "dataset.path"  # the spec field a bad sample is blamed on
    # Its reads hold the GIL (Python per sample): parallel reads need processes, not threads.
    gil_bound: bool = False

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, ids: np.ndarray, keys: np.ndarray | None = None,
             out: Out | None = None) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def read_samples(self, ids: np.ndarray, keys: np.ndarray | None = None) -> list[Any]:
        """A structured source's samples ``ids`` as ``(input, target)`` pairs, uncollated
        (reader processes send them back; the share is collated as a whole)."""
        raise NotImplementedError

    def collate(self, samples: list[Any], ids: np.ndarray) -> tuple[Any, Any]:
        """A structured source's batch of ``samples``, read from ``ids``."""
        raise NotImplementedError

    def close(self) -> None:
        """Release files and caches (a worker closes its sources when it is dropped)."""


def x_dtype(targets: str) -> Any:
    return np.int64 if targets == "tokens" else np.float32


def y_dtype(targets: str) -> Any:
    return np.float32 if targets == "values" else np.int64


def batch_arrays(meta: Meta, n: int, out: Out | None = None) -> Out:
    """The (x, y) arrays a read of ``n`` samples fills: the first ``n`` rows of ``out``
    when given (the loader's staging buffer), else new ones, of the dtypes of
    :func:`x_dtype` and :func:`y_dtype`."""
    if out is None:
        return (np.empty((n, *meta.sample_shape), dtype=x_dtype(meta.targets)),
                np.empty((n, *meta.target_shape), dtype=y_dtype(meta.targets)))
    return out[0][:n], out[1][:n]


class ArraySource(Source):
    """Samples already in memory (the built-ins, a loader returning ``DatasetArrays``):
    reading is an index, with no copy of the whole set (object-store arrays stay
    read-only views)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, meta: Meta):
        self.x, self.y, self.meta = x, y, meta

    def __len__(self) -> int:
        return len(self.y)

    def read(self, ids: np.ndarray, keys: np.ndarray | None = None,
             out: Out | None = None) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        if out is None:
            return self.x[ids], self.y[ids]
        x, y = out[0][:len(ids)], out[1][:len(ids)]
        # One copy, gathered straight into the caller's buffer (cast where dtypes differ).
        for src, dst in ((self.x, x), (self.y, y)):
            if dst.dtype == src.dtype:
                np.take(src, ids, axis=0, out=dst, mode="raise")
            else:
                np.copyto(dst, src[ids], casting="unsafe")
        return x, y


class _View(Source):
    """Some of ``base``'s samples under ids of their own: reads go to the base, and a bad
    sample is named by the view's id (subclasses map ids both ways in :meth:`_mapped`)."""

    base: Source

    def read(self, ids: np.ndarray, keys: np.ndarray | None = None,
             out: Out | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self._mapped(self.base.read, ids, keys, out)

    def read_samples(self, ids: np.ndarray, keys: np.ndarray | None = None) -> list[Any]:
        return self._mapped(self.base.read_samples, ids, keys)

    def collate(self, samples: list[Any], ids: np.ndarray) -> tuple[Any, Any]:
        return self._mapped(lambda i: self.base.collate(samples, i), ids)

    def _mapped(self, fn: Any, ids: np.ndarray, *args: Any) -> Any:
        """``fn`` of the base's ids for ``ids`` (then ``args``)."""
        raise NotImplementedError

    def close(self) -> None:
        self.base.close()


class Subset(_View):
    """The samples ``index`` of ``base`` (a seeded split of a set with no held-out part)."""

    def __init__(self, base: Source, index: np.ndarray):
        self.base, self.index, self.meta = base, np.asarray(index, dtype=np.int64), base.meta
        self.block, self.field, self.gil_bound = base.block, base.field, base.gil_bound

    def __len__(self) -> int:
        return len(self.index)

    def _mapped(self, fn: Any, ids: np.ndarray, *args: Any) -> Any:
        ids = np.asarray(ids, dtype=np.int64)
        try:
            return fn(self.index[ids], *args)
        except SampleError as err:  # name the sample by this split's id
            mine = ids[self.index[ids] == err.sample]
            raise SampleError(int(mine[0]) if len(mine) else err.sample, err.problem) from err


class Range(_View):
    """The contiguous ids ``[lo, hi)`` of ``base`` (train and test of one file set)."""

    def __init__(self, base: Source, lo: int, hi: int):
        self.base, self.lo, self.hi, self.meta = base, lo, hi, base.meta
        self.block, self.field, self.gil_bound = base.block, base.field, base.gil_bound

    def __len__(self) -> int:
        return self.hi - self.lo

    def _mapped(self, fn: Any, ids: np.ndarray, *args: Any) -> Any:
        try:
            return fn(np.asarray(ids, dtype=np.int64) + self.lo, *args)
        except SampleError as err:
            raise SampleError(err.sample - self.lo, err.problem) from err


def split_ids(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded split of ``range(n)`` into (train, test) ids, each sorted."""
    n_test = min(max(1, int(np.ceil(n * test_fraction))), n - 1)
    perm = np.random.default_rng([seed, 0x53504C]).permutation(n)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


# The validation split's stream tag: apart from the test split's, so that holding out a
# validation split never changes which samples are the test set.
_TAG_HOLDOUT = 0x7A1


def holdout_ids(n: int, fraction: float, seed: int,
                field: str = "dataset.validation") -> tuple[np.ndarray, np.ndarray]:
    """A seeded validation split of ``range(n)``: (kept, held out) ids, each sorted;
    ``round(n·fraction)`` held out, at least one. The same ``seed`` always holds out the same
    samples (the job's seed: a resumed job and every worker hold out the same ones); the
    simulator's tuning holdout is this split too. A fraction that leaves no sample to train
    is a DataError naming ``field``."""
    if not 0 < fraction < 1:
        raise DataError(f"{field}: a fraction of the training samples must be in (0, 1), "
                        f"got {fraction}")
    n_val = max(1, round(n * fraction))
    if n_val >= n:
        raise DataError(f"{field}: {fraction} of {n} training samples leaves none to train")
    perm = np.random.default_rng([seed, _TAG_HOLDOUT]).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def augment_keys(seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """One 63-bit seed per sample from (job seed, epoch, order position): splitmix64 of
    the three, so neighbouring positions draw unrelated augmentations."""
    with np.errstate(over="ignore"):
        base = _mix(np.array([seed], dtype=np.uint64))[0] ^ _mix(
            np.array([epoch + 0x9E3779B9], dtype=np.uint64))[0]
        z = _mix(np.asarray(positions, dtype=np.uint64) + base)
    return (z >> np.uint64(1)).astype(np.int64)

"""Opening the job's data: which source a spec names, its train, validation and test splits,
and the picklable recipe (:class:`DataRef`) a worker opens its own copy of the source from.

In-memory datasets travel as arrays through the object store; file-backed sources and
map-style datasets travel as a :class:`DataRef`, and each worker reads only the samples it
trains. How splits and ``dataset.validation`` are chosen: docs/spec.md ("Data read by
position", and ``validation`` in the schema).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from dynabatch.actors.data.source import (
    ArraySource,
    DataError,
    Meta,
    Range,
    Source,
    Subset,
    holdout_ids,
    split_ids,
)
from dynabatch.actors.spec import DatasetSpec
from dynabatch.actors.workloads import check_option_names

if TYPE_CHECKING:
    from dynabatch.actors.data.arrow import ParquetSource
    from dynabatch.actors.data.files import ImageFolderSource, NpySource

FILE_KINDS = ("parquet", "npy", "imagefolder")


@dataclass(frozen=True)
class DataRef:
    """How a worker opens one split of a file-backed or map-style dataset."""

    spec: DatasetSpec
    seed: int
    split: str  # train | validation | test
    extra: dict[str, Any] = field(default_factory=dict)

    def open(self) -> Source:
        return open_source(self.spec, self.seed, self.split, self.extra)


def _source_class(
    name: str,
) -> type[ParquetSource] | type[NpySource] | type[ImageFolderSource]:
    """The source class of the file kind ``name`` (imported here: pyarrow only for parquet)."""
    if name == "parquet":
        from dynabatch.actors.data.arrow import ParquetSource

        return ParquetSource
    from dynabatch.actors.data.files import ImageFolderSource, NpySource

    return NpySource if name == "npy" else ImageFolderSource


def check_file_options(spec: DatasetSpec) -> None:
    """Raise a DataError naming the first of ``dataset.options`` that the file kind (parquet,
    npy, imagefolder) does not take, from its source's ``OPTIONS`` and without opening a
    file: ``dynabatch run`` and the service call it before a job starts, and the job before
    it opens the files. Any other dataset name is not checked here."""
    if spec.name not in FILE_KINDS:
        return
    check_option_names("dataset.options", spec.name, spec.options,
                       _source_class(spec.name).OPTIONS, DataError)


def _base(spec: DatasetSpec, path: str, extra: dict[str, Any]) -> Source:
    check_file_options(spec)
    opts = dict(spec.options)
    if spec.num_classes is not None and spec.name != "imagefolder":
        opts.setdefault("num_classes", spec.num_classes)
    if spec.targets is not None and spec.name != "imagefolder":
        opts.setdefault("targets", spec.targets)
    cls = _source_class(spec.name)
    if spec.name == "imagefolder":
        return cls(path, opts, spec.name, classes=extra.get("classes"))
    if spec.name == "parquet":  # list columns of any length, batched by dataset.collate
        return cls(path, opts, spec.name, collate=spec.collate)
    return cls(path, opts, spec.name)


def open_source(spec: DatasetSpec, seed: int, split: str,
                extra: dict[str, Any] | None = None, result: Any = None) -> Source:
    """One split (train, validation, test) of a file-backed or map-style dataset
    (``dataset.limit`` applied to train, before a validation fraction is held out of it).
    ``result``: what the map-style loader returned, when it was called already."""
    fraction = spec.validation_fraction
    if split == "test" or (split == "validation" and fraction is None):
        return _open_split(spec, seed, split, extra or {}, result)
    train = _open_split(spec, seed, "train", extra or {}, result)
    if spec.limit is not None and spec.limit < len(train):
        train = Range(train, 0, spec.limit)
    if fraction is None:
        return train
    keep, held = holdout_ids(len(train), fraction, seed)
    return Subset(train, keep if split == "train" else held)


def _validation_path(spec: DatasetSpec, fs: Any, root: str) -> str:
    """Where a file source's named validation split is: its own path (one with a ``/`` or
    a URI), or the file or folder of that name beside train and test under ``path``."""
    from dynabatch.actors.data.fs import child, is_uri

    name = str(spec.validation)
    if "/" in name or is_uri(name):
        return name
    if child(fs, root, name) is None:
        raise DataError(f"dataset.validation: no split {name!r} under {spec.path} (a file "
                        f"or folder {name} beside train and test)")
    return spec.path.rstrip("/") + "/" + name


def _open_split(spec: DatasetSpec, seed: int, split: str, extra: dict[str, Any],
                result: Any = None) -> Source:
    if spec.name in FILE_KINDS:
        from dynabatch.actors.data.fs import child, open_fs

        if spec.path is None:
            raise DataError(f"dataset.path: {spec.name} needs a path (a file, a directory or "
                            "a URI)")
        fs, root = open_fs(spec.path)
        if split == "validation":
            return _base(spec, _validation_path(spec, fs, root), extra)
        parts = (child(fs, root, "train"), child(fs, root, "test"))
        if parts[0] is not None and parts[1] is not None:
            where = spec.path.rstrip("/") + "/" + split
            return _base(spec, where, extra)
        whole = _base(spec, spec.path, extra)
        if spec.name == "imagefolder":
            tr, te = split_ids(len(whole), spec.test_fraction, seed)
            return Subset(whole, tr if split == "train" else te)
        n = len(whole)
        n_test = min(max(1, int(np.ceil(n * spec.test_fraction))), n - 1)
        return Range(whole, 0, n - n_test) if split == "train" else Range(whole, n - n_test, n)
    from dynabatch.actors.data.mapstyle import open_map
    from dynabatch.actors.workloads.imports import call_user, resolve_callable

    if result is None:
        fn = resolve_callable(spec.name, "dataset.name")
        result = call_user(fn, spec.name, "dataset.name", **spec.options)
    if split == "validation":
        return named_split(result, spec, open_map(result, spec.name, "train", seed,
                                                  spec.test_fraction, spec.num_classes,
                                                  spec.targets, spec.collate).meta)
    return open_map(result, spec.name, split, seed, spec.test_fraction, spec.num_classes,
                    spec.targets, spec.collate)


def named_split(result: Any, spec: DatasetSpec, meta: Meta) -> Source:
    """The split ``dataset.validation`` names of a map-style loader's return value: a key of
    its dict (an HF-style ``{"train", "validation", "test"}``)."""
    from dynabatch.actors.data.mapstyle import MapSource, is_map_style

    name = str(spec.validation)
    if not isinstance(result, dict):
        raise DataError(f"dataset.validation: {spec.name!r} returned one dataset or a pair, "
                        f"which has no split {name!r}: return a dict of splits, or give a "
                        "fraction of train")
    if name not in result or not is_map_style(result[name]):
        found = ", ".join(sorted(str(k) for k in result))
        raise DataError(f"dataset.validation: {spec.name!r} returned no split {name!r} "
                        f"(its splits: {found})")
    return MapSource(result[name], spec.name, meta, collate=spec.collate)


@dataclass
class Opened:
    """The job's data as the driver opened it."""

    name: str
    meta: Meta
    train: Source
    test: Source
    arrays: Any = None  # DatasetArrays for in-memory datasets (x_train without validation)
    refs: tuple[DataRef, DataRef] | None = None  # for file-backed and map-style ones
    # dataset.validation's split, when the job has one: its source, and its ref (file-backed
    # and map-style) or its (x, y) arrays (in memory).
    validation: Source | None = None
    validation_ref: DataRef | None = None
    validation_arrays: tuple[Any, Any] | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.meta.sample_shape

    @property
    def num_classes(self) -> int:
        return self.meta.num_classes


def from_arrays(ds: Any, spec: DatasetSpec | None = None, seed: int = 0) -> Opened:
    """In-memory data as opened data; ``spec``'s validation fraction held out of train."""
    import dataclasses

    from dynabatch.actors.workloads.objective import targets_kind

    meta = Meta(ds.name, tuple(ds.input_shape), ds.num_classes, targets_kind(ds.y_train),
                tuple(ds.y_train.shape[1:]))
    val = None
    if spec is not None and spec.validation is not None:
        if spec.validation_fraction is None:
            raise DataError(f"dataset.validation: {spec.name} is in memory, with no split "
                            f"named {spec.validation!r}: give a fraction of train (e.g. 0.1)")
        keep, held = holdout_ids(len(ds.y_train), spec.validation_fraction, seed)
        val = (ds.x_train[held], ds.y_train[held])
        ds = dataclasses.replace(ds, x_train=ds.x_train[keep], y_train=ds.y_train[keep])
    return Opened(ds.name, meta, ArraySource(ds.x_train, ds.y_train, meta),
                  ArraySource(ds.x_test, ds.y_test, meta), arrays=ds,
                  validation=ArraySource(*val, meta) if val is not None else None,
                  validation_arrays=val)


def open_dataset(spec: DatasetSpec, seed: int = 0) -> Opened:
    """The job's data: arrays for in-memory datasets, sources and refs for the others."""
    from dynabatch.actors.workloads.datasets import BUILTIN_DATASETS, load_dataset, user_arrays

    if spec.collate is not None and spec.name in (*BUILTIN_DATASETS, "npy", "imagefolder"):
        raise DataError(f"dataset.collate: {spec.name} samples are not collated; only a "
                        "map-style dataset's and Parquet rows are")
    if spec.name in BUILTIN_DATASETS:
        return from_arrays(load_dataset(spec, seed), spec, seed)
    result, extra = None, {}
    if spec.name in FILE_KINDS:
        train = open_source(spec, seed, "train")
        base = train
        while isinstance(base, Subset | Range):
            base = base.base
        if spec.name == "imagefolder":  # the test split's classes are the training set's
            extra = {"classes": base.classes}
    else:
        from dynabatch.actors.data.mapstyle import split_result
        from dynabatch.actors.workloads.imports import (
            call_user,
            check_user_options,
            resolve_callable,
        )

        fn = resolve_callable(spec.name, "dataset.name")
        check_user_options(fn, spec.name, "dataset.options", spec.options)
        result = call_user(fn, spec.name, "dataset.name", **spec.options)
        if split_result(result) is None:
            if spec.collate is not None:
                raise DataError(f"dataset.collate: {spec.name!r} returned arrays, not a "
                                "map-style dataset (len and __getitem__): there are no "
                                "samples to collate")
            return from_arrays(user_arrays(spec, result, seed), spec, seed)
        train = open_source(spec, seed, "train", extra, result)
    test = open_source(spec, seed, "test", extra, result)
    refs = (DataRef(spec, seed, "train", extra), DataRef(spec, seed, "test", extra))
    opened = Opened(spec.name, train.meta, train, test, refs=refs)
    if spec.validation is not None:
        opened.validation = open_source(spec, seed, "validation", extra, result)
        opened.validation_ref = DataRef(spec, seed, "validation", dict(extra))
    return opened


def materialise(spec: DatasetSpec, seed: int = 0) -> Any:
    """Every sample in memory as ``DatasetArrays`` (the simulator and ``protocol: ps``,
    which do not read by position): for small sets only."""
    from dynabatch.actors.workloads.datasets import DatasetArrays

    # The train and test splits whole: a validation fraction is held out by the caller
    # (the simulator's GradientEngine), from these arrays.
    o = open_dataset(spec.model_copy(update={"validation": None}), seed)
    if o.arrays is not None:
        return o.arrays
    if o.meta.structured:
        field = "dataset.collate" if spec.collate is not None else "dataset.name"
        raise DataError(f"{field}: {spec.name!r} has dict or tuple inputs or a collate, which "
                        "train only read by position (protocol: sync), not in memory")
    xs = [s.read(np.arange(len(s))) for s in (o.train, o.test)]
    return DatasetArrays(o.name, xs[0][0], xs[0][1], xs[1][0], xs[1][1], o.meta.num_classes,
                         targets=o.meta.targets)

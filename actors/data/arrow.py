"""Parquet (and Arrow-written Parquet: Ray Data, pandas, Hugging Face ``datasets``), read by
row group, never whole, decoded groups kept in a small LRU cache (``cache_groups``). Its
options, the forms of ``x``, variable-length lists with ``dataset.collate`` and the block order
that decodes each group about once per epoch per worker: docs/spec.md ("Data read by position").
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
from dynabatch.actors.data.fs import list_files, open_fs
from dynabatch.actors.data.source import (
    DataError,
    Out,
    Source,
    batch_arrays,
    file_meta,
    x_dtype,
    y_dtype,
)
from dynabatch.actors.errors import first_line

SUFFIXES = (".parquet", ".pq", ".parq")
MAX_GROUP_BYTES = 512 << 20


def decode_image(blob: bytes, where: str) -> np.ndarray:
    """Encoded image bytes -> uint8 (H, W) or (H, W, C); DataError naming ``where``."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(blob)) as im:
            return np.asarray(im.convert("L" if im.mode in ("1", "L", "I;16") else "RGB"))
    except Exception as err:
        raise DataError(f"{where}: cannot decode image ({first_line(err)})") from err


def _column_array(col: Any, where: str, ragged: bool = False) -> np.ndarray:
    """One Arrow column (a ChunkedArray) as a numpy array (n, ...); with ``ragged``, a list
    column whose rows differ in length is an object array of n 1-D arrays (views)."""
    import pyarrow as pa

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    n = len(arr)
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        arr, t = arr.field("bytes"), arr.field("bytes").type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or \
            pa.types.is_fixed_size_binary(t):
        if n and bytes(arr[0].as_py()[:4]) in (b"\x89PNG", b"\xff\xd8\xff\xe0",
                                                b"\xff\xd8\xff\xe1", b"\xff\xd8\xff\xdb"):
            imgs = [decode_image(arr[i].as_py(), f"{where} row {i}") for i in range(n)]
            return _stack_images(imgs, where)
        if pa.types.is_fixed_size_binary(t):
            w = t.byte_width
            data = np.frombuffer(arr.buffers()[1], dtype=np.uint8)
            return data[arr.offset * w:(arr.offset + n) * w].reshape(n, w)
        off_t = np.int64 if pa.types.is_large_binary(t) else np.int32
        offsets = np.frombuffer(arr.buffers()[1], dtype=off_t)[arr.offset:arr.offset + n + 1]
        lengths = np.diff(offsets)
        if n and (lengths != lengths[0]).any():
            k = int(np.flatnonzero(lengths != lengths[0])[0])
            raise DataError(f"{where} row {k}: {int(lengths[k])} bytes, but row 0 has "
                            f"{int(lengths[0])}")
        data = np.frombuffer(arr.buffers()[2], dtype=np.uint8)
        return data[offsets[0]:offsets[-1]].reshape(n, int(lengths[0]) if n else 0)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        lengths = (np.full(n, t.list_size) if pa.types.is_fixed_size_list(t)
                   else arr.value_lengths().to_numpy(zero_copy_only=False))
        if ragged and n and (lengths != lengths[0]).any():
            return _ragged(_column_array(arr.flatten(), where), lengths)
        if n and (lengths != lengths[0]).any():
            k = int(np.flatnonzero(lengths != lengths[0])[0])
            raise DataError(f"{where} row {k}: {int(lengths[k])} values, but row 0 has "
                            f"{int(lengths[0])} (lists of different lengths need a "
                            "dataset.collate that pads them)")
        inner = _column_array(arr.flatten(), where)
        return inner.reshape(n, *((int(lengths[0]),) if n else (0,)), *inner.shape[1:])
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return arr.to_numpy(zero_copy_only=False)
    raise DataError(f"{where}: column type {t} is not numbers, bytes, images or lists")


def _ragged(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Rows of ``lengths`` values each, as an object array of views into ``values``."""
    ends = np.cumsum(lengths)
    out = np.empty(len(lengths), dtype=object)
    for i, (a, b) in enumerate(zip(ends - lengths, ends, strict=True)):
        out[i] = values[a:b]
    return out


def _stack_images(imgs: list[np.ndarray], where: str) -> np.ndarray:
    for i, im in enumerate(imgs):
        if im.shape != imgs[0].shape:
            raise DataError(f"{where} row {i}: image of shape {im.shape}, but row 0 has "
                            f"{imgs[0].shape}")
    out = np.stack(imgs) if imgs else np.zeros((0, 1, 1), np.uint8)
    return out[:, None] if out.ndim == 3 else out.transpose(0, 3, 1, 2)


def _rows_typed(col: np.ndarray, scale: float | None, meta: Any,
                target: bool = False) -> np.ndarray:
    """A column of rows (an object array, or a numeric one) as an object array of rows in
    the dtypes a sample has: integers int64 (token ids, labels), floats float32 (scaled
    by ``scale`` when given); a target by ``meta``'s kind once it is known."""
    out = np.empty(len(col), dtype=object)
    for i, row in enumerate(col):
        row = np.asarray(row)
        if target and meta is not None:
            row = row.astype(y_dtype(meta.targets))
        elif row.dtype.kind in "iub":
            row = row.astype(np.int64)
        else:
            row = row.astype(np.float32) * np.float32(scale if scale is not None else 1.0)
        out[i] = row
    return out


class ParquetSource(Source):
    # The options it reads: the one table of them (dynabatch.actors.data.open.
    # check_file_options refuses any other, before Ray starts and when the job opens it).
    OPTIONS = ("x", "y", "shape", "scale", "targets", "num_classes", "cache_groups")

    def __init__(self, path: str, options: dict[str, Any], name: str = "parquet",
                 collate: str | None = None):
        import pyarrow.parquet as pq
        from dynabatch.actors.data.structured import load_collate

        # dataset.collate: rows may be lists of any length, batched by the user's function.
        self.collate_path, self._collate = collate, load_collate(collate)

        opts = dict(options)
        x = opts.pop("x", "image")
        self.xcols = [x] if isinstance(x, str) else list(x)
        self.ycol = str(opts.pop("y", "label"))
        shape = opts.pop("shape", None)
        self.shape = tuple(int(s) for s in shape) if shape is not None else None
        self.scale = opts.pop("scale", None)
        targets = opts.pop("targets", None)
        num_classes = opts.pop("num_classes", None)
        self.cache_groups = int(opts.pop("cache_groups", 24))
        self.fs, root = open_fs(path)
        self.files = list_files(self.fs, root, SUFFIXES)
        self._pq = pq
        # File handles per reading thread: the loader's threads read row groups at once
        # (pyarrow releases the GIL), and a ParquetFile is not shared between threads.
        self._local = threading.local()
        self._handles: list[dict[int, Any]] = []  # every thread's, for close()
        self._lock = threading.Lock()
        # One decode per row group: a thread wanting a group another is decoding waits.
        self._decoding: dict[tuple[int, int], threading.Lock] = {}
        self._cache: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        groups, sizes, ymax = [], [], -1
        for f_i, f in enumerate(self.files):
            pf = self._file(f_i)
            names = pf.schema_arrow.names
            for c in [*self.xcols, self.ycol]:
                if c not in names:
                    field = "dataset.options.y" if c == self.ycol else "dataset.options.x"
                    raise DataError(f"{field}: no column {c!r} in {f}; its columns: "
                                    f"{', '.join(names)}")
            md = pf.metadata
            yi = names.index(self.ycol)
            for g in range(md.num_row_groups):
                rg = md.row_group(g)
                if rg.total_byte_size > MAX_GROUP_BYTES:
                    raise DataError(
                        f"dataset.path: {f}: row group {g} holds {rg.total_byte_size >> 20} MiB; "
                        "write smaller row groups (e.g. pyarrow.parquet.write_table(t, f, "
                        "row_group_size=2048)) so a worker can read by row")
                groups.append((f_i, g))
                sizes.append(rg.num_rows)
                st = rg.column(yi).statistics if yi < rg.num_columns else None
                if st is not None and st.has_min_max and isinstance(st.max, int | np.integer):
                    ymax = max(ymax, int(st.max))
        self.groups = groups
        self.starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self.n = int(self.starts[-1])
        if self.n == 0:
            raise DataError(f"dataset.path: {path}: no rows")
        self.block = int(np.median(sizes))
        x0, y0 = self._group(0)
        if collate is not None:  # the first row's own shapes, which other rows need not share
            x0, y0 = x0[0][None], y0[0][None]
        # Without statistics the label column is read once (the driver only).
        self.meta = file_meta(name, x0, y0, targets, num_classes, lambda: ymax if ymax >= 0
                              else max(int(self._file(i).read(columns=[self.ycol]).column(0)
                                           .to_numpy().max()) for i in range(len(self.files))),
                              structured=collate is not None)
        self._cache.clear()  # group 0 was decoded before the targets' dtype was known

    def _file(self, i: int) -> Any:
        opened = getattr(self._local, "open", None)
        if opened is None:
            opened = self._local.open = {}
            with self._lock:
                self._handles.append(opened)
        pf = opened.get(i)
        if pf is None:
            f = self.files[i]
            try:
                pf = self._pq.ParquetFile(self.fs.open_input_file(f))
            except Exception as err:
                raise DataError(f"dataset.path: {f}: not a readable Parquet file "
                                f"({first_line(err)})") from err
            opened[i] = pf
        return pf

    def __len__(self) -> int:
        return self.n

    def _group(self, gi: int) -> tuple[np.ndarray, np.ndarray]:
        key = self.groups[gi]
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            busy = self._decoding.setdefault(key, threading.Lock())
        with busy:
            with self._lock:
                hit = self._cache.get(key)  # decoded by another thread meanwhile
            if hit is not None:
                return hit
            try:
                return self._decode(key)
            finally:
                with self._lock:
                    self._decoding.pop(key, None)

    def _decode(self, key: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        f_i, g = key
        where = f"{self.files[f_i]} row group {g}"
        try:
            table = self._file(f_i).read_row_group(g, columns=[*self.xcols, self.ycol])
        except DataError:
            raise
        except Exception as err:
            raise DataError(f"dataset.path: {where}: cannot read ({first_line(err)})") from err
        ragged = self.collate_path is not None
        if len(self.xcols) == 1:
            x = _column_array(table.column(self.xcols[0]), f"{where} column {self.xcols[0]}",
                              ragged)
        else:
            x = np.stack([_column_array(table.column(c), f"{where} column {c}")
                          for c in self.xcols], axis=1)
        y = _column_array(table.column(self.ycol), f"{where} column {self.ycol}", ragged)
        kind = getattr(self, "meta", None)
        if ragged:  # rows of their own lengths (or not), typed one by one
            x, y = _rows_typed(x, self.scale, kind), _rows_typed(y, None, kind, target=True)
            return self._cached(key, x, y)
        scale = self.scale if self.scale is not None else (
            1 / 255 if x.dtype == np.uint8 else 1.0)
        tokens = kind is not None and kind.targets == "tokens"
        x = x.astype(x_dtype("tokens" if tokens else "classes"))
        if not tokens and scale != 1.0:
            x *= np.float32(scale)
        if self.shape is not None:
            if int(np.prod(self.shape)) != int(np.prod(x.shape[1:])):
                raise DataError(f"dataset.options.shape: {list(self.shape)} does not fit a "
                                f"sample of {int(np.prod(x.shape[1:]))} values in {where}")
            x = x.reshape(len(x), *self.shape)
        if kind is not None:
            y = y.astype(y_dtype(kind.targets))
        return self._cached(key, x, y)

    def _cached(self, key: tuple[int, int], x: np.ndarray, y: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)``, kept as row group ``key``'s in the LRU cache."""
        with self._lock:
            self._cache[key] = (x, y)
            while len(self._cache) > max(1, self.cache_groups):
                self._cache.popitem(last=False)
        return x, y

    def read(self, ids: np.ndarray, keys: np.ndarray | None = None,
             out: Out | None = None) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.n):
            raise DataError(f"sample ids outside 0..{self.n - 1}")
        if self.meta.structured:
            return self.collate(self.read_samples(ids, keys), ids)
        gi = np.searchsorted(self.starts, ids, side="right") - 1
        m = self.meta
        x, y = batch_arrays(m, len(ids), out)
        for g in np.unique(gi):
            sel = np.flatnonzero(gi == g)
            gx, gy = self._group(int(g))
            rows = ids[sel] - self.starts[g]
            if gx.shape[1:] != m.sample_shape:
                raise DataError(f"{self.files[self.groups[g][0]]}: samples of shape "
                                f"{gx.shape[1:]}, but the first sample has {m.sample_shape}")
            x[sel], y[sel] = gx[rows], gy[rows]
        return x, y

    def read_samples(self, ids: np.ndarray, keys: np.ndarray | None = None) -> list[Any]:
        """Rows ``ids`` as ``(input, target)`` tensors, each of its own length."""
        import torch

        ids = np.asarray(ids, dtype=np.int64)
        gi = np.searchsorted(self.starts, ids, side="right") - 1
        out: list[Any] = [None] * len(ids)
        for g in np.unique(gi):
            gx, gy = self._group(int(g))
            for j in np.flatnonzero(gi == g):
                r = int(ids[j] - self.starts[g])
                out[j] = (torch.from_numpy(np.array(gx[r])), torch.as_tensor(np.array(gy[r])))
        return out

    def collate(self, samples: list[Any], ids: np.ndarray) -> tuple[Any, Any]:
        from dynabatch.actors.data.structured import collate_share

        return collate_share(samples, ids, self._collate, self.collate_path, "dataset.path",
                             self.meta)

    def close(self) -> None:
        with self._lock:
            self._cache.clear()
            for opened in self._handles:
                opened.clear()

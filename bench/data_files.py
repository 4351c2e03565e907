"""Writing arrays as the files the data sources read, for benchmarks and tests:
MNIST-format Parquet, ``.npy`` shards and image folders (also
``examples/make_imagefolder.py``'s)."""

from __future__ import annotations

import os

import numpy as np


def write_parquet(path: str, x: np.ndarray, y: np.ndarray, row_group_size: int = 1024,
                  rows_per_file: int | None = None) -> list[str]:
    """uint8 images (N, ...) as a fixed-length ``image`` bytes column and ``label``, in
    files ``part-00000.parquet`` ... under the directory ``path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(path, exist_ok=True)
    n = len(y)
    per = rows_per_file or n
    files = []
    for k, s in enumerate(range(0, n, per)):
        e = min(s + per, n)
        xs = np.ascontiguousarray(x[s:e]).reshape(e - s, -1)
        width = xs.shape[1] * xs.dtype.itemsize
        col = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), e - s,
                                                   [None, pa.py_buffer(xs.tobytes())])
        table = pa.table({"image": col, "label": pa.array(np.asarray(y[s:e], np.int64))})
        f = os.path.join(path, f"part-{k:05d}.parquet")
        pq.write_table(table, f, row_group_size=row_group_size, compression="none")
        files.append(f)
    return files


def write_imagefolder(path: str, x: np.ndarray, y: np.ndarray, classes: list[str] | None = None
                      ) -> None:
    """uint8 images (N, H, W) or (N, H, W, C) as ``path/<class>/<i>.png``, the layout the
    ``imagefolder`` source reads."""
    from PIL import Image

    names = classes or [str(c) for c in range(int(np.max(y)) + 1)]
    for c in names:
        os.makedirs(os.path.join(path, c), exist_ok=True)
    for i, (img, label) in enumerate(zip(x, y, strict=True)):
        Image.fromarray(np.asarray(img, np.uint8)).save(
            os.path.join(path, names[int(label)], f"{i:06d}.png"))


def write_npy(path: str, x: np.ndarray, y: np.ndarray, shards: int = 2) -> None:
    """Inputs and labels as ``shards`` pairs ``x-000.npy``/``y-000.npy`` ... under ``path``."""
    os.makedirs(path, exist_ok=True)
    for k, idx in enumerate(np.array_split(np.arange(len(y)), shards)):
        np.save(os.path.join(path, f"x-{k:03d}.npy"), x[idx])
        np.save(os.path.join(path, f"y-{k:03d}.npy"), y[idx])

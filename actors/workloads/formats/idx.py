"""IDX files (MNIST's format): decode and read, gzip or not. A big-endian magic ``00 00
<type> <ndim>``, ``ndim`` big-endian uint32 sizes, then the data in C order."""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from dynabatch.actors.workloads.formats import FormatError

IDX_TYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"

MNIST_IMAGES_MAGIC = 0x00000803
MNIST_LABELS_MAGIC = 0x00000801


def _describe_magic(magic: int) -> str:
    dt = IDX_TYPES.get((magic >> 8) & 0xFF)
    kind = {"u": "unsigned", "i": "signed", "f": "float"}[dt.kind] if dt is not None else "?"
    what = f"{kind} {dt.itemsize * 8}-bit" if dt is not None else "unknown type"
    return f"0x{magic:08x}: {what}, {magic & 0xFF} dimensions"


def decode_idx(data: bytes, source: str = "<bytes>", magic: int | None = None) -> np.ndarray:
    """Parse IDX bytes into a native-endian array, validating the header against the size.

    ``magic``, when given, is the exact magic the data must have (e.g. ``0x00000803``).
    """
    if len(data) < 4:
        raise FormatError(f"{source}: truncated: {len(data)} bytes, an IDX header needs 4")
    (found,) = struct.unpack(">I", data[:4])
    if data[:2] != b"\0\0":
        raise FormatError(
            f"{source}: bad magic 0x{found:08x}: not an IDX file (IDX starts with two zero bytes)"
        )
    type_code, ndim = data[2], data[3]
    if type_code not in IDX_TYPES:
        raise FormatError(f"{source}: bad magic 0x{found:08x}: unknown IDX type 0x{type_code:02x}")
    if magic is not None and found != magic:
        raise FormatError(f"{source}: bad magic 0x{found:08x} (expected {_describe_magic(magic)})")
    if ndim == 0:
        raise FormatError(f"{source}: bad magic 0x{found:08x}: 0 dimensions")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise FormatError(
            f"{source}: truncated header: {ndim} dimensions need {header_len} bytes, "
            f"file has {len(data)}"
        )
    shape = struct.unpack(f">{ndim}I", data[4:header_len])
    dtype = IDX_TYPES[type_code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    body = len(data) - header_len
    if body < expected:
        raise FormatError(
            f"{source}: truncated: header declares shape {shape} ({expected} bytes of data), "
            f"file has {body}"
        )
    if body > expected:
        raise FormatError(
            f"{source}: {body - expected} unexpected bytes after the data of shape {shape}"
        )
    arr = np.frombuffer(data, dtype=dtype, count=expected // dtype.itemsize, offset=header_len)
    # A native-endian copy: frombuffer over bytes is read-only and big-endian.
    return arr.reshape(shape).astype(dtype.newbyteorder("="))


def _read_maybe_gzip(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise FormatError(f"{path}: cannot read ({err.strerror or err})") from err
    # Sniff rather than trust the suffix: IDX starts with 00 00 and gzip with 1f 8b.
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as err:
        raise FormatError(f"{path}: corrupt or truncated gzip data ({err})") from err


# MNIST ---------------------------------------------------------------------------------------

MNIST_FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def read_mnist(directory: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The four MNIST IDX files in ``directory`` (or in its ``MNIST/raw``, torchvision's
    layout), decoded and cross-checked: uint8 images (N, H, W) and uint8 labels (N,) for
    train and test."""
    root = Path(directory)
    if not root.is_dir():
        raise FormatError(f"{root}: not a directory")
    src: dict[str, str] = {}
    out: dict[str, np.ndarray] = {}
    for key, stem in MNIST_FILES.items():
        # Some mirrors spell the files "train-images.idx3-ubyte"; accept both, each plain or .gz.
        dotted = stem.replace("-idx", ".idx")
        names = (stem, f"{stem}.gz", dotted, f"{dotted}.gz")
        path = next((d / n for d in (root, root / "MNIST" / "raw") for n in names
                     if (d / n).is_file()), None)
        if path is None:
            raise FormatError(f"{root}: no {stem} (or {stem}.gz) in this directory")
        src[key] = str(path)
        magic = MNIST_IMAGES_MAGIC if key.endswith("images") else MNIST_LABELS_MAGIC
        out[key] = decode_idx(_read_maybe_gzip(path), source=src[key], magic=magic)
    for split in ("train", "test"):
        images, labels = out[f"{split}_images"], out[f"{split}_labels"]
        if len(images) != len(labels):
            raise FormatError(
                f"{src[f'{split}_labels']}: {len(labels)} labels but "
                f"{src[f'{split}_images']} has {len(images)} images"
            )
        if len(images) == 0:
            raise FormatError(f"{src[f'{split}_images']}: no images")
        if labels.max() > 9:
            raise FormatError(
                f"{src[f'{split}_labels']}: label {int(labels.max())} is out of range 0..9"
            )
    if out["train_images"].shape[1:] != out["test_images"].shape[1:]:
        raise FormatError(
            f"{src['test_images']}: images are {out['test_images'].shape[1:]} but training "
            f"images are {out['train_images'].shape[1:]}"
        )
    return out["train_images"], out["train_labels"], out["test_images"], out["test_labels"]

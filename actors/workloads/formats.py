"""Readers and writers for the on-disk dataset formats: IDX (MNIST) and CIFAR-10 python batches.

The writers produce byte-exact versions of the published formats, so tests and benchmarks can
make small files that go through the very same readers as the real datasets.

IDX: a 4-byte big-endian magic ``00 00 <type> <ndim>``, then ``ndim`` big-endian uint32 sizes,
then the data in C order, big-endian. MNIST images are ``0x00000803`` (ubyte, N x 28 x 28) and
labels ``0x00000801`` (ubyte, N); files may be gzip-compressed.

CIFAR-10 (python version): ``data_batch_1`` .. ``data_batch_5`` and ``test_batch`` are pickled
dicts with bytes keys, ``b"data"`` a uint8 array (N, 3072) holding the R, G and B planes of each
32x32 image, and ``b"labels"`` a list of ints; ``batches.meta`` holds ``b"label_names"``.
"""

from __future__ import annotations

import codecs
import gzip
import pickle
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from dynabatch.actors.workloads import WorkloadError


class FormatError(WorkloadError):
    """A file that is not valid in its format; the message starts with the file name."""


# --------------------------------------------------------------------------------------------
# IDX

IDX_TYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {(dt.kind, dt.itemsize): code for code, dt in IDX_TYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"

MNIST_IMAGES_MAGIC = 0x00000803
MNIST_LABELS_MAGIC = 0x00000801


def idx_magic(dtype: np.dtype[Any] | type, ndim: int) -> int:
    """The magic number an IDX file of this element type and rank starts with."""
    dt = np.dtype(dtype)
    code = _IDX_CODES.get((dt.kind, dt.itemsize))
    if code is None:
        raise ValueError(
            f"IDX cannot store dtype {dt} (use uint8, int8, int16, int32, float32 or float64)"
        )
    if not 1 <= ndim <= 255:
        raise ValueError(f"IDX stores 1 to 255 dimensions, not {ndim}")
    return (code << 8) | ndim


def encode_idx(array: np.ndarray) -> bytes:
    """The IDX bytes of ``array`` (uncompressed)."""
    arr = np.asarray(array)
    magic = idx_magic(arr.dtype, arr.ndim)
    if any(n >= 2**32 for n in arr.shape):
        raise ValueError(f"IDX sizes are uint32; shape {arr.shape} does not fit")
    big = arr.astype(IDX_TYPES[magic >> 8], copy=False)
    header = struct.pack(f">I{arr.ndim}I", magic, *arr.shape)
    return header + np.ascontiguousarray(big).tobytes()


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


def read_idx(path: str | Path, magic: int | None = None) -> np.ndarray:
    """Read an IDX file, plain or gzip-compressed (detected from its first bytes)."""
    p = Path(path)
    return decode_idx(_read_maybe_gzip(p), source=str(p), magic=magic)


def write_idx(path: str | Path, array: np.ndarray) -> Path:
    """Write ``array`` as an IDX file; gzip-compressed when the name ends in ``.gz``."""
    p = Path(path)
    data = encode_idx(array)
    if p.suffix == ".gz":
        # mtime=0 keeps the bytes reproducible for a given array.
        data = gzip.compress(data, mtime=0)
    p.write_bytes(data)
    return p


# MNIST ---------------------------------------------------------------------------------------

MNIST_FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}

MnistArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _mnist_candidates(stem: str) -> list[str]:
    # Some mirrors spell the files "train-images.idx3-ubyte"; accept both, each plain or .gz.
    dotted = stem.replace("-idx", ".idx")
    return [stem, f"{stem}.gz", dotted, f"{dotted}.gz"]


def find_mnist_files(directory: str | Path) -> dict[str, Path]:
    """The four MNIST files in ``directory`` (or in its ``MNIST/raw``, torchvision's layout)."""
    root = Path(directory)
    if not root.is_dir():
        raise FormatError(f"{root}: not a directory")
    dirs = [root, root / "MNIST" / "raw"]
    found: dict[str, Path] = {}
    for key, stem in MNIST_FILES.items():
        for d in dirs:
            hit = next((d / n for n in _mnist_candidates(stem) if (d / n).is_file()), None)
            if hit is not None:
                found[key] = hit
                break
        else:
            raise FormatError(f"{root}: no {stem} (or {stem}.gz) in this directory")
    return found


def parse_mnist(blobs: dict[str, bytes], sources: dict[str, str] | None = None) -> MnistArrays:
    """Decode and cross-check the four MNIST IDX blobs (keys as in ``MNIST_FILES``).

    Returns uint8 images (N, H, W) and uint8 labels (N,) for train and test.
    """
    src = {k: (sources or {}).get(k, MNIST_FILES[k]) for k in MNIST_FILES}
    out: dict[str, np.ndarray] = {}
    for key in MNIST_FILES:
        magic = MNIST_IMAGES_MAGIC if key.endswith("images") else MNIST_LABELS_MAGIC
        out[key] = decode_idx(blobs[key], source=src[key], magic=magic)
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


def read_mnist(directory: str | Path) -> MnistArrays:
    """Read the four MNIST IDX files from ``directory``; see :func:`parse_mnist`."""
    files = find_mnist_files(directory)
    blobs = {k: _read_maybe_gzip(p) for k, p in files.items()}
    return parse_mnist(blobs, {k: str(p) for k, p in files.items()})


def encode_mnist(
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray
) -> dict[str, bytes]:
    """The four MNIST IDX blobs (keys as in ``MNIST_FILES``) for uint8 images and labels."""
    arrays = {
        "train_images": x_train,
        "train_labels": y_train,
        "test_images": x_test,
        "test_labels": y_test,
    }
    out = {}
    for key, arr in arrays.items():
        a = np.asarray(arr)
        if a.dtype != np.uint8:
            raise ValueError(f"{key} must be uint8 for MNIST, got {a.dtype}")
        want = 3 if key.endswith("images") else 1
        if a.ndim != want:
            raise ValueError(f"{key} must have {want} dimensions, got shape {a.shape}")
        out[key] = encode_idx(a)
    return out


def write_mnist(
    directory: str | Path,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    gz: bool = False,
) -> dict[str, Path]:
    """Write the four MNIST files (uint8 images (N, H, W), uint8 labels) into ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = {}
    for key, data in encode_mnist(x_train, y_train, x_test, y_test).items():
        p = d / (MNIST_FILES[key] + (".gz" if gz else ""))
        p.write_bytes(gzip.compress(data, mtime=0) if gz else data)
        paths[key] = p
    return paths


# --------------------------------------------------------------------------------------------
# CIFAR-10

CIFAR10_DIRNAME = "cifar-10-batches-py"
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"
CIFAR10_META = "batches.meta"
CIFAR10_LABELS = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
_CIFAR_PIXELS = 3 * 32 * 32

CifarArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _pickle_allowlist() -> dict[tuple[str, str], Any]:
    # Only what numpy arrays and bytes need, under both numpy 1 and numpy 2 module names.
    # Taking the callables from numpy's own reductions avoids importing the deprecated
    # numpy.core aliases (and their warnings) and follows whatever numpy version is installed.
    reconstruct = np.zeros(0).__reduce__()[0]
    frombuffer = np.zeros(1).__reduce_ex__(5)[0]
    scalar = np.float64(0).__reduce__()[0]
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,
        # Protocol 2 writes an empty bytes object as a call to bytes().
        ("__builtin__", "bytes"): bytes,
        ("builtins", "bytes"): bytes,
    }
    for mod in ("numpy.core", "numpy._core"):
        allowed[(f"{mod}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{mod}.multiarray", "scalar")] = scalar
        allowed[(f"{mod}.numeric", "_frombuffer")] = frombuffer
    return allowed


class _ArrayUnpickler(pickle.Unpickler):
    """An unpickler that only builds numpy arrays and plain containers.

    ``spec.path`` comes from users, and a plain ``pickle.load`` of a crafted file runs any
    code it names; the CIFAR batches need nothing beyond arrays, bytes and builtins.
    """

    _allowed = _pickle_allowlist()

    def find_class(self, module: str, name: str) -> Any:
        obj = self._allowed.get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return obj


def _load_pickle(path: Path) -> Any:
    try:
        with path.open("rb") as f:
            return _ArrayUnpickler(f, encoding="bytes").load()
    except OSError as err:
        raise FormatError(f"{path}: cannot read ({err.strerror or err})") from err
    except Exception as err:
        raise FormatError(f"{path}: not a CIFAR-10 python batch (cannot unpickle: {err})") from err


def _get(d: dict[Any, Any], key: str, path: Path) -> Any:
    # The published files have bytes keys; ones re-pickled under Python 3 may have str keys.
    for k in (key.encode(), key):
        if k in d:
            return d[k]
    raise FormatError(f"{path}: missing key b{key!r}")


def read_cifar_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 batch: uint8 images (N, 3, 32, 32) and int64 labels (N,)."""
    p = Path(path)
    d = _load_pickle(p)
    if not isinstance(d, dict):
        raise FormatError(f"{p}: not a CIFAR-10 python batch (a {type(d).__name__}, not a dict)")
    data = np.asarray(_get(d, "data", p))
    labels_raw = _get(d, "labels", p)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _CIFAR_PIXELS:
        raise FormatError(
            f"{p}: b'data' must be uint8 of shape (N, {_CIFAR_PIXELS}), "
            f"got {data.dtype} {data.shape}"
        )
    try:
        labels = np.asarray(labels_raw, dtype=np.int64)
    except (TypeError, ValueError) as err:
        raise FormatError(f"{p}: b'labels' must be a list of ints ({err})") from err
    if labels.ndim != 1 or len(labels) != len(data):
        raise FormatError(f"{p}: {labels.size} labels but {len(data)} images in b'data'")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        bad = int(labels.min() if labels.min() < 0 else labels.max())
        raise FormatError(f"{p}: label {bad} is out of range 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def cifar10_dir(path: str | Path) -> Path:
    """``path/cifar-10-batches-py`` when it exists (the extracted archive), else ``path``."""
    root = Path(path)
    if not root.is_dir():
        raise FormatError(f"{root}: not a directory")
    nested = root / CIFAR10_DIRNAME
    return nested if nested.is_dir() else root


def read_cifar10_meta(directory: str | Path) -> list[str] | None:
    """The class names from ``batches.meta``; None when the file is absent."""
    p = cifar10_dir(directory) / CIFAR10_META
    if not p.is_file():
        return None
    d = _load_pickle(p)
    if not isinstance(d, dict):
        raise FormatError(f"{p}: not a CIFAR-10 meta file (a {type(d).__name__}, not a dict)")
    names = _get(d, "label_names", p)
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def read_cifar10(path: str | Path) -> CifarArrays:
    """All of CIFAR-10: uint8 images (N, 3, 32, 32) and int64 labels, train then test."""
    d = cifar10_dir(path)
    missing = [n for n in (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH) if not (d / n).is_file()]
    if missing:
        raise FormatError(f"{d}: missing CIFAR-10 batch file(s): {', '.join(missing)}")
    names = read_cifar10_meta(d)
    if names is not None and len(names) != len(CIFAR10_LABELS):
        raise FormatError(
            f"{d / CIFAR10_META}: {len(names)} label names, CIFAR-10 has {len(CIFAR10_LABELS)}"
        )
    train = [read_cifar_batch(d / n) for n in CIFAR10_TRAIN_BATCHES]
    x_test, y_test = read_cifar_batch(d / CIFAR10_TEST_BATCH)
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])
    if len(x_train) == 0 or len(x_test) == 0:
        raise FormatError(f"{d}: the {'training' if len(x_train) == 0 else 'test'} set is empty")
    return x_train, y_train, x_test, y_test


def write_cifar_batch(
    path: str | Path, images: np.ndarray, labels: Sequence[int] | np.ndarray, batch_label: str = ""
) -> Path:
    """Write one batch exactly as the published files: a protocol-2 pickle with bytes keys."""
    x = np.asarray(images)
    if x.dtype != np.uint8:
        raise ValueError(f"CIFAR images must be uint8, got {x.dtype}")
    shaped = (x.ndim == 4 and x.shape[1:] == (3, 32, 32)) or (
        x.ndim == 2 and x.shape[1] == _CIFAR_PIXELS
    )
    if not shaped:
        raise ValueError(f"CIFAR images must be (N, 3, 32, 32) or (N, 3072), got {x.shape}")
    data = np.ascontiguousarray(x.reshape(len(x), _CIFAR_PIXELS))
    labs = [int(v) for v in np.asarray(labels).reshape(-1)]
    batch = {
        b"batch_label": batch_label.encode(),
        b"labels": labs,
        b"data": data,
        b"filenames": [f"image_{i:05d}.png".encode() for i in range(len(labs))],
    }
    p = Path(path)
    with p.open("wb") as f:
        pickle.dump(batch, f, protocol=2)
    return p


def write_cifar10(
    directory: str | Path,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    label_names: Sequence[str] = CIFAR10_LABELS,
) -> Path:
    """Write a CIFAR-10 directory (5 training batches, test batch, meta) into ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    x_parts = np.array_split(np.asarray(x_train), len(CIFAR10_TRAIN_BATCHES))
    y_parts = np.array_split(np.asarray(y_train), len(CIFAR10_TRAIN_BATCHES))
    for i, (name, xs, ys) in enumerate(zip(CIFAR10_TRAIN_BATCHES, x_parts, y_parts, strict=True)):
        write_cifar_batch(d / name, xs, ys, f"training batch {i + 1} of 5")
    write_cifar_batch(d / CIFAR10_TEST_BATCH, x_test, y_test, "testing batch 1 of 1")
    meta = {
        b"num_cases_per_batch": len(x_parts[0]),
        b"label_names": [n.encode() for n in label_names],
        b"num_vis": _CIFAR_PIXELS,
    }
    with (d / CIFAR10_META).open("wb") as f:
        pickle.dump(meta, f, protocol=2)
    return d

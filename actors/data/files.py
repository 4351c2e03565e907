"""NumPy ``.npy`` shards (memory-mapped: a read touches only the rows it takes) and image
folders (``path/<class>/<image>``, sorted class names are the labels, decoded with Pillow
into float32 (C, H, W) in [0, 1], then ``options.transforms``). Their options:
docs/spec.md ("Data read by position").
"""

from __future__ import annotations

import fnmatch
import os
from typing import Any

import numpy as np
from dynabatch.actors.data.fs import is_uri, list_files, open_fs
from dynabatch.actors.data.source import (
    DataError,
    Meta,
    Out,
    SampleError,
    Source,
    batch_arrays,
    file_meta,
)
from dynabatch.actors.errors import first_line

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif",
                  ".tiff")


class NpySource(Source):
    # The options it reads: the one table of them (dynabatch.actors.data.open.
    # check_file_options refuses any other, before Ray starts and when the job opens it).
    OPTIONS = ("x", "y", "scale", "num_classes", "targets")

    def __init__(self, path: str, options: dict[str, Any], name: str = "npy"):
        opts = dict(options)
        xpat, ypat = str(opts.pop("x", "x*.npy")), str(opts.pop("y", "y*.npy"))
        self.scale = opts.pop("scale", None)
        num_classes = opts.pop("num_classes", None)
        targets = opts.pop("targets", None)
        if is_uri(path) and not path.startswith("file://"):
            raise DataError(f"dataset.path: npy shards are memory-mapped, so {path!r} must "
                            "be local (or file://)")
        _fs, root = open_fs(path)
        files = list_files(_fs, root, (".npy",))
        base = [os.path.basename(f) for f in files]
        xs = [f for f, b in zip(files, base, strict=True) if fnmatch.fnmatch(b, xpat)]
        ys = [f for f, b in zip(files, base, strict=True) if fnmatch.fnmatch(b, ypat)]
        if not xs or len(xs) != len(ys):
            raise DataError(f"dataset.options.x/y: {len(xs)} shards match {xpat!r} and "
                            f"{len(ys)} match {ypat!r} under {root}; they must pair up")
        self.x, self.y, sizes = [], [], []
        for fx, fy in zip(xs, ys, strict=True):
            try:
                ax, ay = np.load(fx, mmap_mode="r"), np.load(fy, mmap_mode="r")
            except Exception as err:
                raise DataError(f"dataset.path: {fx} or {fy}: not a readable .npy file "
                                f"({first_line(err)})") from err
            if len(ax) != len(ay):
                raise DataError(f"dataset.path: {fx} has {len(ax)} samples but {fy} has "
                                f"{len(ay)}")
            if self.x and ax.shape[1:] != self.x[0].shape[1:]:
                raise DataError(f"dataset.path: {fx} holds samples of shape {ax.shape[1:]}, "
                                f"but {xs[0]} holds {self.x[0].shape[1:]}")
            self.x.append(ax)
            self.y.append(ay)
            sizes.append(len(ax))
        self.files = xs
        self.starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self.meta = file_meta(name, self.x[0], self.y[0], targets, num_classes,
                              lambda: max(int(a.max()) for a in self.y if len(a)))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, ids: np.ndarray, keys: np.ndarray | None = None,
             out: Out | None = None) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        si = np.searchsorted(self.starts, ids, side="right") - 1
        tok = self.meta.targets == "tokens"
        x, y = batch_arrays(self.meta, len(ids), out)
        for s in np.unique(si):
            sel = np.flatnonzero(si == s)
            rows = ids[sel] - self.starts[s]
            order = np.argsort(rows)  # sorted rows: sequential page reads
            part = np.asarray(self.x[s][rows[order]])
            if not tok:
                scale = self.scale if self.scale is not None else (
                    1 / 255 if part.dtype == np.uint8 else 1.0)
                part = part.astype(np.float32) * np.float32(scale)
            x[sel[order]] = part
            y[sel[order]] = self.y[s][rows[order]]
        return x, y


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if np.isscalar(v) else (int(v[0]), int(v[1]))


def _transforms(spec: Any) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for i, t in enumerate(spec or []):
        if isinstance(t, str):
            name, arg = t, {}
        elif isinstance(t, dict) and len(t) >= 1:
            name = next(iter(t))
            v = t[name]
            arg = dict(v) if isinstance(v, dict) else {"size": v}
            arg.update({k: w for k, w in t.items() if k != name})
        else:
            raise DataError(f"dataset.options.transforms.{i}: {t!r} is not a transform name "
                            "or {name: argument}")
        if name not in ("resize", "random_crop", "center_crop", "flip", "grayscale",
                        "normalize"):
            raise DataError(f"dataset.options.transforms.{i}: unknown transform {name!r} "
                            "(resize, random_crop, center_crop, flip, grayscale, normalize)")
        if name in ("resize", "random_crop", "center_crop") and "size" not in arg:
            raise DataError(f"dataset.options.transforms.{i}: {name} needs a size")
        out.append((name, arg))
    return out


def apply_transforms(img: Any, ts: list[tuple[str, dict[str, Any]]], key: int | None
                     ) -> np.ndarray:
    """A PIL image through the transforms -> float32 (C, H, W)."""
    from PIL import Image

    rng = np.random.default_rng(key) if key is not None else None
    arr = None
    for name, a in ts:
        if name == "grayscale":
            img = img.convert("L")
        elif name == "resize":
            h, w = _pair(a["size"])
            img = img.resize((w, h), Image.BILINEAR)
        elif name in ("random_crop", "center_crop"):
            h, w = _pair(a["size"])
            pad = int(a.get("padding", 0))
            if pad:
                canvas = Image.new(img.mode, (img.width + 2 * pad, img.height + 2 * pad))
                canvas.paste(img, (pad, pad))
                img = canvas
            if name == "random_crop" and rng is not None:
                top = int(rng.integers(0, max(0, img.height - h) + 1))
                left = int(rng.integers(0, max(0, img.width - w) + 1))
            else:
                top, left = max(0, img.height - h) // 2, max(0, img.width - w) // 2
            img = img.crop((left, top, left + w, top + h))
        elif name == "flip" and rng is not None and rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
    arr = np.asarray(img, dtype=np.float32) * np.float32(1 / 255)
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    for name, a in ts:
        if name == "normalize":
            c = arr.shape[0]
            mean = np.broadcast_to(np.asarray(a.get("mean", 0.5), np.float32), (c,))
            std = np.broadcast_to(np.asarray(a.get("std", 0.5), np.float32), (c,))
            arr = (arr - mean[:, None, None]) / std[:, None, None]
    return np.ascontiguousarray(arr, dtype=np.float32)


class ImageFolderSource(Source):
    # The options it reads (see NpySource.OPTIONS).
    OPTIONS = ("transforms", "mode")

    def __init__(self, path: str, options: dict[str, Any], name: str = "imagefolder",
                 classes: list[str] | None = None):
        opts = dict(options)
        self.ts = _transforms(opts.pop("transforms", []))
        self.mode = opts.pop("mode", None)
        self.fs, root = open_fs(path)
        files = list_files(self.fs, root, IMAGE_SUFFIXES)
        rel = [f[len(root):].lstrip("/") for f in files]
        found = sorted({r.split("/")[0] for r in rel if "/" in r})
        if not found:
            raise DataError(f"dataset.path: {root} has no class sub-folders of images")
        self.classes = classes or found
        index = {c: i for i, c in enumerate(self.classes)}
        extra = [c for c in found if c not in index]
        if extra:
            raise DataError(f"dataset.path: {root} has class folder {extra[0]!r} that the "
                            f"training folder has not ({', '.join(self.classes)})")
        pairs = [(f, index[r.split("/")[0]]) for f, r in zip(files, rel, strict=True)
                 if "/" in r]
        self.files = [f for f, _ in pairs]
        self.labels = np.array([c for _, c in pairs], dtype=np.int64)
        x0 = self._decode(0, None)
        self.meta = Meta(name, tuple(x0.shape), max(2, len(self.classes)), "classes")

    def __len__(self) -> int:
        return len(self.files)

    def _decode(self, i: int, key: int | None) -> np.ndarray:
        from PIL import Image

        f = self.files[i]
        try:
            with self.fs.open_input_file(f) as fh, Image.open(fh) as im:
                im.load()
                mode = self.mode or ("L" if im.mode in ("1", "L", "I;16", "I") else "RGB")
                img = im.convert(mode)
        except Exception as err:
            raise SampleError(i, f"{f}: cannot decode image ({first_line(err)})") from err
        return apply_transforms(img, self.ts, key)

    def read(self, ids: np.ndarray, keys: np.ndarray | None = None,
             out: Out | None = None) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        x, y = batch_arrays(self.meta, len(ids), out)
        for j, i in enumerate(ids):
            img = self._decode(int(i), None if keys is None else int(keys[j]))
            if img.shape != self.meta.sample_shape:
                raise SampleError(int(i), f"{self.files[i]}: image of shape {img.shape} after "
                                  f"the transforms, but the first sample has "
                                  f"{self.meta.sample_shape} (add a resize transform)")
            x[j] = img
        y[:] = self.labels[ids]
        return x, y

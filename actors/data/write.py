"""Writing arrays as an image folder the ``imagefolder`` source reads
(``examples/make_imagefolder.py``, tests and ``bench/data.py``)."""

from __future__ import annotations

import os

import numpy as np


def write_imagefolder(path: str, x: np.ndarray, y: np.ndarray, classes: list[str] | None = None
                      ) -> None:
    """uint8 images (N, H, W) or (N, H, W, C) as ``path/<class>/<i>.png``."""
    from PIL import Image

    names = classes or [str(c) for c in range(int(np.max(y)) + 1)]
    for c in names:
        os.makedirs(os.path.join(path, c), exist_ok=True)
    for i, (img, label) in enumerate(zip(x, y, strict=True)):
        Image.fromarray(np.asarray(img, np.uint8)).save(
            os.path.join(path, names[int(label)], f"{i:06d}.png"))

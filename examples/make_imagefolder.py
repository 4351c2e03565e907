"""Write the image folder that examples/imagefolder-hetero.yaml trains on: MNIST-format
digits (generated from a seed, as the built-in ``mnist`` does without a path) saved as
PNGs, one sub-folder per class, under ``train/`` and ``test/``.

    .venv/bin/python examples/make_imagefolder.py [DIR] [--train N] [--test N]

DIR defaults to /tmp/dynabatch-imagefolder (the path the example config names).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's bench/

from dynabatch.actors.workloads.images import generate_mnist

from bench.data_files import write_imagefolder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="?", default="/tmp/dynabatch-imagefolder")
    ap.add_argument("--train", type=int, default=6000)
    ap.add_argument("--test", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.monotonic()
    x, y, xt, yt = generate_mnist(args.train, args.test, args.seed)
    write_imagefolder(f"{args.dir}/train", x, y)
    write_imagefolder(f"{args.dir}/test", xt, yt)
    print(f"wrote {len(y)} training and {len(yt)} test images under {args.dir} "
          f"in {time.monotonic() - t0:.1f}s")


if __name__ == "__main__":
    main()

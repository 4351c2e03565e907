"""What TensorBoard shows when a job's timeline goes back (docs/spec.md, "Experiment tracking").

A job that resumes, or rolls back to a checkpoint, trains some steps and epochs again and
writes their scalars at the same x-axis steps as the lost timeline's. Three run directories
hold one tag written at steps 0-5, then again at 3-5 with new values: ``same`` (one writer
goes back, as a roll-back does), ``resume`` (a second writer after the first closed, as a
resumed driver does) and ``purge`` (the second writer with ``SummaryWriter(purge_step=3)``).
Each is read back through TensorBoard's own HTTP API, once with its default data server
(``--load_fast=true``, the Rust ``tensorboard-data-server``) and once with the legacy Python
loader (``--load_fast=false``). Prints one JSON object: each loader's points per run, and
whether it kept only the retrained points.

    .venv/bin/python bench/tensorboard_rewind.py
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

RUNS = ("same", "resume", "purge")
WANT = [[0, 0.0], [1, 1.0], [2, 2.0], [3, 103.0], [4, 104.0], [5, 105.0]]


def write(root: Path) -> None:
    w = SummaryWriter(str(root / "same"))
    for s in range(6):
        w.add_scalar("loss", s, s)
    for s in range(3, 6):
        w.add_scalar("loss", 100 + s, s)
    w.close()
    for run, purge in (("resume", None), ("purge", 3)):
        w = SummaryWriter(str(root / run))
        for s in range(6):
            w.add_scalar("loss", s, s)
        w.close()
        time.sleep(1.1)  # event file names carry the second: a second file, as a resume makes
        w = SummaryWriter(str(root / run), purge_step=purge)
        for s in range(3, 6):
            w.add_scalar("loss", 100 + s, s)
        w.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(root: Path, fast: bool) -> dict[str, list[list[float]]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(root), "--host", "127.0.0.1",
         "--port", str(port), f"--load_fast={str(fast).lower()}", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                out = {}
                for run in RUNS:
                    url = (f"http://127.0.0.1:{port}/data/plugin/scalars/scalars"
                           f"?run={run}&tag=loss")
                    with urllib.request.urlopen(url, timeout=5) as r:
                        out[run] = [[int(s), v] for _, s, v in json.load(r)]
                if all(out.values()):
                    return out
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"TensorBoard (load_fast={fast}) did not serve the runs")
            time.sleep(1)
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    import tensorboard

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write(root)
        result: dict[str, object] = {"tensorboard": tensorboard.__version__}
        for fast in (True, False):
            points = read(root, fast)
            result[f"load_fast={str(fast).lower()}"] = {
                "points": points, "only_retrained": {r: p == WANT for r, p in points.items()}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

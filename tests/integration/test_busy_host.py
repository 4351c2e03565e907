"""``dynabatch run`` beside another Ray on the same host: the user's own prints still reach
the job log.

Ray's per-node dashboard agent, which serves the log API the job log reads actors' output
through (``dynabatch.actors.output``), listens on port 52365 by default. A second embedded Ray
that asks for the same port gets no agent, and the output of the user's model builder is
lost. Here another Ray holds the port (or something else already does: the job must cope
either way) while ``dynabatch run`` trains a job whose builder prints.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

AGENT_PORT = 52365  # Ray's DEFAULT_DASHBOARD_AGENT_LISTEN_PORT
MARK = "builder says hello from a busy host"

# Another embedded Ray, with Ray's default ports; it stays up until its stdin closes (then
# ray.init's exit handler stops its processes).
OTHER_RAY = """
import sys
import ray
ray.init(address="local", num_cpus=0, include_dashboard=False, _temp_dir=sys.argv[1])
print("up", flush=True)
sys.stdin.read()
"""

PLUGIN = f"""
from torch import nn


def net(input_shape, num_classes):
    print({MARK!r}, flush=True)
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], num_classes))
"""

CONFIG = """name: busy
workers: 1
global_batch: 16
epochs: 1
dataset: {name: synthetic, options: {n_samples: 64, n_features: 4, n_classes: 2}}
model: {name: "busy_host_plugin:net"}
working_dir: code
"""


def _port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def test_run_beside_another_ray_shows_the_builders_print(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    other_tmp = Path("/tmp") / f"dbo{os.getpid()}"  # Ray's socket paths must stay short
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_RAY, str(other_tmp)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 60
        while not _port_taken(AGENT_PORT):  # the other Ray's agent binds it as it starts
            assert time.monotonic() < deadline, f"nothing took port {AGENT_PORT}"
            time.sleep(0.5)
        (tmp_path / "code").mkdir()
        (tmp_path / "code" / "busy_host_plugin.py").write_text(PLUGIN)
        cfg = tmp_path / "job.yaml"
        cfg.write_text(CONFIG)
        dynabatch = Path(sys.executable).parent / "dynabatch"
        run = subprocess.run(
            [str(dynabatch), "run", str(cfg), "--quiet"],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert "busy: SUCCEEDED" in run.stdout
        assert MARK in run.stdout, run.stdout[-3000:]
        assert "cannot be read any more" not in run.stdout
    finally:
        if other.stdin is not None:
            other.stdin.close()
        try:
            other.wait(60)
        except subprocess.TimeoutExpired:
            other.kill()
            other.wait()
        shutil.rmtree(other_tmp, ignore_errors=True)

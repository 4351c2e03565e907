"""``dynabatch run`` as a user runs it, in their own project folder, beside another Ray on
the same host: the job's shipped code cannot shadow dynabatch's own packages, and the
user's own prints still reach the job log. One embedded run checks both, since each costs a
Ray of its own.

* Shadowing (issue 22, item 6). Ray puts a job's ``working_dir`` first on every worker's
  ``sys.path``. Our packages were once installed as bare ``scheduler``, ``api``, ``service``
  and ``actors``, so a user's ``scheduler.py`` ended the job with ``'scheduler' is not a
  package``. Installed as ``dynabatch.*`` they cannot be shadowed: this job ships all four
  names, each of which fails loudly if anyone but the user's own loss imports it.
* A busy host. Ray's per-node dashboard agent, which serves the log API the job log reads
  actors' output through (``dynabatch.actors.output``), listens on port 52365 by default. A
  second embedded Ray that asks for the same port gets no agent, and the output of the
  user's model builder is lost. Here another Ray holds the port (or something else already
  does: the job must cope either way) while the job's builder prints.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SHADOWS = ("scheduler", "api", "service", "actors")

# Each user module refuses to be imported by anything but the user's own loss, so a job
# that resolved one of our imports to it would fail with this message.
USER_MODULE = """
import inspect
_caller = [f.filename for f in inspect.stack()[1:]]
if not any(name.endswith("userloss.py") for name in _caller):
    raise RuntimeError("the user's {name}.py was imported by " + repr(_caller[-3:]))
VALUE = "{name}"
"""

USER_LOSS = """
import torch.nn.functional as F

import actors
import api
import scheduler
import service

# The user's own modules of those names are theirs to import.
NAMES = (scheduler.VALUE, api.VALUE, service.VALUE, actors.VALUE)


def loss(outputs, targets):
    assert NAMES == ("scheduler", "api", "service", "actors"), NAMES
    return F.cross_entropy(outputs, targets, reduction="none")
"""

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

CONFIG = """
name: shadow
working_dir: .
dataset: {name: digits}
model: {name: "busy_host_plugin:net"}
optimizer: {name: sgd, lr: 0.1}
workers: 2
worker_cpus: 0.5
global_batch: 64
epochs: 1
loss: userloss:loss
"""


def _port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def test_shipped_modules_named_like_ours_train_and_the_builders_print_shows_beside_another_ray(
    tmp_path: Path,
) -> None:
    """The user's project folder holds ``scheduler.py``, ``api.py``, ``service.py`` and
    ``actors.py`` and a model builder that prints; ``dynabatch run`` there (its embedded Ray
    ships the folder to every worker, first on their ``sys.path``) trains to SUCCEEDED with
    the print in its output, while another Ray holds the agent's default port."""
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text(USER_MODULE.format(name=name))
    (tmp_path / "userloss.py").write_text(USER_LOSS)
    (tmp_path / "busy_host_plugin.py").write_text(PLUGIN)
    (tmp_path / "job.yaml").write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", COLUMNS="200")
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
        proc = subprocess.run(
            [
                str(Path(sys.executable).parent / "dynabatch"),
                "run",
                "job.yaml",
                "--quiet",
                "--report",
                "report.json",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    finally:
        if other.stdin is not None:
            other.stdin.close()
        try:
            other.wait(60)
        except subprocess.TimeoutExpired:
            other.kill()
            other.wait()
        shutil.rmtree(other_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "shadow: SUCCEEDED" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["final"]["state"] == "SUCCEEDED", report["final"].get("reason")
    assert report["history"] and all(r["verified"] for r in report["history"])
    assert MARK in proc.stdout, proc.stdout[-3000:]
    assert "cannot be read any more" not in proc.stdout

"""A job's shipped code cannot shadow dynabatch's own packages (issue 22, item 6).

Ray puts a job's ``working_dir`` first on every worker's ``sys.path``. Our packages were
once installed as bare ``scheduler``, ``api``, ``service`` and ``actors``, so a user's
``scheduler.py`` ended the job with ``'scheduler' is not a package``. Installed as
``dynabatch.*`` they cannot be shadowed: this job ships all four names, each of which fails
loudly if anyone but the user's own loss imports it, and trains to SUCCEEDED.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SHADOWS = ("scheduler", "api", "service", "actors")

# Each user module refuses to be imported by anything but the user's own loss, so a job
# that resolved one of our imports to it would fail with this message.
USER_MODULE = '''
import inspect
_caller = [f.filename for f in inspect.stack()[1:]]
if not any(name.endswith("userloss.py") for name in _caller):
    raise RuntimeError("the user's {name}.py was imported by " + repr(_caller[-3:]))
VALUE = "{name}"
'''

USER_LOSS = '''
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
'''


CONFIG = """
name: shadow
working_dir: .
dataset: {name: digits}
model: {name: mlp, hidden: 16}
optimizer: {name: sgd, lr: 0.1}
workers: 2
worker_cpus: 0.5
global_batch: 64
epochs: 1
loss: userloss:loss
"""


def test_a_job_shipping_scheduler_api_service_and_actors_modules_trains(tmp_path):
    """As a user runs it: ``dynabatch run`` in their own project folder, which holds
    ``scheduler.py``, ``api.py``, ``service.py`` and ``actors.py`` (the embedded Ray ships
    the folder to every worker and puts it first on their ``sys.path``)."""
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text(USER_MODULE.format(name=name))
    (tmp_path / "userloss.py").write_text(USER_LOSS)
    (tmp_path / "job.yaml").write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(RAY_AUTH_MODE="disabled", COLUMNS="200")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "dynabatch"), "run", "job.yaml", "--quiet",
         "--report", "report.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["final"]["state"] == "SUCCEEDED", report["final"].get("reason")
    assert report["history"] and all(r["verified"] for r in report["history"])

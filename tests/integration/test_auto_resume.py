"""Automatic resume after the coordinator's process is killed outside Ray (an operator's
``kill -9``, the OOM killer), as ``dynabatch serve`` runs it: an embedded Ray in the API's
own process, whose coordinators that process owns.

Ray keeps the name of such an actor reserved after its process died for as long as its
owner holds a handle to it, so a new coordinator under the same name is refused ("The name
... is already taken"). The service starts each resumed coordinator under a new generation
of the name, recorded in the store.

The scheduler's rounds (every 0.1 s) find the dead coordinator before the service's
sync (every second) does: the service, not the scheduler, decides what follows (a
recorded resume as the next generation); the scheduler restarting the same generation,
unrecorded, failed this test once in CI.

The embedded Ray must be this child process's own (the integration tier's session cluster
may already be connected in the test process), so the service runs in a child Python
process, which kills the coordinator by its PID and reports what the service recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

CHILD = r"""
import json, os, signal, sys, time

import ray
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.runtime.launch import find_coordinator
from dynabatch.service.settings import Settings
from dynabatch.service.job_service import build_service

root = sys.argv[1]
settings = Settings(db_path=os.path.join(root, "jobs.db"), sync_interval_s=1.0,
                    cluster_round_s=0.1, checkpoint_root=root, ray_num_cpus=2)
service = build_service(settings)
service.cluster.connect()
service.reconciler.start()
spec = JobSpec.model_validate({
    "name": "sigkill", "dataset": {"name": "digits"}, "model": {"name": "mlp", "hidden": 32},
    "optimizer": {"name": "sgd", "lr": 0.1}, "workers": 2, "global_batch": 64, "epochs": 40,
    "seed": 3, "checkpoint": {"dir": os.path.join(root, "ckpt"), "every_epochs": 1},
})


def wait(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError("condition not met in time")


job = service.submit(spec).id
wait(lambda: service.get(job).current_snapshot().epochs_completed >= 1, 120)
handle = find_coordinator(job)
pid = ray.get(handle.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
del handle  # the service's own handle is what must not keep the name
os.kill(pid, signal.SIGKILL)
rec = wait(lambda: (r := service.get(job)).state.is_terminal and r, 180)
out = {
    "state": rec.state.value, "reason": rec.reason, "resumes": rec.resumes,
    "epochs": [r.epoch for r in service.history(job)],
    "messages": [x.message for x in service.logs(job)],
}
service.reconciler.stop()
service.cluster.close()
print("RESULT " + json.dumps(out), flush=True)
"""


def test_sigkilled_coordinator_of_an_embedded_ray_is_resumed(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)  # its own embedded Ray, never the session's cluster
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=360,
        env=env,
        cwd=tmp_path,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["state"] == "SUCCEEDED", out["reason"]
    assert out["resumes"] == 1
    assert out["epochs"] == list(range(40))
    messages = out["messages"]
    assert any("resuming from its checkpoint (automatic resume 1 of 3)" in m for m in messages)
    assert any(m.startswith("resuming from checkpoint at epoch") for m in messages)

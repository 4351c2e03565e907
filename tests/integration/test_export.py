"""The trained model out on real Ray workers: a job writes its final weights to
``artifacts.dir`` at its end, and a fresh process without Ray loads them and predicts as the
workers' own model does."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.models import build_model
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sync.coordinator import Coordinator
from safetensors.torch import load_file, save_file

from tests.unit.test_export import LOAD

pytestmark = pytest.mark.integration


def test_a_ray_job_exports_its_model_and_a_fresh_process_loads_it(cluster, tmp_path):
    spec = JobSpec.model_validate(
        {
            "name": "export",
            "dataset": {"name": "digits"},
            "model": {"name": "mlp", "hidden": 16},
            "workers": 2,
            "global_batch": 64,
            "epochs": 1,
            "seed": 5,
            "node_resource": "dynabatch_worker",
            "collective_timeout_s": 10,
            "spares": 0,  # no spare process on the idle third node
            "artifacts": {"dir": str(tmp_path / "models")},
        }
    )
    coord = Coordinator("export1", spec, resume=False)
    # What the workers answer when asked for their state: the export must reproduce the last.
    held: list[dict] = []
    fetch = coord.runtime.fetch_state
    coord.runtime.fetch_state = lambda w, t: held.append(fetch(w, t)) or held[-1]
    try:
        snap = coord.run()
    finally:
        coord.shutdown()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    assert held, "the job's end read no worker's state"
    model = build_model(spec.model, (64,), 10)
    model.load_state_dict(held[-1]["model"])
    torch.manual_seed(0)
    x = torch.randn(5, 64)
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    out = tmp_path / "models" / "export1"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD,
            str(out),
            str(tmp_path / "x.safetensors"),
            str(tmp_path / "y.safetensors"),
            str(torch.get_num_threads()),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    with torch.no_grad():
        assert torch.equal(load_file(str(tmp_path / "y.safetensors"))["y"], model.eval()(x))

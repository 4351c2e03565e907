"""A parameter-server job's trained model: the server's final weights go out as the same
files a synchronous job writes (``model.safetensors`` + ``manifest.json``), kept for
download and written to ``artifacts.dir``, so ``load_model`` rebuilds the server's model;
the job is seen ended only once its model is out, and a command that raises fails it through
the engine. Driven without Ray: the shipped driver over the simulator's runtime (real gradients)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from dynabatch.actors import export
from dynabatch.actors.export import load_model
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.ps.engine import Ended, job_state, learners
from dynabatch.scheduler.ps.driver import PSCoordinator
from dynabatch.scheduler.sim.cluster_spec import parse_cluster
from dynabatch.scheduler.sim.cost_model import SimulatedCluster
from dynabatch.scheduler.sim.ps_runtime import SimPSRuntime
from dynabatch.scheduler.sim.timeline import SimClock


def _job(job_id: str, reports: Any = None, **kw: Any) -> tuple[PSCoordinator, SimPSRuntime]:
    spec = JobSpec.model_validate(
        {
            "dataset": {"name": "digits", "limit": 96},
            "model": {"name": "mlp", "hidden": 16},
            "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.5},
            "protocol": {"name": "ps", "mode": "async"},
            "workers": 2,
            "global_batch": 24,
            "epochs": 2,
            **kw,
        }
    )
    clock = SimClock()
    # Slow enough (virtual seconds) that an epoch ends between control-loop steps.
    cluster = SimulatedCluster(parse_cluster({"classes": [
        {"name": "n0", "count": 1, "a_ms": 0.0, "c_ms_per_sample": 10.0},
        {"name": "n1", "count": 1, "a_ms": 0.0, "c_ms_per_sample": 20.0}]}))
    for node in cluster.nodes:
        node.node_id = node.node_class  # the nodes n0 and n1 (assignments name them)
    rt = SimPSRuntime(spec, load_dataset(spec.dataset, seed=spec.seed), cluster, clock=clock)
    return PSCoordinator(job_id, spec, runtime=rt, clock=clock, reports=reports), rt


def _flat(model: torch.nn.Module) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.nn.utils.parameters_to_vector(params).detach()


def test_a_ps_job_writes_the_servers_final_weights_as_the_trained_model(tmp_path: Path) -> None:
    coord, rt = _job("ps-job", artifacts={"dir": str(tmp_path / "art")})
    assert coord.model_files() is None
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED, coord.snapshot().reason
    out = tmp_path / "art" / "ps-job"
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.safetensors"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["job_id"] == "ps-job" and m["spec"]["protocol"]["name"] == "ps"
    assert m["weights"]["final"]["epoch"] == 2 and "accuracy" in m["weights"]["final"]["metrics"]
    model = load_model(str(out))
    server = torch.from_numpy(rt.final_weights())
    assert torch.equal(_flat(model), server), "the server's weights, not a fresh model's"
    assert coord.model_files() == export.read_files(str(out))  # kept for the service too
    assert any(f"trained model (end) at epoch 2: {out}" == x.message for x in coord.logs())


def test_a_cancelled_ps_job_that_trained_an_epoch_keeps_its_model() -> None:
    coord, _ = _job("ps-cancel", epochs=3)
    assert coord.start()
    while not coord.history():
        assert coord.step()
    coord.cancel("stop")
    while coord.step():
        pass
    assert coord.snapshot().state == JobState.CANCELLED
    files = coord.model_files()
    assert files is not None and sorted(files) == ["manifest.json", "model.safetensors"]
    m = json.loads(files["manifest.json"])
    assert m["weights"]["final"]["epoch"] == len(coord.history()) >= 1
    assert any(x.message.startswith("trained model (cancel)") for x in coord.logs())


def test_the_job_is_seen_ended_only_once_its_model_is_out() -> None:
    """The public state is derived from the engine's once a step's commands are carried out:
    a reader that sees SUCCEEDED finds the model files there."""
    coord, rt = _job("ps-order", epochs=1)
    seen: list[JobState] = []
    weights = rt.final_weights

    def final_weights() -> Any:
        seen.append(coord.state)
        return weights()

    rt.final_weights = final_weights  # type: ignore[method-assign]
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED and seen == [JobState.RUNNING]
    assert coord.state == job_state(coord.engine_state) and coord.model_files() is not None


def test_a_command_that_raises_fails_the_job_through_the_engine() -> None:
    coord, rt = _job("ps-broken")
    assert coord.start()

    def spawn(worker: str, ordinal: int, node_id: str) -> None:
        raise RuntimeError("the node refused the actor")

    rt.spawn = spawn  # type: ignore[method-assign]
    coord.scale(3)
    assert not coord.step()
    why = "internal error: RuntimeError: the node refused the actor"
    assert coord.engine_state == Ended(JobState.FAILED, why)
    assert (coord.state, coord.reason) == (JobState.FAILED, why)
    assert learners(coord.engine_state) == {}

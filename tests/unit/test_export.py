"""The trained model out (issue 33, item 4): safetensors and a manifest, written at the job's
end by the coordinator, served by ``GET /v1/jobs/{id}/model`` and ``dynabatch export``, and
loaded back by ``dynabatch.load_model`` in a process without Ray."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from dynabatch.actors import export
from dynabatch.actors.export import ExportError, load_model, model_files, write_files
from dynabatch.actors.spec import JobSpec, parse_spec
from dynabatch.actors.workloads.models import build_model
from dynabatch.api.app import create_app
from dynabatch.api.cli import export_commands as model_cli
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.runtime.seam import DataInfo
from dynabatch.scheduler.sim.cost_model import SimulatedCluster
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator
from dynabatch.service.artifacts import keep_model, models_dir
from dynabatch.service.rest_client import DynabatchClient
from dynabatch.service.settings import Settings
from dynabatch.service.submit_policy import SubmitPolicy, check_submission
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from tests.asgi import AppTransport
from tests.fakes import FakeCluster, Lineages, sim_runtime

ROOT = Path(__file__).resolve().parents[2]
SPEC = {"name": "digits", "workers": 2, "global_batch": 64, "epochs": 2}


def _mlp_files(spec: JobSpec | None = None, **kw: Any) -> tuple[torch.nn.Module, dict]:
    spec = spec or JobSpec.model_validate({"model": {"name": "mlp", "hidden": 8}})
    torch.manual_seed(0)
    model = build_model(spec.model, (4,), 3)
    files = model_files(
        spec=spec,
        input_shape=(4,),
        num_classes=3,
        final=model.state_dict(),
        epoch=2,
        metrics={"accuracy": 0.5},
        job_id="abc",
        **kw,
    )
    return model, files


# The files ----------------------------------------------------------------------------
def test_round_trip_gives_the_same_module_and_a_manifest_that_describes_it(tmp_path):
    model, files = _mlp_files()
    write_files(files, str(tmp_path / "m"))
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "manifest.json",
        "model.safetensors",
    ]
    m = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert m["format"] == export.FORMAT and m["dynabatch_version"] == export.dynabatch_version()
    assert m["model"] == {"name": "mlp", "hidden": 8, "options": {}}
    assert m["input_shape"] == [4] and m["num_classes"] == 3 and m["job_id"] == "abc"
    final = m["weights"]["final"]
    assert final["file"] == "model.safetensors" and final["epoch"] == 2
    assert final["metrics"] == {"accuracy": 0.5}
    assert final["dtypes"] == {k: "float32" for k in model.state_dict()}
    assert JobSpec.model_validate(m["spec"]).model.hidden == 8  # the spec as validated
    loaded = load_model(str(tmp_path / "m"))
    x = torch.randn(5, 4)
    assert not loaded.training and torch.equal(loaded(x), model.eval()(x))


def test_a_uri_directory_is_written_and_read_through_pyarrow_fs(tmp_path):
    model, files = _mlp_files()
    uri = f"file://{tmp_path}/uri/job"
    write_files(files, uri)
    assert export.has_model(uri) and export.read_files(uri) == files
    x = torch.randn(2, 4)
    assert torch.equal(load_model(uri)(x), model.eval()(x))


def test_tied_weights_are_stored_and_tied_again(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)
            self.b = torch.nn.Linear(3, 3)
            self.b.weight = self.a.weight

    state = Tied().state_dict()
    tensors = export._file_tensors(state)  # safetensors refuses shared memory
    assert tensors["a.weight"].data_ptr() != tensors["b.weight"].data_ptr()
    assert torch.equal(tensors["a.weight"], tensors["b.weight"])


def test_a_state_that_is_not_tensors_is_refused_naming_the_key():
    with pytest.raises(ExportError, match=r"^model state 'step': a int, not a tensor"):
        export._file_tensors({"step": 3})


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            lambda m: m.pop("input_shape"),
            "input_shape: must be a list of positive integers, got None",
        ),
        (lambda m: m.update(num_classes=0), "num_classes: must be a positive integer, got 0"),
        (
            lambda m: m.update(format="other/1"),
            "format: expected 'dynabatch-model/1', got 'other/1'",
        ),
        (
            lambda m: m["weights"]["final"].update(file="../x"),
            "weights.final.file: expected 'model.safetensors'",
        ),
        (lambda m: m.pop("weights"), "weights: must name the final weights (weights.final)"),
        (
            lambda m: m["model"].update(hidden="wide"),
            "model.hidden: Input should be a valid integer",
        ),
    ],
    ids=["input_shape", "num_classes", "format", "file", "weights", "model-field"],
)
def test_a_bad_manifest_is_one_line_naming_the_file_and_field(tmp_path, change, problem):
    _, files = _mlp_files()
    m = json.loads(files["manifest.json"])
    change(m)
    files["manifest.json"] = json.dumps(m).encode()
    write_files(files, str(tmp_path / "m"))
    with pytest.raises(ExportError) as err:
        load_model(str(tmp_path / "m"))
    where = f"{tmp_path / 'm'}/manifest.json"
    assert str(err.value).startswith(f"{where}: {problem}"), str(err.value)
    assert "\n" not in str(err.value)


def test_missing_files_and_weights_that_do_not_fit_are_named(tmp_path):
    with pytest.raises(ExportError, match=r"/nothing/manifest.json: no such file$"):
        load_model(str(tmp_path / "nothing"))
    _, files = _mlp_files()
    other = JobSpec.model_validate({"model": {"name": "mlp", "hidden": 16}})
    files["manifest.json"] = _mlp_files(other)[1]["manifest.json"]
    write_files(files, str(tmp_path / "m"))
    with pytest.raises(ExportError, match=r"model.safetensors: does not fit the model 'mlp'"):
        load_model(str(tmp_path / "m"))
    with pytest.raises(ExportError, match=r"weights.best: this model has no best weights"):
        load_model(str(tmp_path / "m"), which="best")


# The coordinator writes them at the job's end -------------------------------------------
class ModelRuntime(SimRuntime):
    """Simulated workers holding one real MLP: what a holder returns is its state. Their
    accuracy grows with training (:class:`~tests.fakes.Lineages`)."""

    def __init__(self, spec: JobSpec, cluster: SimulatedCluster, **kw: Any):
        super().__init__(spec, cluster, **kw)
        torch.manual_seed(1)
        self.model = build_model(spec.model, (4,), 3)

    def load_data(self) -> DataInfo:
        return DataInfo("fake", self.data.n_train, 100, (4,), 3)

    def fetch_state(self, worker: str, timeout_s: float) -> dict:
        super().fetch_state(worker, timeout_s)
        # Each read a step further (as training moves the weights): the best epoch's
        # checkpoint and the final weights differ.
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01)
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": {},
        }


def _coordinator(tmp_path: Path, **spec: Any) -> tuple[Coordinator, ModelRuntime]:
    s = JobSpec.model_validate(
        {
            "name": "ok",
            "workers": 2,
            "global_batch": 8,
            "epochs": 2,
            "model": {"name": "mlp", "hidden": 8},
            **spec,
        }
    )
    rt = sim_runtime(s, n_train=32, gradients=Lineages(), runtime=ModelRuntime)
    return Coordinator("job1", s, resume=False, runtime=rt, clock=rt.clock), rt


def test_the_coordinator_writes_the_final_weights_to_artifacts_dir_at_the_end(tmp_path):
    coord, rt = _coordinator(tmp_path, artifacts={"dir": str(tmp_path / "art")})
    assert coord.model_files() is None
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED
    out = tmp_path / "art" / "job1"
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.safetensors"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["weights"]["final"]["epoch"] == 2 and m["job_id"] == "job1"
    assert m["spec"]["artifacts"]["dir"] == str(tmp_path / "art")
    assert "accuracy" in m["weights"]["final"]["metrics"]
    assert coord.model_files() == export.read_files(str(out))  # kept for the service too
    x = torch.randn(3, 4)
    assert torch.equal(load_model(str(out))(x), rt.model.eval()(x))  # the last state read
    assert any(f"trained model (end) at epoch 2: {out}" == line.message for line in coord.logs())


def test_the_best_epochs_weights_go_beside_the_final_ones_with_keep_best(tmp_path):
    from dynabatch.scheduler.checkpoint import BEST, checkpoint_path, load_checkpoint_file

    coord, _ = _coordinator(
        tmp_path,
        epochs=3,
        artifacts={"dir": str(tmp_path / "art")},
        # The accuracy grows with training: "min" makes the first epoch the best.
        checkpoint={
            "dir": str(tmp_path / "ckpt"),
            "keep_best": {"metric": "accuracy", "mode": "min"},
        },
    )
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED
    out = str(tmp_path / "art" / "job1")
    m = json.loads(Path(out, "manifest.json").read_text())
    assert m["weights"]["best"]["file"] == "best.safetensors"
    assert m["weights"]["best"]["epoch"] == 1 and m["weights"]["final"]["epoch"] == 3
    assert "accuracy" in m["weights"]["best"]["metrics"]
    best = load_checkpoint_file(checkpoint_path(tmp_path / "ckpt", "job1", BEST))
    loaded = load_model(out, which="best").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in best["weights"]["model"].items())
    final = load_model(out).state_dict()
    assert not all(torch.equal(final[k], loaded[k]) for k in final)


def test_a_job_without_artifacts_dir_keeps_the_files_and_a_write_failure_is_a_warning(tmp_path):
    coord, _ = _coordinator(tmp_path)
    coord.run()
    assert sorted(coord.model_files()) == ["manifest.json", "model.safetensors"]
    (tmp_path / "file").write_text("")
    coord, _ = _coordinator(tmp_path, artifacts={"dir": str(tmp_path / "file")})
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED  # the training stands
    assert coord.model_files() is not None
    warn = [x.message for x in coord.logs() if x.level == "WARNING"]
    assert any(w.startswith("model export (end): artifacts.dir: cannot write") for w in warn)


def test_a_job_with_no_real_model_has_no_files(tmp_path):
    s = JobSpec.model_validate({"name": "f", "workers": 2, "global_batch": 8, "epochs": 1})
    rt = sim_runtime(s, n_train=16)
    coord = Coordinator("f", s, resume=False, runtime=rt, clock=rt.clock)
    coord.run()
    assert coord.snapshot().state == JobState.SUCCEEDED and coord.model_files() is None


# Trained, exported, loaded in a fresh process without Ray --------------------------------
# The fresh process computes as the test's does, so that the outputs are equal to the last
# bit: with the test process's thread count (argv[4]; a test before it in the same pytest
# worker may have set it, and a matmul split over another number of threads sums in another
# order), and on an input copied out of the file (safetensors hands back a tensor where its
# bytes lie in the file, 8 bytes past a 16-byte boundary here, and CPU matmul kernels take
# another path on an input not aligned to 16 bytes: seen on an AMD EPYC with safetensors
# 0.8.0). The model's weights are copied into its own parameters anyway.
LOAD = """
import sys, torch
from dynabatch import load_model
from safetensors.torch import load_file, save_file
torch.set_num_threads(int(sys.argv[4]))
model = load_model(sys.argv[1])
x = load_file(sys.argv[2])["x"].clone()
with torch.no_grad():
    save_file({"y": model(x)}, sys.argv[3])
assert "ray" not in sys.modules, "load_model imported ray"
"""


def test_trained_exported_and_loaded_in_a_fresh_process_gives_the_same_predictions(tmp_path):
    from dynabatch.scheduler.sim.cluster_spec import parse_cluster
    from dynabatch.scheduler.sim.simulator import simulate
    from safetensors.torch import load_file, save_file

    cluster = parse_cluster(
        {
            "classes": [
                {"name": "fast", "count": 1, "a_ms": 2, "c_ms_per_sample": 0.05},
                {"name": "slow", "count": 1, "a_ms": 2, "c_ms_per_sample": 0.15},
            ]
        }
    )
    spec = parse_spec(
        {
            "dataset": {"name": "digits", "limit": 300},
            "model": {"name": "mlp", "hidden": 16},
            "workers": 2,
            "epochs": 2,
        }
    )
    coords: list[Coordinator] = []
    res = simulate(spec, cluster, real_gradients=True, coordinator_hook=coords.append)
    assert res.snapshot.state == JobState.SUCCEEDED
    write_files(coords[0].model_files(), str(tmp_path / "model"))
    trained = res.runtime.gradients.model.eval()
    torch.manual_seed(3)
    x = torch.randn(7, 64)
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD,
            str(tmp_path / "model"),
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
        expected = trained(x)
    assert torch.equal(load_file(str(tmp_path / "y.safetensors"))["y"], expected)


# The service: submit policy, REST, CLI ---------------------------------------------------
def test_artifacts_dir_is_confined_under_the_artifact_root(tmp_path):
    spec = JobSpec.model_validate({"artifacts": {"dir": str(tmp_path / "a")}})
    assert check_submission(spec, SubmitPolicy()) == [
        (
            "artifacts.dir",
            "not allowed: this service accepts no artifacts directories (DYNABATCH_ARTIFACT_ROOT)",
        )
    ]
    assert check_submission(spec, SubmitPolicy(artifact_root=str(tmp_path))) == []
    out = JobSpec.model_validate({"artifacts": {"dir": "/elsewhere"}})
    assert check_submission(out, SubmitPolicy(artifact_root=str(tmp_path)))[0][0] == (
        "artifacts.dir"
    )
    s3 = JobSpec.model_validate({"artifacts": {"dir": "s3://bucket/models/x"}})
    assert check_submission(s3, SubmitPolicy(artifact_root="s3://bucket/models")) == []
    assert check_submission(s3, SubmitPolicy(artifact_root="s3://bucket/other")) != []


def test_artifact_root_setting_takes_a_path_or_uri():
    assert Settings(artifact_root="s3://b/m").submit_policy.artifact_root == "s3://b/m"
    with pytest.raises(ValueError, match="not an absolute path nor a URI"):
        Settings(artifact_root="rel/dir")


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Callable[..., tuple[TestClient, FakeCluster, Settings]]]:
    clients: list[TestClient] = []

    def make(
        cluster: FakeCluster | None = None, **settings: Any
    ) -> tuple[TestClient, FakeCluster, Settings]:
        cluster = cluster if cluster is not None else FakeCluster()
        cfg = Settings(db_path=str(tmp_path / "jobs.db"), sync_interval_s=0.0, **settings)
        client = TestClient(create_app(cfg, cluster=cluster))
        client.__enter__()
        clients.append(client)
        return client, cluster, cfg

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def _unzip(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n: z.read(n) for n in z.namelist()}


# A job whose (simulated) workers train its real model, small enough to be quick.
TRAINED = {**SPEC, "dataset": {"name": "digits", "limit": 256}}


def _train_to_the_end(cluster: FakeCluster, job: str) -> dict[str, bytes]:
    """Step the job's coordinator until it ends (the service does not see it yet): the
    trained model's files it keeps."""
    coordinator = cluster.coordinators[job]
    for _ in range(50):
        cluster.advance(job)
        if coordinator.state.is_terminal:
            break
    assert coordinator.state == JobState.SUCCEEDED, coordinator.reason
    files = coordinator.model_files()
    assert files is not None and set(files) == {"manifest.json", "model.safetensors"}
    return files


def test_rest_serves_the_model_and_says_409_when_there_is_none(app, tmp_path):
    client, cluster, cfg = app(FakeCluster(real_gradients=True), api_token="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    job = client.post("/v1/jobs", json=TRAINED, headers=auth).json()["job_id"]
    assert client.get(f"/v1/jobs/{job}/model").status_code == 401  # token-guarded
    r = client.get(f"/v1/jobs/{job}/model", headers=auth)
    assert r.status_code == 409 and r.json() == {"detail": f"job {job} has no trained weights yet"}
    files = _train_to_the_end(cluster, job)  # the job ended: its coordinator has them
    r = client.get(f"/v1/jobs/{job}/model", headers=auth)
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
    assert _unzip(r.content) == files
    # Kept by the service before its coordinator is released, it is served after.
    assert keep_model(cluster, job, models_dir(cfg.db_path))
    cluster.release(job)
    assert _unzip(client.get(f"/v1/jobs/{job}/model", headers=auth).content) == files
    assert client.get("/v1/jobs/0123456789ab/model", headers=auth).status_code == 404


def test_rest_reads_the_jobs_artifacts_dir(app, tmp_path):
    client, cluster, _ = app(artifact_root=str(tmp_path / "art"))
    job = client.post(
        "/v1/jobs", json={**SPEC, "artifacts": {"dir": str(tmp_path / "art")}}
    ).json()["job_id"]
    _, files = _mlp_files()
    write_files(files, str(tmp_path / "art" / job))
    cluster.release(job)  # no coordinator to ask
    assert _unzip(client.get(f"/v1/jobs/{job}/model").content) == files
    r = client.post("/v1/jobs", json={**SPEC, "artifacts": {"dir": "/tmp/elsewhere"}})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "artifacts.dir"


def _cli(http: TestClient, *args: str) -> Any:
    cli = typer.Typer(pretty_exceptions_enable=False)
    model_cli.register(cli)
    cli.command("noop")(lambda: None)  # a group, so the command is named as in dynabatch

    def factory(url: str, token: str | None) -> DynabatchClient:
        return DynabatchClient(url, token=token, transport=AppTransport(http))

    result = CliRunner().invoke(cli, list(args), obj={"client_factory": factory})
    assert "Traceback" not in result.output, result.output
    return result


def test_cli_export_writes_the_directory_load_model_reads(app, tmp_path):
    client, cluster, _ = app(FakeCluster(real_gradients=True))
    job = client.post("/v1/jobs", json=TRAINED).json()["job_id"]
    result = _cli(client, "export", job, "-o", str(tmp_path / "out"))
    assert result.exit_code == 1
    assert result.output.strip() == f"error: job {job} has no trained weights yet"
    _train_to_the_end(cluster, job)
    model = cluster.coordinators[job].runtime.gradients.model  # the model the job trained
    result = _cli(client, "export", job, "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        f"job {job}: manifest.json, model.safetensors written to {tmp_path / 'out'}"
    )
    x = torch.randn(2, 64)
    assert torch.equal(load_model(str(tmp_path / "out"))(x), model.eval()(x))
    assert torch.equal(load_model(tmp_path / "out")(x), model.eval()(x))  # a Path too
    (tmp_path / "f").write_text("")
    result = _cli(client, "export", job, "-o", str(tmp_path / "f"))
    assert result.output.strip() == f"error: --out: {tmp_path / 'f'} is a file, not a directory"
    assert _cli(client, "export", "nope", "-o", "x").exit_code == 1


def test_a_finished_jobs_model_outlives_its_released_coordinator(app):
    client, cluster, _ = app(FakeCluster(real_gradients=True))
    service = client.app.state.service
    job = client.post("/v1/jobs", json=TRAINED).json()["job_id"]
    coordinator = cluster.coordinators[job]
    for _ in range(50):
        service.reconciler.sync_once()
        if service.get(job).state.is_terminal:
            break
    assert service.get(job).state == JobState.SUCCEEDED and job in cluster.released
    r = client.get(f"/v1/jobs/{job}/model")
    assert r.status_code == 200, r.text
    assert _unzip(r.content) == coordinator.model_files()

"""A job whose workload is wrong ends FAILED with one line naming the field: the real
coordinator, the fake cluster, and the data loaded and checked as the Ray runtime does
(``dynabatch.scheduler.runtime.ray_runtime.open_checked``)."""

from __future__ import annotations

import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.runtime.ray_runtime import open_checked
from dynabatch.scheduler.runtime.seam import DataInfo
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator

from tests.fakes import sim_runtime

P = "tests.unit.workload_plugins"


class CheckedDataRuntime(SimRuntime):
    """Simulated workers, real data: loading runs the dataset, the model, the loss and the
    metrics exactly as RayRuntime.load_data does before any worker starts."""

    def load_data(self) -> DataInfo:
        data, _ = open_checked(self.spec)
        return DataInfo(data.name, len(data.train), len(data.test))


def _run(**spec: object) -> tuple[Coordinator, SimRuntime]:
    s = JobSpec.model_validate({"name": "bad", "workers": 2, "global_batch": 8, "epochs": 1,
                                **spec})
    rt = sim_runtime(s, n_train=32, runtime=CheckedDataRuntime)
    coord = Coordinator("bad", s, resume=False, runtime=rt, clock=rt.clock)
    coord.run()
    return coord, rt


@pytest.mark.parametrize(("spec", "reason"), [
    ({"dataset": {"name": f"{P}:float_tokens_loader"}, "model": {"name": "charlm"}},
     f"dataset.name: '{P}:float_tokens_loader' returned invalid data: x_train must hold "
     "integer token ids (int64), got dtype float32"),
    ({"dataset": {"name": "digits"}, "loss": f"{P}:mean_loss"},
     f"loss: '{P}:mean_loss' returned shape (); it must return one value per sample, "
     "shape (2,)"),
    ({"dataset": {"name": "digits"}, "metrics": ["mse"]},
     "metrics.0: 'mse' failed on this dataset and model (ValueError: mse needs outputs and "
     "targets of the same size per sample, got outputs (2, 10) and targets (2,))"),
], ids=["dataset-dtype", "loss-shape", "metric-mismatch"])
def test_a_wrong_workload_fails_the_job_with_one_line_naming_the_field(
    spec: dict, reason: str
) -> None:
    coord, rt = _run(**spec)
    snap = coord.snapshot()
    assert snap.state == JobState.FAILED
    assert snap.reason == reason and "\n" not in snap.reason
    assert rt.ordinals == {} and rt.record.trained == 0  # failed before any worker started
    assert coord.logs()[-1].message == f"state FAILED: {reason}"


def test_the_same_runtime_trains_a_good_workload() -> None:
    # The failures above come from the workload, not from the harness.
    coord, _ = _run(dataset={"name": f"{P}:arrays_loader"})
    assert coord.snapshot().state == JobState.SUCCEEDED, coord.snapshot().reason


# A user's options named like the service's own parameters (the import path, the spec field,
# the function) reach the user's code as they are, and nothing else does.
CLASHING = {"path": "/data/big.parquet", "field": "y", "fn": "mae", "name": "mine",
            "kwargs": 1, "spec": 2, "seed": 3}
RECEIVED: dict[str, dict] = {}


def recording_loader(**options: object) -> tuple:
    import numpy as np

    RECEIVED["dataset"] = dict(options)
    x = np.arange(64, dtype=np.float32).reshape(32, 2)
    y = np.arange(32) % 2
    return x[:24], y[:24], x[24:], y[24:]


def recording_net(input_shape: tuple[int, ...], num_classes: int, **options: object):
    from torch import nn

    RECEIVED["model"] = dict(options)
    return nn.Sequential(nn.Flatten(), nn.Linear(int(input_shape[0]), num_classes))


def test_user_hooks_get_exactly_their_options_whatever_their_names() -> None:
    from dynabatch.actors.data.open import open_dataset

    RECEIVED.clear()
    coord, _ = _run(dataset={"name": f"{__name__}:recording_loader", "options": CLASHING},
                    model={"name": f"{__name__}:recording_net", "options": CLASHING})
    assert coord.snapshot().state == JobState.SUCCEEDED, coord.snapshot().reason
    assert RECEIVED == {"dataset": CLASHING, "model": CLASHING}
    # The loader as the Ray runtime opens it (data read by position).
    RECEIVED.clear()
    spec = JobSpec.model_validate({"dataset": {"name": f"{__name__}:recording_loader",
                                               "options": CLASHING}})
    assert len(open_dataset(spec.dataset).train) == 24
    assert RECEIVED == {"dataset": CLASHING}


@pytest.mark.parametrize(("spec", "reason"), [
    ({"global_batch": 100_000},
     "global_batch: global_batch 100000 is larger than the training set (20 samples)"),
    ({"epochs": 2, "schedule": {"stages": [{"epochs": 1, "global_batch": 8},
                                           {"epochs": 1, "global_batch": 21}]}},
     "schedule.stages.1.global_batch: global_batch 21 is larger than the training set "
     "(20 samples)"),
    ({"schedule": {"mode": "goodput", "max_global_batch": 64}},
     "schedule.max_global_batch: max_global_batch 64 is larger than the training set "
     "(20 samples)"),
], ids=["fixed", "stage", "goodput"])
def test_a_global_batch_larger_than_the_training_set_is_refused_at_load_time(
    spec: dict, reason: str
) -> None:
    # arrays_loader's 40 samples split 20 train, 20 test.
    coord, rt = _run(dataset={"name": f"{P}:arrays_loader"}, **spec)
    snap = coord.snapshot()
    assert (snap.state, snap.reason) == (JobState.FAILED, reason)
    assert rt.ordinals == {} and rt.record.trained == 0  # refused before any worker started


def test_a_global_batch_the_size_of_the_training_set_trains() -> None:
    coord, _ = _run(dataset={"name": f"{P}:arrays_loader"}, global_batch=20)
    assert coord.snapshot().state == JobState.SUCCEEDED, coord.snapshot().reason

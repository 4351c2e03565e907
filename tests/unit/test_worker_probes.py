"""bench/worker_probes.py: the probes a benchmark runs inside a worker through Ray's
``__ray_call__`` (the worker carries no benchmark code), here on a worker outside Ray with
a one-rank gloo group."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.worker import Worker

from bench import worker_probes


@pytest.fixture
def worker():
    spec = JobSpec.model_validate(dict(
        dataset={"name": "synthetic"}, model={"name": "mlp", "hidden": 8}, workers=1,
        global_batch=16, collective_timeout_s=5))
    rng = np.random.default_rng(0)
    w = Worker("w0", 0, spec, rng.normal(size=(40, 4)).astype(np.float32),
               rng.integers(0, 3, size=40), (4,), 3)
    w.join(w.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    yield w
    w.leave()


def _plan(step: int) -> SegmentPlan:
    return SegmentPlan(0, 0, 40, (StepPlan(step, step * 16, 16, step * 16, 16),))


def test_profile_and_allreduce_time_every_batch_size(worker):
    prof = worker_probes.profile(worker, [4, 8], repeats=2, wall=True, lockstep=True)
    assert sorted(prof) == [4, 8] and all(t > 0 for t in prof.values())
    assert worker_probes.time_allreduce(worker, repeats=2) >= 0


def test_a_stall_hangs_the_next_step_only(worker, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(worker_probes.time, "sleep", slept.append)
    worker_probes.stall(worker, 1000.0)
    first = worker.run_segment(_plan(0))
    second = worker.run_segment(_plan(1))
    assert slept == [1000.0]
    assert first.error is None and second.error is None
    assert [s.step for s in first.steps + second.steps] == [0, 1]


def test_fail_from_raises_from_its_step_on_as_the_workers_own_error(worker):
    worker_probes.fail_from(worker, 0, 1)
    first = worker.run_segment(_plan(0))
    second = worker.run_segment(_plan(1))
    assert first.error is None and [s.step for s in first.steps] == [0]
    assert second.error_kind == "compute" and not second.steps
    assert second.error.startswith("InjectedFault: injected error at epoch 0 step 1")
    assert not worker.group.active  # it left the group, as for a bug in its model


def test_fail_when_spawned_arms_only_the_worker_of_that_ordinal():
    armed: list[tuple[str, object, tuple]] = []

    class Runtime:
        def spawn(self, s):
            self.spawned = s.worker_id

    rt = Runtime()
    # The worker actors' handles, by id, as RayRuntime keeps them.
    rt._handles = {f"w{i}": SimpleNamespace(__ray_call__=SimpleNamespace(
        remote=lambda fn, *args, w=f"w{i}": armed.append((w, fn, args)))) for i in range(3)}
    worker_probes.fail_when_spawned(rt, 1, 2, 3)
    for ordinal in (0, 1, 2):
        rt.spawn(SimpleNamespace(worker_id=f"w{ordinal}", ordinal=ordinal))
        assert rt.spawned == f"w{ordinal}"  # the runtime's own spawn ran
    assert armed == [("w1", worker_probes.fail_from, (2, 3))]

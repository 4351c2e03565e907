"""Parameter-server jobs end to end on a real multi-node Ray cluster.

* A learner's node is lost mid-run while it holds a chunk: its in-flight samples are
  re-queued (``retried_samples > 0``), nobody regroups, every epoch is still applied exactly
  once.
* The modes on real actors, three short jobs in one test: hardsync with a learner joining
  (τ = 0 throughout), softsync over two server shards with a scale-down (the drained learner
  leaves, its samples re-queued; its final weights go out as the model files), and bounded
  staleness ``wait`` (τ ≤ S, updates deferred).
"""

from __future__ import annotations

import threading

import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.ps.engine import learners
from dynabatch.scheduler.ps.driver import PSCoordinator

from .conftest import wait_for

pytestmark = pytest.mark.integration


def _spec(name: str, **kw) -> JobSpec:
    # Emulated 8x slower learners: the jobs last long enough (a few seconds) for a scale
    # request to land mid-run.
    kw.setdefault("emulation", {"slowdowns": [8, 8, 8]})
    kw.setdefault("dataset", {"name": "digits"})
    return JobSpec.model_validate(dict(
        name=name, model={"name": "mlp", "hidden": 32},
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.5}, global_batch=48, seed=1,
        worker_wait_timeout_s=20, **kw))


def _start(coord: PSCoordinator) -> threading.Thread:
    thread = threading.Thread(target=coord.run, daemon=True)
    thread.start()
    return thread


def _finished(coord: PSCoordinator, thread: threading.Thread, epochs: int):
    thread.join(timeout=120)
    snap = coord.snapshot()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    hist = coord.history()
    assert [r.epoch for r in hist] == list(range(epochs))
    assert all(r.verified and r.samples_trained == r.dataset_size for r in hist)
    return snap, {w.worker: w for w in snap.ps.workers}


def test_ps_job_survives_a_lost_learner_exactly_once(cluster):
    tag = "ps_loss"
    nodes = [cluster.add_node(num_cpus=1, resources={tag: 1}, object_store_memory=80 * 2**20)
             for _ in range(2)]  # the victim's, and one that trains on
    cluster.wait_for_nodes()
    spec = JobSpec.model_validate(dict(
        name=tag, dataset={"name": "digits"}, model={"name": "mlp", "hidden": 64},
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.5}, workers=2, global_batch=48,
        epochs=4, seed=3, node_resource=tag, worker_wait_timeout_s=20,
        # From its 4th chunk on, the victim w0 computes 1000x longer (about 0.5 s a chunk
        # against a few ms to talk to the server), so once it is seen holding that chunk it
        # still holds it when its node goes. At 4x (a chunk of ~2 ms, shorter than a round
        # trip) it had often pushed in between, and nothing was in flight to re-queue.
        emulation={"slowdowns": [1, 1],
                   "disturbances": [{"worker": 0, "factor": 1000, "step": 3}]},
        protocol={"name": "ps", "mode": "async", "lr_staleness": "per_gradient",
                  "max_staleness": 8},
    ))
    coord = PSCoordinator("ps-loss", spec)
    thread = _start(coord)

    def w0_holds_a_slowed_chunk() -> bool:
        if coord.server_stats is None:  # the server is not up yet
            return False
        s = coord.runtime.snapshot()  # the server's state now, not the driver's last poll
        return s["workers"].get("w0", {}).get("pushes", 0) >= 3 and "w0" in s["inflight"]

    wait_for(w0_holds_a_slowed_chunk, timeout=60, interval=0.02)
    node_id = learners(coord.engine_state)["w0"]  # the node it runs on
    cluster.remove_node(next(n for n in nodes if n.node_id == node_id), allow_graceful=False)
    snap, workers = _finished(coord, thread, 4)
    assert any(e.kind == "failure" and e.worker == "w0" for e in coord.events)
    assert not workers["w0"].member
    assert snap.retried_samples_total > 0  # w0's in-flight chunk went back to the queue
    assert snap.ps.applied == sum(w.applied for w in snap.ps.workers)
    assert snap.ps.version > 0 and coord.history()[-1].test_accuracy > 0.5


def test_ps_modes_join_shards_scale_down_wait_and_export(cluster, tmp_path):
    # hardsync, 2 learners; a third joins mid-run and every gradient still has τ = 0. Once
    # it is a member every update waits for its gradient, so the job cannot end without it.
    # 8 short epochs (120 updates, ~50 ms each here): the emulated slowdown barely stretches
    # an MLP's millisecond step, so the length comes from the number of updates; the scale
    # request is served within one poll (0.25 s).
    coord = PSCoordinator("ps-hard", _spec("ps-hard", workers=2, epochs=8,
                                           dataset={"name": "digits", "limit": 720},
                                           protocol={"name": "ps", "mode": "hardsync"}))
    thread = _start(coord)
    wait_for(lambda: (s := coord.server_stats) is not None and s["version"] >= 3, timeout=60,
             interval=0.05)
    coord.scale(3)
    snap, workers = _finished(coord, thread, 8)
    assert set(workers) == {"w0", "w1", "w2"} and workers["w2"].applied > 0
    assert all(w.staleness_max == 0 for w in workers.values())
    assert any(e.kind == "join" and e.worker == "w2" for e in coord.events)

    # 3-softsync over two server shards (the core decides on one; the slices apply on
    # both); scaled down to 2 mid-run: the slowest learner (w2) leaves, the job finishes.
    # w2 is emulated 300x slower (a step of ~0.3 s): at 30x its step stayed shorter than a
    # round trip to the server on a loaded host (load average 40), so the learners' applied
    # rates were a coin toss and another learner could be the one scaled down.
    spec = _spec(
        "ps-soft", workers=3, epochs=3, emulation={"slowdowns": [1, 1, 300]},
        protocol={"name": "ps", "mode": "softsync", "n": 3, "lr_staleness": "per_gradient",
                  "shards": 2}, artifacts={"dir": str(tmp_path / "art")})
    coord = PSCoordinator("ps-soft", spec)
    thread = _start(coord)
    wait_for(lambda: (s := coord.server_stats) is not None and s["version"] >= 5, timeout=60,
             interval=0.05)
    coord.scale(2)
    snap, workers = _finished(coord, thread, 3)
    stats = coord.server_stats
    assert stats["shards"] == 2 and 0 < stats["puts"] <= stats["version"] + 1
    assert any(e.kind == "leave" and e.worker == "w2" and "scaled down" in e.reason
               for e in coord.events)
    assert not workers["w2"].member and workers["w0"].member and workers["w1"].member
    assert coord.history()[-1].test_accuracy > 0.5
    _check_exported_model(coord, spec, tmp_path / "art" / "ps-soft")

    # Bounded staleness, wait: a slow learner makes the others wait, never τ > S. Three
    # learners: with two (one 4x slower), a run deferred nothing, since an MLP's step is
    # mostly the round trip, which the emulated slowdown does not stretch.
    coord = PSCoordinator("ps-wait", _spec(
        "ps-wait", workers=3, epochs=1, emulation={"slowdowns": [1, 1, 4]},
        protocol={"name": "ps", "mode": "async", "max_staleness": 1, "on_stale": "wait"}))
    snap, workers = _finished(coord, _start(coord), 1)
    assert all(w.staleness_max <= 1 for w in workers.values())
    assert snap.ps.deferred > 0


def _check_exported_model(coord: PSCoordinator, spec: JobSpec, where) -> None:
    """The server's final weights (over two shards: slice 0 and the shard's) went out as the
    model files in ``artifacts.dir``: ``load_model`` there rebuilds a model that scores on
    the test set exactly what the server scored its final weights at the last epoch's end."""
    import torch
    from dynabatch.actors.export import load_model
    from dynabatch.actors.ps import ParamStore
    from dynabatch.actors.workloads.datasets import load_dataset

    model = load_model(where)
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.nn.utils.parameters_to_vector(params).detach().numpy()
    ds = load_dataset(spec.dataset, seed=spec.seed)
    store = ParamStore(spec, tuple(ds.input_shape), ds.num_classes)
    loss, accuracy = store.evaluate(ds.x_test, ds.y_test, flat)  # as the server evaluates
    last = coord.history()[-1]
    assert loss == pytest.approx(last.test_loss, rel=1e-5)
    assert accuracy == pytest.approx(last.test_accuracy)
    assert sorted(coord.model_files()) == ["manifest.json", "model.safetensors"]

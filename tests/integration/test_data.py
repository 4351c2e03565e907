"""Training from sources read by position, on real Ray workers: Parquet (with a node lost
mid-epoch, every epoch verified from the workers' reports), .npy shards, an image folder
and a user's map-style Dataset, and one of padded variable-length sequences (a collate)
with a node lost; a __getitem__ that raises fails the job with the position and the
field."""

from __future__ import annotations

import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.images import generate_mnist
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sync.coordinator import Coordinator

from bench.data_files import write_imagefolder, write_npy, write_parquet

from .conftest import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mnist_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    xtr, ytr, xte, yte = generate_mnist(1200, 200, 0)
    write_parquet(str(root / "pq" / "train"), xtr, ytr, row_group_size=64, rows_per_file=500)
    write_parquet(str(root / "pq" / "test"), xte, yte, row_group_size=64)
    write_npy(str(root / "npy" / "train"), xtr, ytr, shards=3)
    write_npy(str(root / "npy" / "test"), xte, yte, shards=1)
    write_imagefolder(str(root / "img" / "train"), xtr[:300], ytr[:300])
    write_imagefolder(str(root / "img" / "test"), xte[:60], yte[:60])
    return root


def _spec(dataset: dict, **kw) -> JobSpec:
    base = dict(name="data", dataset=dataset, model={"name": "mlp", "hidden": 32},
                optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}, workers=2,
                global_batch=64, epochs=2, seed=3, node_resource="dynabatch_worker",
                collective_timeout_s=10, spares=0)  # no spare process on the idle third node
    base.update(kw)
    return JobSpec.model_validate(base)


def _check(snap, coord) -> None:
    assert snap.state == JobState.SUCCEEDED, snap.reason
    hist = coord.history()
    assert hist and all(r.verified and r.samples_trained == r.dataset_size for r in hist)
    assert snap.test_accuracy is not None and snap.test_accuracy > 0.3


# Parquet trains on Ray workers in test_node_lost_mid_epoch_while_reading_parquet.
@pytest.mark.parametrize("kind", ["npy", "imagefolder"])
def test_file_sources_train_on_ray_workers(cluster, mnist_files, kind):
    path = {"npy": "npy", "imagefolder": "img"}[kind]
    opts = {"imagefolder": {"transforms": [{"random_crop": 28, "padding": 2}]}}.get(kind, {})
    few = kind == "imagefolder"  # 300 images: smaller steps, more epochs
    spec = _spec({"name": kind, "path": str(mnist_files / path), "options": opts},
                 epochs=5 if few else 2, global_batch=32 if few else 64)
    coord = Coordinator(f"data-{kind}", spec, resume=False)
    snap = coord.run()
    _check(snap, coord)
    steps = [s for r in coord.history() for s in [r.breakdown] if s is not None]
    assert steps and all(b.data_wait_s >= 0 for b in steps)


def test_map_style_dataset_with_seeded_augmentation(cluster):
    # Two readers: the dataset is read by reader processes the worker spawns.
    spec = _spec({"name": "tests.unit.data_plugins:noisy", "options": {"n": 256},
                  "loader_threads": 2}, global_batch=32)
    coord = Coordinator("data-map", spec, resume=False)
    _check(coord.run(), coord)


def test_getitem_error_fails_the_job_with_position_and_field(cluster):
    spec = _spec({"name": "tests.unit.data_plugins:noisy", "options": {"n": 128,
                                                                        "bad_at": 7}},
                 max_retries=1)
    snap = Coordinator("data-bad", spec, resume=False).run()
    assert snap.state == JobState.FAILED
    assert "dataset.name: sample" in snap.reason and "order position" in snap.reason
    assert "cannot decode record 7" in snap.reason and "second line" not in snap.reason


def _ray_says_dead(handle) -> bool:
    """Whether Ray has declared the actor dead: from then on every call to it fails."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        ray.get(handle.info.remote(), timeout=5)
    except RayActorError:
        return True
    except GetTimeoutError:
        pass
    return False


def test_node_lost_mid_epoch_while_reading_parquet(cluster, mnist_files):
    tag = "data_loss"
    # Two nodes, as the padded-sequences job below: the victim's, and one that trains on.
    nodes = [cluster.add_node(num_cpus=1, resources={tag: 1}, object_store_memory=80 * 2**20)
             for _ in range(2)]
    cluster.wait_for_nodes()
    spec = _spec({"name": "parquet", "path": str(mnist_files / "pq")}, workers=2,
                 min_workers=1, epochs=3, node_resource=tag, collective_timeout_s=3,
                 worker_wait_timeout_s=20, global_batch=32)
    coord = Coordinator("data-loss", spec, resume=False)
    snap = _lose_a_node(cluster, coord, nodes, (1, 4))
    _check(snap, coord)
    steps = [s for r in coord.history() for s in [r.breakdown] if s is not None]
    assert steps and all(b.data_wait_s >= 0 for b in steps)


def _lose_a_node(cluster, coord, nodes, at: tuple[int, int]):
    """Run ``coord`` to (epoch, step) ``at``, remove its last member's node without grace,
    then run the job to its end: it succeeds with that one failure. Returns its snapshot."""
    # The test runs the control loop itself, so the job cannot end before the loss shows.
    # A node removed without grace loses its raylet at once, but its worker dies, and Ray
    # declares it dead, some time later (about as long as the rest of this job, ~70 steps
    # of a few milliseconds); a job run in a thread could succeed with the victim still
    # training, no failure ever seen.
    while (coord.epoch, coord.step_in_epoch) < at:
        assert coord.step(), coord.snapshot().reason
    victim = coord.membership.members[-1]
    handle = coord.runtime._handles[victim.worker_id]
    cluster.remove_node(next(n for n in nodes if n.node_id == victim.node),
                        allow_graceful=False)
    # Paused between steps, with at most the segment sent ahead in flight: every later
    # segment needs the victim, and once Ray has declared it dead each call to it fails.
    wait_for(lambda: _ray_says_dead(handle), timeout=120, interval=0.2)
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    assert [e.worker for e in coord.membership_events() if e.kind == "failure"] == [
        victim.worker_id]
    return snap


def test_padded_sequences_with_a_collate_survive_a_lost_node(cluster):
    # Variable-length token sequences, padded per share by the user's collate into
    # {"input_ids", "attention_mask"}, for a model that takes both by name.
    tag = "data_padded"
    nodes = [cluster.add_node(num_cpus=1, resources={tag: 1}, object_store_memory=80 * 2**20)
             for _ in range(2)]
    cluster.wait_for_nodes()
    plug = "tests.unit.structured_plugins"
    spec = _spec({"name": f"{plug}:sequences", "options": {"n": 320, "longest": 24},
                  "collate": f"{plug}:pad"}, model={"name": f"{plug}:seq_classifier"},
                 optimizer={"name": "adam", "lr": 0.02}, global_batch=32, min_workers=1,
                 node_resource=tag, collective_timeout_s=3, worker_wait_timeout_s=20)
    coord = Coordinator("data-padded", spec, resume=False)
    snap = _lose_a_node(cluster, coord, nodes, (0, 3))
    hist = coord.history()
    assert len(hist) == 2 and all(r.verified and r.samples_trained == r.dataset_size
                                  for r in hist)
    assert snap.test_accuracy is not None

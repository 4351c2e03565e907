"""Whole-evaluation metrics on real Ray (issue 54): the held-out set is scored in shards by
unequal workers, a node is lost while its shard is still to be scored, and the metrics the
job publishes are still one process's values on the whole set with the epoch's weights.

The unit tier proves the merge for any split (``tests/unit/test_metric_states.py``); this
is the same property through the actors, the object store and a failure."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from dynabatch.actors.export import load_model
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sync.coordinator import Coordinator
from sklearn.metrics import confusion_matrix, f1_score, roc_auc_score

pytestmark = pytest.mark.integration

TAG = "metrics_merge"


def test_metrics_merged_over_unequal_shards_survive_a_node_lost_mid_evaluation(cluster,
                                                                              tmp_path):
    """Three workers of speeds 1, 1 and 1/3 score their shards of the test set after every
    epoch. The last epoch's evaluation is sent; the largest shard's worker is held busy so
    that its shard cannot run, the other shards are let finish, and then that worker's node
    is removed. The job scores the set again on the two holders left (unequal shares) and
    succeeds; the exported final weights, scored by this process with sklearn on the whole
    test set, give the published macro-F1, AUROC and confusion matrix."""
    nodes = [cluster.add_node(num_cpus=1, resources={TAG: 1}, object_store_memory=80 * 2**20)
             for _ in range(3)]
    cluster.wait_for_nodes()
    spec = JobSpec.model_validate(dict(
        name=TAG, dataset={"name": "digits"}, model={"name": "mlp", "hidden": 32},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}, workers=3, min_workers=1,
        global_batch=64, epochs=2, seed=7, node_resource=TAG, collective_timeout_s=5,
        worker_wait_timeout_s=20, spares=0, emulation={"slowdowns": [1, 1, 3]},
        metrics=["f1", "confusion_matrix", "auroc"],
        artifacts={"dir": str(tmp_path / "models")}))
    coord = Coordinator("merge1", spec, resume=False)
    rt = coord.runtime
    submit = rt.submit_evaluation
    rounds: list[tuple[int, dict[str, tuple[int, int]]]] = []  # (epoch, shards) as sent
    lost: list[str] = []

    def submit_and_lose_a_node(shards, *args, **kw):
        """The runtime's submit_evaluation; the first time for the last epoch, the largest
        shard's worker loses its node after the other shards are scored and before its own."""
        # The epoch the round scores: the one training is in, or, for a round run again
        # once the training is over, the last.
        epoch = min(coord.epoch, spec.epochs - 1)
        rounds.append((epoch, dict(shards)))
        if epoch < spec.epochs - 1 or lost:
            return submit(shards, *args, **kw)
        victim = max(shards, key=lambda w: shards[w][1] - shards[w][0])
        # An actor runs its calls in order: its shard waits behind this one (which ends with
        # the node, its process with its raylet; bounded all the same).
        rt._handles[victim].__ray_call__.remote(lambda _self: __import__("time").sleep(300))
        ticket = submit(shards, *args, **kw)
        others = [ref for ref, w in ticket.items() if w != victim]
        done, _ = ray.wait(others, num_returns=len(others), timeout=120)
        assert len(done) == len(others), "the other holders' shards did not come in"
        node = next(m.node for m in coord.membership.members if m.worker_id == victim)
        cluster.remove_node(next(n for n in nodes if n.node_id == node), allow_graceful=False)
        lost.append(victim)
        return ticket

    rt.submit_evaluation = submit_and_lose_a_node
    try:
        snap = coord.run()
    finally:
        coord.shutdown()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    assert lost, "the last epoch was never evaluated"
    assert [e.worker for e in coord.membership_events() if e.kind == "failure"] == lost

    # The last epoch was scored twice: over three unequal shards (one never scored), then
    # over the two holders left, a fast and the slow one (the victim had the largest shard).
    last = [s for e, s in rounds if e == spec.epochs - 1]
    assert len(last) == 2, rounds
    assert len(last[0]) == 3 and set(last[1]) == set(last[0]) - set(lost)
    for shards in last:
        sizes = sorted(hi - lo for lo, hi in shards.values())
        assert sizes[0] < sizes[-1], shards

    ds = load_dataset(spec.dataset, seed=spec.seed)
    history = coord.history()
    assert [r.epoch for r in history] == list(range(spec.epochs))
    for r in history:
        assert r.verified and r.samples_trained == r.dataset_size
        assert set(r.test_metrics) == {"f1", "auroc"}, r.test_metrics
        assert np.asarray(r.test_matrices["confusion_matrix"]).sum() == len(ds.y_test)

    # One process on the whole test set with the weights the job ended with.
    model = load_model(tmp_path / "models" / "merge1")
    with torch.no_grad():
        logits = model(torch.as_tensor(ds.x_test))
    probs = torch.softmax(logits, -1).numpy()
    pred, y = probs.argmax(-1), np.asarray(ds.y_test)
    final = history[-1]
    assert final.test_metrics["f1"] == pytest.approx(
        f1_score(y, pred, average="macro", zero_division=0), rel=1e-5, abs=1e-6)
    assert final.test_metrics["auroc"] == pytest.approx(
        roc_auc_score(y, probs, multi_class="ovr", average="macro"), rel=1e-5, abs=1e-6)
    assert final.test_matrices["confusion_matrix"] == confusion_matrix(
        y, pred, labels=range(ds.num_classes)).tolist()

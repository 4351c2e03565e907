"""Elastic membership on a real multi-node Ray cluster: node loss, scale-up, min_workers,
scheduler death.

A test that removes a node, or needs a node to appear, adds its own nodes, tagged with a
resource only it uses. The others train on the session's three nodes (``SESSION``): the
integration tier runs one test at a time, so nothing else trains there, and a node that is
already up starts a worker sooner than a fresh one, whose raylet, dashboard agent and
runtime-env agent are still starting beside it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import ray
import torch
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.checkpoint import load_checkpoint
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.runtime.launch import find_coordinator, launch_coordinator
from dynabatch.scheduler.sync.coordinator import Coordinator
from ray.exceptions import GetTimeoutError, RayActorError

from bench.runtime_watch import StartedSpare, record_spares, spares_up, watch_steps
from bench.worker_probes import fail_when_spawned

from .conftest import wait_for

pytestmark = pytest.mark.integration

# The resource every node of the session's cluster carries (tests/integration/conftest.py).
SESSION = "dynabatch_worker"


def idle(workers: int) -> dict:
    """The emulation of a job that trains until the test cancels it: each of its workers
    sleeps 10x its compute, since nothing in such a test depends on the job's speed, and a job
    training flat out would take the 2 cores from the Ray processes the test watches."""
    return {"slowdowns": [10] * workers}


def _spec(tag: str, **kw) -> JobSpec:
    # No spare unless the test is about one: on two saturated cores a spare (a worker process
    # with torch, the model and the data) that nothing adopts only takes CPU from the job.
    base = dict(name=tag, dataset={"name": "digits"}, model={"name": "mlp", "hidden": 64},
                optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}, workers=3,
                min_workers=1, global_batch=64, epochs=3, seed=5, node_resource=tag,
                collective_timeout_s=3, worker_wait_timeout_s=20, spares=0)
    base.update(kw)
    return JobSpec.model_validate(base)


def _nodes(cluster, tag: str, n: int) -> list:
    nodes = [cluster.add_node(num_cpus=1, resources={tag: 1}, object_store_memory=80 * 2**20)
             for _ in range(n)]
    cluster.wait_for_nodes()
    return nodes


def _start(coord: Coordinator) -> threading.Thread:
    t = threading.Thread(target=coord.run, daemon=True)
    t.start()
    return t


def _session_nodes() -> list[str]:
    """The ids of the session's nodes (alive, carrying ``SESSION``)."""
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(SESSION)]


def _node_of(cluster, nodes, node_id: str):
    return next(n for n in nodes if n.node_id == node_id)


def test_nodes_lost_mid_epoch_and_in_an_epochs_last_steps_keep_training(cluster):
    """Two node losses in one job: one mid-epoch, then one in an epoch's last steps (the
    failure the first version could not survive), with a re-plan at every step. One job on
    three nodes of its own instead of one each: two node starts and three worker starts
    fewer, the same two failures."""
    tag = "elastic_loss"
    nodes = _nodes(cluster, tag, 3)
    # Long enough that both lost nodes' workers are dead well before the job could end.
    spec = _spec(tag, epochs=6, model={"name": "mlp", "hidden": 512},
                 rebalance={"mode": "steps", "every_steps": 1})
    coord = Coordinator("loss", spec, resume=False)
    thread = _start(coord)
    wait_for(lambda: coord.epoch == 1 and coord.step_in_epoch >= 4, timeout=120, interval=0.01)
    first = coord.membership.members[-1]
    cluster.remove_node(_node_of(cluster, nodes, first.node), allow_graceful=False)
    wait_for(lambda: coord.protocol.loaded and coord.epoch == 3
             and coord.step_in_epoch >= coord.protocol.steps_per_epoch - 2,
             timeout=120, interval=0.002)
    assert first.worker_id not in {m.worker_id for m in coord.membership.members}
    second = coord.membership.members[-1]
    second_lost_at = time.time()
    cluster.remove_node(_node_of(cluster, nodes, second.node), allow_graceful=False)
    thread.join(timeout=180)
    snap = coord.snapshot()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    failures = [e for e in coord.membership_events() if e.kind == "failure"]
    assert [e.worker for e in failures] == [first.worker_id, second.worker_id]
    # What happened, not how fast: the first loss was seen, and the job regrouped without
    # it, before the second node went; each loss is a regroup of its own.
    assert failures[0].time < second_lost_at <= failures[1].time
    assert failures[0].generation < failures[1].generation
    assert snap.generation >= 3
    for rec in coord.history():
        assert rec.verified and rec.samples_trained == rec.dataset_size
    # Digits' bar for this model. An uninterrupted run of this spec (0.969; 0.956 at seed 6;
    # a job that lost one node 0.969) used to run first for comparison; its CPU bought less
    # than the checks above (every epoch verified exactly once) and the unit tier's lineage
    # proofs after a loss at every point of an epoch.
    assert snap.test_accuracy >= 0.9, snap.test_accuracy
    assert len(coord.membership.members) == 1


def test_deterministic_worker_error_fails_the_job_quickly_with_the_error(cluster):
    spec = _spec(SESSION, workers=2, epochs=3, max_retries=2, collective_timeout_s=10)
    coord = Coordinator("error", spec, resume=False)
    # Worker 1 raises on every step from epoch 0 step 3, as a bug in its model would.
    fail_when_spawned(coord.runtime, 1, 0, 3)
    snap = coord.run()
    assert snap.state == JobState.FAILED
    assert "InjectedFault" in snap.reason and "w1" in snap.reason and "3 attempts" in snap.reason
    # The failing worker leaves the group at once, so its peer is never the one that failed
    # (no collective timeout on w0, no eviction of it as a straggler): every failed attempt
    # is w1's own error, and w0 stays a member throughout.
    failed = [x.message for x in coord.logs() if x.level == "WARNING" and " failed: " in x.message]
    assert len(failed) == 3 and all("w1 raised InjectedFault" in m for m in failed), failed
    assert not [e for e in coord.membership_events() if e.worker == "w0" and e.kind != "join"]


def test_straggler_beyond_the_collective_timeout_is_evicted(cluster):
    # Worker 2 turns 1000x slower at epoch 1 step 2: a step then computes for a second or
    # two, beyond collective_timeout_s=1 but within the grace after which a worker that
    # does not answer at all counts as hung.
    spec = _spec(SESSION, epochs=3, collective_timeout_s=1, worker_wait_timeout_s=30,
                 model={"name": "mlp", "hidden": 256},
                 emulation={"slowdowns": [1, 1, 1],
                            "disturbances": [{"worker": 2, "factor": 1000, "epoch": 1,
                                              "step": 2}]})
    coord = Coordinator("straggler", spec, resume=False)
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    (ev,) = [e for e in coord.membership_events() if e.kind == "evict"]
    assert ev.worker == "w2" and "straggler" in ev.reason
    assert len(coord.membership.members) == 2
    assert all(r.verified for r in coord.history())


def test_joining_node_gets_a_worker_and_a_share_by_speed(cluster):
    tag = "elastic_join"
    _nodes(cluster, tag, 2)
    # The newcomer (ordinal 2) is emulated 3x slower than the first two.
    # LeNet steps are compute-bound (few parameters, per-step overhead of a few samples),
    # so the share that equalises finish times is close to proportional to speed. Every
    # worker sleeps as long again as it computes (2, 2, 6), and the job has 24 epochs: a
    # node's start on a loaded host (a CI run joined it at epoch 14 of 16) leaves epochs
    # to watch the newcomer in, without taking more of the cores.
    spec = _spec(tag, workers=2, max_workers=3, epochs=24, global_batch=128, spares=1,
                 dataset={"name": "mnist", "options": {"n_train": 4000, "n_test": 500}},
                 model={"name": "lenet"}, optimizer={"name": "sgd", "lr": 0.05},
                 emulation={"slowdowns": [2, 2, 6]})
    coord = Coordinator("join", spec, resume=False)
    thread = _start(coord)
    wait_for(lambda: coord.epoch >= 1, timeout=120, interval=0.05)
    _nodes(cluster, tag, 1)
    wait_for(lambda: len(coord.membership.members) == 3, timeout=60, interval=0.05)
    joined_epoch = coord.epoch
    assert joined_epoch <= spec.epochs - 6, "the job ended too soon to watch the newcomer"
    # Six epochs with the newcomer show its share (two to follow its speed, the median of
    # the three after); the job's other epochs would only take the cores.
    wait_for(lambda: len(coord.history()) >= joined_epoch + 6 or coord.state.is_terminal,
             timeout=240, interval=0.1)
    if not coord.state.is_terminal:
        coord.cancel("the newcomer's share is seen")
    thread.join(timeout=120)
    snap = coord.snapshot()
    assert snap.state in (JobState.SUCCEEDED, JobState.CANCELLED), snap.reason
    joins = [e for e in coord.membership_events() if e.kind == "join" and e.worker == "w2"]
    assert joins
    # Within 2 epochs of joining, its share follows its speed.
    last = coord.history()[joined_epoch + 2]
    by = {w.worker: w for w in last.workers}
    assert set(by) == {"w0", "w1", "w2"}
    # Three times slower: about a third of a fast worker's share by speed, less for its fixed
    # per-step cost, paid three times over. How close it gets, and whether it then finishes
    # with the others, is a timing question for bench/: on this 2-vCPU VM it depends on how
    # the emulated nodes contend for the cores.
    shares = {k: v.batch for k, v in by.items()}
    fast = (by["w0"].batch + by["w1"].batch) / 2
    # Its first share came from its resources (equal to the others'); within 2 epochs it
    # is cut well below theirs, and by the end to at most 0.6 of it: the median over the
    # last 3 epochs, since one epoch's plan can follow one noisy measurement (a fresh-clone
    # run ended at 61/37 between the two equal fast workers, and 30 for the newcomer).
    assert 0 < by["w2"].batch <= 0.75 * fast, shares
    ends = [{w.worker: w.batch for w in r.workers} for r in coord.history()[-3:]]
    ratios = [b["w2"] / ((b["w0"] + b["w1"]) / 2) for b in ends]
    assert all(b["w2"] > 0 for b in ends) and float(np.median(ratios)) <= 0.6, ends

    assert last.samples_trained == last.dataset_size


def test_below_min_workers_fails_with_reason_within_timeout(cluster):
    tag = "elastic_min"
    nodes = _nodes(cluster, tag, 2)
    spec = _spec(tag, workers=2, min_workers=2, epochs=50, worker_wait_timeout_s=4)
    coord = Coordinator("min", spec, resume=False)
    thread = _start(coord)
    wait_for(lambda: coord.state == JobState.RUNNING and coord.step_in_epoch >= 2, timeout=120,
             interval=0.01)
    cluster.remove_node(nodes[0], allow_graceful=False)
    wait_for(lambda: coord.state == JobState.PENDING or coord.state.is_terminal, timeout=30,
             interval=0.05)
    if coord.state == JobState.PENDING:
        assert "waiting for nodes" in (coord.reason or "")
    # A liveness bound, not a timing: the job gives up (worker_wait_timeout_s is 4 s) instead
    # of waiting for the node forever.
    thread.join(timeout=120)
    assert not thread.is_alive(), "the job kept waiting for a node below min_workers"
    snap = coord.snapshot()
    assert snap.state == JobState.FAILED
    assert "below the minimum of 2 (min_workers)" in snap.reason


def test_killed_coordinator_resumes_from_checkpoint_with_identical_weights(cluster, tmp_path):
    spec = _spec(SESSION, workers=2, epochs=3, policy="static",
                 checkpoint={"dir": str(tmp_path / "a"), "every_epochs": 1})
    # Uninterrupted reference.
    ref = Coordinator("resume-ref", spec, resume=False).run()
    assert ref.state == JobState.SUCCEEDED
    ref_w = load_checkpoint(tmp_path / "a", "resume-ref")["weights"]["model"]

    spec_b = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
        update={"dir": str(tmp_path / "b")})})
    handle = launch_coordinator("resume-job", spec_b, detached=True, resume=False)
    # Killed anywhere after its first epoch's checkpoint (a window of two epochs), and
    # while it still runs; the snapshot it was killed after is in the failure message.
    seen = []

    def past_first_epoch() -> bool:
        # Until its process is up (Ray and torch imported, on a loaded host more than the
        # call's 10 s: a fresh-clone run failed here) the actor answers nothing: not yet.
        try:
            seen.append(ray.get(handle.snapshot.remote(), timeout=10))
        except GetTimeoutError:
            return False
        return seen[-1].epoch >= 1 or seen[-1].state.is_terminal

    try:
        try:
            wait_for(past_first_epoch, timeout=120, interval=0.05)
        except TimeoutError:
            last = seen[-1] if seen else None
            raise AssertionError(
                "never answered" if last is None
                else f"still at {last.state} epoch {last.epoch}: {last.reason}") from None
    finally:
        # Detached: left running, its two workers would hold two of the session's three
        # nodes into the next test (whose spare then found no idle node).
        ray.kill(handle, no_restart=True)
    last = seen[-1]
    assert not last.state.is_terminal and last.epoch < 3, (last.state, last.reason, last.epoch)
    wait_for(lambda: find_coordinator("resume-job") is None, timeout=30)
    ckpt = load_checkpoint(tmp_path / "b", "resume-job")
    assert ckpt["epoch"] >= 1
    # A new scheduler for the same job id picks the checkpoint up.
    resumed = Coordinator("resume-job", spec_b, resume=True)
    assert resumed.epoch == ckpt["epoch"]
    snap = resumed.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    assert len(resumed.history()) == 3
    final = load_checkpoint(tmp_path / "b", "resume-job")["weights"]["model"]
    for k, v in ref_w.items():
        assert torch.equal(final[k], v), k


def test_scale_up_adopts_a_spare_that_holds_no_cpu_until_then(cluster, monkeypatch):
    """A 2-worker job on 3 nodes keeps a spare on the idle one, holding none of its CPU;
    a scale-up adopts it (it reserves the CPU, then trains), and nothing of it outlives
    the job."""
    from dynabatch.scheduler.runtime import ray_runtime
    from ray._private.state import available_resources_per_node

    nodes = _session_nodes()
    assert len(nodes) == 3, nodes

    def free_cpus() -> dict[str, float]:
        avail = available_resources_per_node()
        return {n: avail.get(n, {}).get("CPU", 0.0) for n in nodes}

    coord = Coordinator("spare", _spec(SESSION, workers=2, max_workers=2, epochs=500, spares=1,
                                       emulation=idle(2)), resume=False)
    trained: set[str] = set()  # the workers that trained a step
    watch_steps(coord.runtime, lambda row: trained.update(r.worker for r in row))
    spares: dict[str, StartedSpare] = {}  # node id -> the spare started there
    monkeypatch.setattr(ray_runtime, "start_spare", record_spares(spares))
    thread = _start(coord)
    try:
        up = wait_for(lambda: spares_up(spares), timeout=120, interval=0.05)
        (node,) = up
        assert node not in {m.node for m in coord.membership.members}
        wait_for(lambda: free_cpus()[node] == 1.0, timeout=10)  # the spare reserves nothing
        coord.scale(3)
        wait_for(lambda: "w2" in trained, timeout=30, interval=0.05)
        # The spare's own actor took the identity (no fresh worker was started).
        assert ray.get(spares[node].handle.info.remote(), timeout=30)["worker"] == "w2"
        assert coord.membership.get("w2").node == node
        assert free_cpus()[node] == 0.0  # adopted: its CPU is reserved like a fresh worker's
    finally:
        coord.cancel("test done")
        thread.join(timeout=60)
    assert coord.snapshot().state == JobState.CANCELLED
    assert node in spares
    for spare in spares.values():  # adopted or not, no spare outlives the job
        with pytest.raises(RayActorError):
            ray.get(spare.handle.info.remote(), timeout=30)
    wait_for(lambda: set(free_cpus().values()) == {1.0}, timeout=20)  # all released


def test_scale_up_shares_a_node_with_room_or_says_why_not(cluster):
    """Issue 24 item 1: on one 2-CPU node, a 1-worker job scaled to 2 starts its second
    worker on that node (it has the CPU); scaled to 3, the reply says at once that no node
    has room, and the status keeps saying it."""
    tag = "elastic_share"
    cluster.add_node(num_cpus=2, resources={tag: 1}, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    coord = Coordinator("share", _spec(tag, workers=1, max_workers=3, epochs=500,
                                       emulation=idle(3)), resume=False)
    thread = _start(coord)
    try:
        wait_for(lambda: coord.state == JobState.RUNNING and coord.epoch >= 1, timeout=120,
                 interval=0.05)
        assert coord.scale(2).reason is None
        wait_for(lambda: len(coord.membership.members) == 2, timeout=60, interval=0.05)
        assert len({m.node for m in coord.membership.members}) == 1  # both on the one node
        snap = coord.scale(3)
        assert "2 of 3 requested workers placed" in (snap.reason or ""), snap.reason
        time.sleep(1.0)
        assert len(coord.membership.members) == 2
        assert "2 of 3 requested workers placed" in (coord.snapshot().reason or "")
    finally:
        coord.cancel("test done")
        thread.join(timeout=60)
    assert coord.snapshot().state == JobState.CANCELLED

"""Issue 32 item 3: one source for a worker's speed and one for the batch in force.

A worker's speed is the tracker's (:attr:`WorkerTrack.speed`); the live snapshot, the
epoch record, the evaluation's split and a scale-down's choice all read it, so on a run
driven through the fakes they agree. The batch in force is the protocol's
(:attr:`SyncProtocol.global_batch`, where training (re)starts until the data loads): the
snapshot and the checkpoint read it."""

from __future__ import annotations

import pytest
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator

from tests.fakes import sim_runtime
from tests.unit.test_engine_faults import _spec


def _coord(**kw) -> tuple[Coordinator, SimRuntime]:
    spec = _spec(**kw)
    rt = sim_runtime(spec, n_train=2048, speeds={0: 1000, 1: 500, 2: 250}, overhead_s=0.004)
    return Coordinator("job", spec, runtime=rt, clock=rt.clock), rt


def test_the_snapshot_the_record_and_the_tracker_agree_on_a_workers_speed():
    # Affine re-sizes the shares mid-epoch: the window since that decision, the last
    # segment and the epoch's totals then give three different speeds (the per-step
    # overhead makes samples per second depend on the batch).
    coord, _ = _coord(epochs=2)
    snap = coord.run()
    last = coord.history()[-1]
    tracks = coord.tracker.workers
    by_record = {w.worker: w.throughput for w in last.workers}
    by_snapshot = {w.worker: w.throughput for w in snap.workers}
    assert by_record and by_snapshot.keys() == by_record.keys()
    for w, v in by_record.items():
        assert v > 0
        assert by_snapshot[w] == pytest.approx(v, rel=1e-9), w
        assert tracks[w].speed == pytest.approx(v, rel=1e-9), w
    # A scale-down drains by the same speeds.
    assert coord.tracker.speeds() == pytest.approx(by_record, rel=1e-9)


def test_the_batch_in_force_is_the_restored_one_until_the_data_is_loaded(tmp_path):
    # A checkpoint taken mid-epoch where the job trained a global batch of 48, under a
    # spec whose schedule says 64 (goodput had moved it, say): the snapshot, the protocol
    # the job loads and a checkpoint saved before it loads its data all say 48.
    from dynabatch.scheduler.checkpoint import load_checkpoint, save_checkpoint

    spec = _spec(epochs=3, checkpoint={"dir": str(tmp_path)})
    save_checkpoint(
        tmp_path,
        "job",
        {
            "job_id": "job",
            "epoch": 1,
            "step": 3,
            "weights": {"model": {}},
            "history": [],
            "counters": {"rebalances_total": 0, "retried_samples_total": 0},
            "schedule": {"epoch": 1, "step": 3, "global_batch": 48, "regime": {}},
        },
    )
    rt = sim_runtime(spec, n_train=2048, speeds={0: 1000, 1: 500, 2: 250})
    coord = Coordinator("job", spec, runtime=rt, clock=rt.clock)
    assert spec.global_batch == 64 and not coord.protocol.loaded
    assert coord.snapshot().global_batch == 48
    coord.checkpoints.save(reason="test")
    assert load_checkpoint(tmp_path, "job")["schedule"]["global_batch"] == 48
    coord.step()
    assert coord.protocol.global_batch == coord.snapshot().global_batch == 48


def test_a_checkpoint_written_before_the_ledger_kept_the_retried_total_keeps_it(tmp_path):
    # Its counters held the job's retried samples, and its ledger state only the epoch's:
    # the resumed job reports the old total (its rebalances are its history's: none).
    from dynabatch.scheduler.checkpoint import save_checkpoint
    from dynabatch.scheduler.core.ledger import Ledger

    spec = _spec(epochs=3, checkpoint={"dir": str(tmp_path)})
    ledger = Ledger()
    ledger.begin_epoch(1, 2048)
    ledger.retry(3)
    state = ledger.to_state()
    del state["retried_total"]
    save_checkpoint(tmp_path, "job", {
        "job_id": "job", "epoch": 1, "step": 3, "weights": {"model": {}}, "history": [],
        "ledger": state,
        "counters": {"rebalances_total": 5, "retried_samples_total": 7, "next_ordinal": 3},
        "schedule": {"epoch": 1, "step": 3, "global_batch": 64, "regime": {}}})
    rt = sim_runtime(spec, n_train=2048, speeds={0: 1000, 1: 500, 2: 250})
    snap = Coordinator("job", spec, runtime=rt, clock=rt.clock).snapshot()
    assert (snap.retried_samples_total, snap.rebalances_total) == (7, 0)


@pytest.mark.parametrize("policy", ["static", "dbs", "affine"])
@pytest.mark.parametrize("mode", ["epoch", "steps", "adaptive"])
def test_the_threshold_becomes_min_gain_where_validation_says_it_applies(policy, mode):
    # One rule (RebalanceSpec.min_gain): the driver's policy takes the threshold exactly
    # where validation does not warn that it is ignored.
    import warnings

    from dynabatch.actors.spec import JobSpec
    from dynabatch.scheduler.core.sync.policy import policy_for

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = JobSpec.model_validate(
            {"policy": policy, "rebalance": {"mode": mode, "threshold": 0.2}}
        )
    ignored = any("rebalance.threshold is ignored" in str(w.message) for w in caught)
    applies = mode == "adaptive" and policy != "static"
    assert ignored is not applies
    expected = policy_for(policy, 0.2 if applies else None)
    assert policy_for(spec.policy, spec.rebalance.min_gain(spec.policy)) == expected
    coord = Coordinator("job", spec, runtime=sim_runtime(spec, n_train=64), resume=False)
    assert coord.epochs.policy == expected

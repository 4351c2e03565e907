"""The real coordinator (its machines and its driver code) under injected faults, without
Ray: every state holder lost at once; deterministic errors; stragglers; evaluations that
always raise; cancel and resume; plans that become infeasible; random fault schedules. (A
worker lost at every point of a segment, a regroup, a checkpoint or an evaluation, hung or
failing unevenly: ``test_sim_faults.py``, one test per fault kind.)

After every run two things are checked from what happened, not from the plan:

* each epoch's record is ``verified`` by the ledger, from the workers' reports;
* the surviving model's lineage (the workers' "weights", the test's
  :class:`~tests.fakes.Lineages`, are the list of the (epoch, step) updates they applied) is
  every step of every epoch, each exactly once: nothing skipped, nothing applied twice,
  never restarted from fresh weights.

The runtime is the simulator's (``tests.fakes.sim_runtime``: node ``i`` computes like the
worker of ordinal ``i``) with its fault script (:class:`~dynabatch.scheduler.sim.cluster_spec.
Fault`, workers named by ordinal); nodes fail and join between two steps of the driver as
the simulated cluster's events (the runtime's ``happen``).
"""

from __future__ import annotations

import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.runtime.seam import ShardResult
from dynabatch.scheduler.sim.cluster_spec import Fault
from dynabatch.scheduler.sim.runtime import SimRuntime
from dynabatch.scheduler.sync.coordinator import Coordinator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fakes import Lineages, sim_job, sim_runtime

N, B = 1000, 64  # 16 steps per epoch, the last one partial (40 samples)
SPE = -(-N // B)


def _spec(**kw) -> JobSpec:
    base = dict(
        workers=3,
        min_workers=1,
        global_batch=B,
        epochs=3,
        policy="affine",
        rebalance={"mode": "adaptive"},
        collective_timeout_s=2,
        worker_wait_timeout_s=5,
        start_timeout_s=5,
    )
    base.update(kw)
    return JobSpec.model_validate(base)


SPEEDS = {0: 1000, 1: 500, 2: 250}


def _job(spec: JobSpec, *faults: Fault, **kw) -> tuple[Coordinator, SimRuntime, Lineages]:
    """:func:`~tests.fakes.sim_job` on this file's data (``N`` samples) and speeds."""
    return sim_job(spec, *faults, **{"n_train": N, "speeds": SPEEDS, **kw})


def _fail(rt: SimRuntime, node: str) -> None:
    """The one node of class ``node`` fails now (its worker is lost with it)."""
    rt.happen({"fail": {"class": node, "index": 0}})


def _join(rt: SimRuntime, count: int) -> None:
    """``count`` new nodes (fast ones, of node00's class) join now."""
    rt.happen({"join": {"class": "node00", "count": count}})


def _full_lineage(epochs: int, spe: int = SPE) -> list[tuple[int, int]]:
    return [(e, s) for e in range(epochs) for s in range(spe)]


def _assert_exactly_once(coord: Coordinator, model: Lineages, n: int = N, spe: int = SPE):
    """The job succeeded, every epoch verified, and the survivor's weights (``model``: what
    answers ``lineage(worker)``) hold every step of every epoch once, in order."""
    snap = coord.snapshot()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    hist = coord.history()
    assert [r.epoch for r in hist] == list(range(coord.spec.epochs))
    for r in hist:
        assert r.verified and r.samples_trained == r.dataset_size == n, r
        assert sum(w.partition for w in r.workers) <= n
    survivor = coord.membership.worker_ids[0]
    assert model.lineage(survivor) == _full_lineage(coord.spec.epochs, spe)


def _run_to(coord: Coordinator, epoch: int, step: int) -> None:
    while (coord.epoch, coord.step_in_epoch) < (epoch, step):
        assert coord.step(), coord.snapshot().reason


def test_a_worker_taken_out_is_killed_by_the_next_batch_or_when_the_job_ends():
    """Removing a worker only queues its kill: the engine's next batch begins with it, and
    a job that ends first (a failure unwinds the step) kills it as it shuts down."""
    coord, rt, _ = _job(_spec())
    _run_to(coord, 1, 2)
    coord.workforce.remove("w1", "failure", "lost (test)")
    assert rt.record.killed == [] and coord.workforce.leaving == ["w1"]
    assert coord.step()
    assert rt.record.killed == ["w1"] and coord.workforce.leaving == []
    coord.workforce.remove("w2", "evict", "straggler (test)")
    coord.shutdown()
    assert rt.record.killed[1] == "w2" and coord.workforce.leaving == []
    assert sorted(set(rt.record.killed)) == sorted(rt.record.killed)  # each once


def test_the_first_start_waits_for_its_workers_and_gives_up_those_not_up_in_time():
    """The first start waits for its workers half a second at a time (the engine's
    ``AwaitStarts``): up 3 s after they were started, they form the group and train at once.
    Not up within the start timeout, they are given up (``GiveUpStarts``), killed once
    each, and the job waits for workers; a cancel that comes during the wait gives them up
    at once and cancels the job."""
    coord, rt, _ = _job(_spec(start_timeout_s=5), start_s=3.0)
    t0 = rt.clock.now()
    assert coord.step()
    assert sorted(coord.membership.worker_ids) == ["w0", "w1", "w2"]
    assert coord.snapshot().state == JobState.RUNNING and coord.step_in_epoch > 0
    assert 3.0 <= rt.clock.now() - t0 < 4.0 and rt.record.killed == []

    coord, rt, _ = _job(_spec(start_timeout_s=2, worker_wait_timeout_s=60), start_s=30.0)
    t0 = rt.clock.now()
    assert coord.step()
    assert 2.0 <= rt.clock.now() - t0 < 3.0  # the timeout, then WaitForMinimum's pause
    assert sorted(rt.record.killed) == ["w0", "w1", "w2"] and coord.workforce.leaving == []
    assert coord.snapshot().state == JobState.PENDING
    assert not coord.membership.worker_ids and not coord.membership.pending
    given_up = [x.message for x in coord.logs() if "given up" in x.message]
    assert given_up == [f"worker w{i} given up: it could not start in 2s" for i in range(3)]

    class CancelledWhileStarting(SimRuntime):
        """The job is cancelled during the first wait for its workers."""

        def poll_started(self, timeout_s: float):
            coord.cancel()
            return super().poll_started(timeout_s)

    coord, rt, _ = _job(_spec(start_timeout_s=60), start_s=30.0,
                        runtime=CancelledWhileStarting)
    t0 = rt.clock.now()
    assert not coord.step()  # the job ended
    assert rt.clock.now() - t0 < 1.0 and sorted(rt.record.killed) == ["w0", "w1", "w2"]
    assert [x.message for x in coord.logs() if "given up" in x.message] == [
        f"worker w{i} given up: the job was cancelled while it started" for i in range(3)]
    assert coord.snapshot().state == JobState.CANCELLED


def test_loss_at_the_end_when_n_is_a_multiple_of_b():
    n = 10 * B
    coord, _, lineages = _job(_spec(), Fault(kind="die", worker=1, epoch=0, step=9), n_train=n)
    coord.run()
    _assert_exactly_once(coord, lineages, n=n, spe=10)


@pytest.mark.parametrize("step", [0, 8], ids=["at-an-epoch-end", "mid-epoch"])
def test_cancel_then_resume_verifies_every_epoch(step, tmp_path):
    spec = _spec(checkpoint={"dir": str(tmp_path)})
    coord, _, _ = _job(spec)
    _run_to(coord, 1, step)  # step 0 of epoch 1: epoch 0 has just ended
    assert (coord.epoch, coord.step_in_epoch) == (1, step)
    coord.cancel()
    coord.run()
    assert coord.snapshot().state == JobState.CANCELLED

    again, _, lineages = _job(spec)
    again.run()
    _assert_exactly_once(again, lineages)
    # Worker ids continue after the checkpoint's: never reused for another worker.
    assert min(int(w[1:]) for w in again.membership.worker_ids) >= 3


def test_a_resumed_epochs_record_counts_the_rebalances_made_before_the_cancel(tmp_path):
    """A rebalance made mid-epoch before a cancel happened in that epoch: the resumed
    epoch's record counts it, and the job's total is its history's sum (one count)."""
    spec = _spec(checkpoint={"dir": str(tmp_path)})
    coord, _, _ = _job(spec)
    _run_to(coord, 0, 6)
    before = coord.snapshot().rebalances_total
    assert before >= 1  # the speeds 4x apart are rebalanced within the first steps
    coord.cancel()
    coord.run()

    again, _, _ = _job(spec)
    snap = again.run()
    assert snap.state == JobState.SUCCEEDED
    history = again.history()
    assert history[0].rebalances >= before
    assert snap.rebalances_total == sum(r.rebalances for r in history)
    assert snap.retried_samples_total == sum(r.retried_samples for r in history)


def test_resumed_weights_survive_the_loss_of_the_member_carrying_them(tmp_path):
    spec = _spec(checkpoint={"dir": str(tmp_path)})
    coord, _, _ = _job(spec)
    _run_to(coord, 1, 5)
    coord.cancel()
    coord.run()
    # The first newcomer, w3: rank 0, loaded with the weights.
    again, _, lineages = _job(spec, Fault(kind="die_in_regroup", worker=3))
    again.run()
    _assert_exactly_once(again, lineages)
    assert [e.worker for e in again.membership_events() if e.kind == "failure"] == ["w3"]


def _lose_everyone(rt: SimRuntime) -> None:
    """Every node fails at once; as many fresh ones join."""
    for i in range(3):
        _fail(rt, f"node{i:02d}")
    _join(rt, 3)


def test_every_holder_lost_rolls_back_to_the_checkpoint(tmp_path):
    coord, rt, lineages = _job(_spec(checkpoint={"dir": str(tmp_path)}))
    _run_to(coord, 1, 6)
    _lose_everyone(rt)
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert any("rolling back" in line.message for line in coord.logs())


def test_every_holder_lost_without_a_checkpoint_fails_with_the_reason():
    coord, rt, _ = _job(_spec())
    _run_to(coord, 1, 6)
    _lose_everyone(rt)
    snap = coord.run()
    assert snap.state == JobState.FAILED
    assert "no checkpoint" in snap.reason and "fresh" in snap.reason
    assert rt.record.regroups == 1  # never formed a group from fresh weights


def test_deterministic_error_fails_the_job_after_bounded_retries():
    coord, rt, _ = _job(_spec(max_retries=2), Fault(kind="error", worker=1, epoch=0, step=3))
    t0 = rt.clock.now()
    snap = coord.run()
    assert snap.state == JobState.FAILED
    assert "w1" in snap.reason and "InjectedFault" in snap.reason and "3 attempts" in snap.reason
    assert rt.record.segments <= 2 + 3  # the steps before, then 3 attempts
    assert rt.clock.now() - t0 < 4 * (coord.spec.collective_timeout_s + 1)


class _StopsEvaluating(SimRuntime):
    """Ends a job that evaluates without end (as the driver did) instead of hanging the
    test: its 100th evaluation raises, and the driver turns the raise into an internal
    error."""

    def _evaluate(self, shards: dict[str, tuple[int, int]], split: str = "test"
                  ) -> list[ShardResult]:
        if self.record.evaluations >= 100:
            raise RuntimeError("evaluated 100 times")
        return super()._evaluate(shards, split)


@pytest.mark.parametrize("checkpoints", [False, True], ids=["plain", "checkpointed"])
def test_an_evaluation_that_always_raises_fails_the_job_after_bounded_retries(
    checkpoints, tmp_path
):
    # A metric that passed the two-sample check at load time but raises on real batches:
    # w1's shard fails every time. The epochs' evaluations and the final one evaluated
    # again count as one budget; the job fails once it is spent, with one line.
    kw = {"checkpoint": {"dir": str(tmp_path)}} if checkpoints else {}
    error = "metrics.0: 'mae' failed on this dataset and model (ValueError: bad shape)"
    fault = Fault(kind="eval_error", worker=1, error=error)
    coord, rt, _ = _job(_spec(max_retries=5, **kw), fault, runtime=_StopsEvaluating)
    snap = coord.run()
    assert snap.state == JobState.FAILED, snap.reason
    assert "\n" not in snap.reason
    assert "evaluation of epoch" in snap.reason and "on w1" in snap.reason, snap.reason
    assert "metrics.0: 'mae'" in snap.reason and "ValueError: bad shape" in snap.reason
    assert "6 attempts; max_retries=5" in snap.reason
    assert rt.record.evaluations == 6  # 1 attempt, then max_retries more
    assert "w1" in coord.membership.worker_ids  # the worker stayed up
    lines = [x.message for x in coord.logs() if "evaluating again" in x.message]
    assert len(lines) <= 5


def test_straggler_past_the_collective_timeout_is_evicted():
    # 4 s: past the collective timeout (2 s), within the grace after it (a longer straggle
    # is a hung worker, as on Ray).
    fault = Fault(kind="straggle", worker=2, epoch=0, step=3, seconds=4.0)
    coord, _, lineages = _job(_spec(), fault)
    coord.run()
    _assert_exactly_once(coord, lineages)
    (ev,) = [e for e in coord.membership_events() if e.kind == "evict"]
    assert ev.worker == "w2" and "straggler" in ev.reason
    assert ev.node in coord.membership.excluded_nodes  # no new worker on its node
    assert "w2" not in coord.membership.worker_ids


def test_plan_that_becomes_infeasible_waits_with_the_reason_then_fails():
    coord, rt, _ = _job(_spec(max_batch=24))  # 3 x 24 hold B=64; 2 x 24 do not
    assert coord.membership.min_size == 3
    _run_to(coord, 0, 4)
    _fail(rt, "node01")  # the other two nodes' one CPU each is their worker's
    seen = []
    while coord.step():
        seen.append(coord.snapshot().reason or "")
    snap = coord.snapshot()
    assert snap.state == JobState.FAILED
    assert any("max_batch 24 x workers must hold global_batch 64" in r for r in seen)
    assert "below the minimum of 3" in snap.reason


def test_plan_that_becomes_infeasible_resumes_when_a_node_joins():
    coord, rt, lineages = _job(_spec(max_batch=24))
    _run_to(coord, 0, 4)
    _fail(rt, "node01")
    for _ in range(5):
        coord.step()
    assert coord.snapshot().state == JobState.PENDING
    _join(rt, 1)
    coord.run()
    _assert_exactly_once(coord, lineages)
    # The job's state followed its loop's: RUNNING once formed, PENDING while it waited
    # (saying for what), RUNNING again once a group formed, then its outcome.
    moves = [x.message for x in coord.logs() if x.message.startswith("state ")]
    assert [m.split(":")[0] for m in moves] == [
        "state RUNNING", "state PENDING", "state RUNNING", "state SUCCEEDED"]
    assert moves[1].startswith("state PENDING: waiting for nodes: ")


def test_workers_auto_is_bounded_by_the_global_batch():
    spec = _spec(workers="auto", global_batch=8, min_workers=None)
    rt = sim_runtime(spec, n_train=100, nodes=40)
    coord = Coordinator("auto", spec, runtime=rt, clock=rt.clock)
    coord.run()
    assert len(coord.membership.members) == 8
    # Never spawned more than it could use.
    assert len(rt.record.fresh) + len(rt.record.adopted) == 8


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    faults=st.lists(
        st.tuples(
            st.sampled_from(["die", "hang", "die_in_regroup", "die_in_checkpoint"]),
            st.integers(0, 5),
            st.integers(0, 2),
            st.integers(0, SPE - 1),
        ),
        max_size=4,
    ),
    uneven=st.booleans(),
)
def test_any_fault_schedule_trains_every_sample_exactly_once(tmp_path_factory, faults, uneven):
    """Random faults (workers w0..w5, including newcomers that replace the lost), with
    spare nodes to replace them: the job succeeds and trains each step exactly once, or,
    only when every holder of the state was lost before a checkpoint existed, fails with
    that reason."""
    spec = _spec(checkpoint={"dir": str(tmp_path_factory.mktemp("ck"))}, max_workers=3)
    script = [
        Fault(kind=kind, worker=w, epoch=epoch, step=step, uneven=uneven)
        if kind in ("die", "hang")
        else Fault(kind=kind, worker=w)  # at its first such call
        for kind, w, epoch, step in faults
    ]
    coord, _, lineages = _job(spec, *script, nodes=8)
    snap = coord.run()
    if snap.state == JobState.FAILED and "no checkpoint to restore" in snap.reason:
        assert not any("checkpoint (epoch) at" in x.message for x in coord.logs()), snap.reason
        assert all(r.verified for r in coord.history())
        return
    _assert_exactly_once(coord, lineages)


def test_last_holder_lost_in_the_final_checkpoint_retrains_from_the_previous_one(tmp_path):
    """Only the survivor that got furthest holds the final state; it dies while the final
    checkpoint is taken. The job must not report SUCCEEDED with a model missing the last
    step: it rolls back to the previous checkpoint and trains the last epoch again."""
    coord, _, lineages = _job(
        _spec(checkpoint={"dir": str(tmp_path)}),
        Fault(kind="die", worker=0, epoch=2, step=SPE - 1, uneven=True),
        Fault(kind="die_in_checkpoint", worker=1),  # w1: the survivor whose all-reduce finished
    )
    coord.run()
    _assert_exactly_once(coord, lineages)
    assert any("rolling back" in x.message for x in coord.logs())


@pytest.mark.parametrize("policy", ["dbs", "affine"])
def test_each_epoch_replans_from_the_current_allocation(policy):
    """At an epoch's start the policy sees the allocation in force: DBS scales it (a counted
    rebalance), and affine keeps a converged one (its hysteresis spans epochs)."""
    coord, _, _ = _job(_spec(policy=policy, rebalance={"mode": "epoch"}, epochs=5))
    snap = coord.run()
    hist = coord.history()
    assert snap.rebalances_total >= 1 and hist[1].rebalances == 1, [r.rebalances for r in hist]
    last = {w.worker: w.batch for w in hist[-1].workers}
    assert last["w0"] > last["w1"] > last["w2"], last
    if policy == "affine":  # noise-free speeds: converged, then kept
        assert [r.rebalances for r in hist[2:]] == [0, 0, 0]


class _UserErrorInEvaluation(SimRuntime):
    """w1's shard raises a user error (a token id beyond the vocabulary, seen only in the
    held-out set) every time it is scored."""

    def _evaluate(self, shards: dict[str, tuple[int, int]], split: str = "test"
                  ) -> list[ShardResult]:
        out = super()._evaluate(shards, split)
        return [ShardResult(r.worker, seconds=r.seconds, user=True,
                            error="TokenIdError: model.options.config.vocab_size: token id 60 "
                                  "in the batch's input_ids is at or above the model's "
                                  "vocab_size 50") if r.worker == "w1" else r for r in out]


def test_a_user_error_in_evaluation_fails_the_job_at_once_as_in_training():
    coord, rt, _ = _job(_spec(max_retries=5), runtime=_UserErrorInEvaluation)
    snap = coord.run()
    assert snap.state == JobState.FAILED, snap.reason
    assert "evaluation of epoch 0 failed on w1" in snap.reason, snap.reason
    assert "token id 60" in snap.reason and "not retried" in snap.reason
    assert rt.record.evaluations == 1  # no second attempt
    assert not [x for x in coord.logs() if "evaluating again" in x.message]

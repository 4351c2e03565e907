"""bench/sim_fidelity.py's pure parts: the epoch mean it compares, the recovery it counts
(bench/disturbance.py's definition), and the round trip report -> fitted cluster ->
simulation on a report the simulator wrote itself (no Ray)."""

from types import SimpleNamespace

import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.api.cli.run import write_report
from dynabatch.api.cli.simulate import simulation_block
from dynabatch.scheduler.sim.cluster_spec import parse_cluster
from dynabatch.scheduler.sim.simulator import simulate

pytest.importorskip("torch")


def _step(epoch: int, step: int, times: list[float]) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(worker=f"w{i}", epoch=epoch, step=step, batch=64, compute_s=t)
        for i, t in enumerate(times)
    ]


def test_recovery_counts_steps_until_balance_holds_for_three_steps():
    from bench.sim_fidelity import recovery

    even, slowed, halfway = [1.0] * 4, [1.0, 1.0, 1.0, 4.0], [1.0, 1.0, 1.0, 1.5]
    reports = [_step(0, s, even) for s in range(8)]
    # From epoch 1 step 4: two steps at the slowdown, a partial re-plan, one step back at
    # target, a noisy dip, then three balanced steps (recovered 5 steps after it began).
    epoch1 = [even] * 4 + [slowed, slowed, halfway, even, halfway] + [even] * 3
    reports += [_step(1, s, t) for s, t in enumerate(epoch1)]
    reports.insert(3, [])  # a step no worker reported is skipped
    rec = recovery(reports, at=4)
    assert rec["steps"] == 5
    assert rec["per_step_balance"][:5] == [1.0, 1.0, 1.0, 0.438, 0.438]
    assert (
        recovery(
            [_step(0, s, even) for s in range(4)] + [_step(1, s, slowed) for s in range(8)], at=2
        )["steps"]
        is None
    )


def test_steady_epoch_leaves_out_the_first_epoch_and_needs_a_second():
    from bench.sim_fidelity import relative_error, steady_epoch_s

    hist = [SimpleNamespace(wall_s=w) for w in (5.0, 1.0, 2.0)]
    assert steady_epoch_s(hist) == pytest.approx(1.5)
    assert relative_error(1.2, 1.5) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="history: 1 epochs, none after the first 1"):
        steady_epoch_s(hist[:1])


def test_a_report_fits_a_cluster_that_simulates_the_run_it_came_from(tmp_path):
    from bench.sim_fidelity import fitted_cluster, held_out, run_in_sim

    spec = JobSpec.model_validate(
        {
            "name": "fidelity",
            "dataset": {"name": "mnist", "options": {"n_train": 2048, "n_test": 128}},
            "workers": 2,
            "global_batch": 256,
            "epochs": 4,
            "policy": "affine",
            "emulation": {"slowdowns": [1, 3]},
        }
    )
    cluster = parse_cluster(
        {
            "classes": [{"name": "n", "count": 2, "a_ms": 2, "c_ms_per_sample": 0.1}],
            "allreduce": {"alpha_ms": 3, "beta_ms_per_mb": 0, "model_mb": 0},
        }
    )
    run = simulate(spec, cluster)
    report = tmp_path / "run.json"
    write_report(report, run.spec, run.snapshot, run.history,
                 simulation=simulation_block(run, real_gradients=False))
    fitted, numbers = fitted_cluster(report, spec)
    assert numbers["rest_of_step_ms"] == pytest.approx(6.0, rel=1e-3)  # 2(n-1)·α, n = 2
    again, _ = run_in_sim(spec, fitted)
    assert [r.wall_s for r in again[1:]] == pytest.approx(
        [r.wall_s for r in run.history[1:]], rel=0.02
    )
    out = held_out(spec, report, run.history, 2)
    assert out["fitted_from_epochs"] == "0..1" and out["compared_epochs"] == "2..3"
    assert out["error"] < 0.02

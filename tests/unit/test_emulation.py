"""Heterogeneity emulation: slowdown schedules and the compute clock."""

from __future__ import annotations

import time

import pytest
import torch
from dynabatch.actors.emulation import ComputeClock, slowdown_at
from dynabatch.actors.spec import EmulationSpec


def test_slowdown_schedule_applies_base_factors_and_later_disturbances():
    em = EmulationSpec.model_validate(
        {
            "slowdowns": [1, 2],
            "disturbances": [
                {"worker": 0, "factor": 4, "epoch": 1, "step": 5},
                {"worker": 0, "factor": 8, "epoch": 2, "step": 0},
            ],
        }
    )
    assert slowdown_at(em, 0, 0, 99) == 1
    assert slowdown_at(em, 0, 1, 4) == 1
    assert slowdown_at(em, 0, 1, 5) == 4
    assert slowdown_at(em, 0, 2, 0) == 8
    assert slowdown_at(em, 1, 3, 3) == 2
    assert slowdown_at(em, 7, 0, 0) == 1  # a worker beyond the list is not slowed


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_emulated_clock_stretches_the_phase_to_factor_times_its_cpu_time():
    clock = ComputeClock(emulated=True)
    # t0 before start(): a preemption between the two would otherwise count in the clock's
    # wall time but not in the test's, and the phase (already past its target) not sleep.
    t0 = time.perf_counter()
    clock.start()
    _burn(0.02)
    reported = clock.finish(3.0)
    wall = time.perf_counter() - t0
    assert reported == pytest.approx(0.06, rel=0.15)
    assert wall >= reported


def test_emulated_clock_ignores_time_the_thread_did_not_run():
    """Sleeping (like being preempted by a neighbour) is not compute."""
    clock = ComputeClock(emulated=True)
    clock.start()
    time.sleep(0.05)
    assert clock.finish(1.0) < 0.01


def test_real_clock_is_the_wall_clock():
    clock = ComputeClock(emulated=False)
    t0 = time.perf_counter()
    clock.start()
    time.sleep(0.03)
    reported = clock.finish(5.0)
    # The wall time of the phase, not stretched (bounds that hold however loaded the host).
    assert 0.03 <= reported <= time.perf_counter() - t0


def test_pace_stretches_the_phase_so_far_and_finish_the_rest():
    """The reducer paces before each bucket leaves: by then the phase has taken f x its
    compute so far; finish() stretches the whole phase, and the sleeps are accounted."""
    clock = ComputeClock(emulated=True)
    t0 = time.perf_counter()  # before start(): see the test above
    clock.start()
    _burn(0.02)
    at_pace = clock.pace(4.0)
    assert at_pace == pytest.approx(0.08, rel=0.15)
    assert time.perf_counter() - t0 >= at_pace
    _burn(0.02)
    total = clock.finish(4.0)
    assert total == pytest.approx(0.16, rel=0.15)
    assert time.perf_counter() - t0 >= total
    # What it slept is what the wall clock lacked (less when the thread was preempted).
    assert 0.0 <= clock.slept <= total - 0.04 + 0.01


def test_pace_does_nothing_on_the_real_clock(monkeypatch):
    def no_sleep(seconds: float) -> None:
        raise AssertionError(f"the real clock slept {seconds} s")

    clock = ComputeClock(emulated=False)
    clock.start()
    monkeypatch.setattr(time, "sleep", no_sleep)
    clock.pace(50.0)
    assert clock.slept == 0.0


def test_a_gpu_workers_slowdown_applies_on_the_device_synchronised_wall_clock():
    """Issue 30 item 7: slowdowns were silently ignored on GPU workers (their clock was
    never emulated). The decision, on a faked CUDA device (no GPU needed to build it)."""
    from dynabatch.actors.spec import JobSpec
    from dynabatch.actors.worker import compute_clock

    slowed = JobSpec.model_validate({"workers": 2, "emulation": {"slowdowns": [1, 3]}})
    gpu = compute_clock(slowed, torch.device("cuda", 0))
    assert gpu.emulated and gpu.sync is not None and not gpu.cpu_time
    cpu = compute_clock(slowed, torch.device("cpu"))
    assert cpu.emulated and cpu.sync is None and cpu.cpu_time
    plain = compute_clock(JobSpec.model_validate({}), torch.device("cuda", 0))
    assert not plain.emulated and plain.sync is None


def test_the_synchronised_clock_stretches_device_time_that_is_not_thread_time():
    """A GPU's work: the host waits in the synchronisation (here: sleeps), spending no CPU
    time; the emulated phase is still stretched to f x what the device took."""
    synced = []
    clock = ComputeClock(emulated=True, sync=lambda: synced.append(time.sleep(0.02)))
    clock.start()
    reported = clock.finish(3.0)
    assert synced  # the device's queued work was waited for before reading the clock
    assert reported >= 3.0 * 0.02 * 0.95
    # It slept what the wall clock lacked: (f - 1) x the device's time.
    assert clock.slept == pytest.approx(reported * 2 / 3, rel=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu_check.py)")
def test_on_a_gpu_the_slowed_clock_synchronises_and_stretches():
    from dynabatch.actors.spec import JobSpec
    from dynabatch.actors.worker import compute_clock

    slowed = JobSpec.model_validate({"workers": 1, "emulation": {"slowdowns": [3]}})
    clock = compute_clock(slowed, torch.device("cuda", 0))
    clock.start()
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        a = a @ a / 2048
    took = clock.finish(3.0)
    assert took > 0 and clock.slept == pytest.approx(took * 2 / 3, rel=0.05)


def test_node_slowdown_from_the_nodes_environment():
    from dynabatch.actors.emulation import NODE_SLOWDOWN_ENV, node_slowdown

    assert node_slowdown({}) == 1.0
    assert node_slowdown({NODE_SLOWDOWN_ENV: " 3 "}) == 3.0
    for bad, why in (("fast", "not a number"), ("0.5", "between 1 and 1000")):
        with pytest.raises(ValueError, match=f"{NODE_SLOWDOWN_ENV}=.*{why}"):
            node_slowdown({NODE_SLOWDOWN_ENV: bad})

"""Heterogeneity emulation: slowdown schedules and the compute clock."""

from __future__ import annotations

import time

import pytest
from dynabatch.actors.emulation import ComputeClock, slowdown_at
from dynabatch.actors.spec import EmulationSpec


def test_slowdown_schedule_applies_base_factors_and_later_disturbances():
    em = EmulationSpec.model_validate({
        "slowdowns": [1, 2],
        "disturbances": [{"worker": 0, "factor": 4, "epoch": 1, "step": 5},
                         {"worker": 0, "factor": 8, "epoch": 2, "step": 0}],
    })
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
    clock.start()
    t0 = time.perf_counter()
    _burn(0.02)
    reported = clock.finish(3.0)
    wall = time.perf_counter() - t0
    assert reported == pytest.approx(0.06, rel=0.15)
    assert wall >= reported * 0.95


def test_emulated_clock_ignores_time_the_thread_did_not_run():
    """Sleeping (like being preempted by a neighbour) is not compute."""
    clock = ComputeClock(emulated=True)
    clock.start()
    time.sleep(0.05)
    assert clock.finish(1.0) < 0.01


def test_real_clock_is_the_wall_clock():
    clock = ComputeClock(emulated=False)
    clock.start()
    time.sleep(0.03)
    assert clock.finish(5.0) == pytest.approx(0.03, abs=0.02)


def test_pace_stretches_the_phase_so_far_and_finish_the_rest():
    """The reducer paces before each bucket leaves: by then the phase has taken f x its
    compute so far; finish() stretches the whole phase, and the sleeps are accounted."""
    clock = ComputeClock(emulated=True)
    clock.start()
    t0 = time.perf_counter()
    _burn(0.02)
    at_pace = clock.pace(4.0)
    assert at_pace == pytest.approx(0.08, rel=0.15)
    assert time.perf_counter() - t0 >= at_pace * 0.95
    _burn(0.02)
    total = clock.finish(4.0)
    assert total == pytest.approx(0.16, rel=0.15)
    assert time.perf_counter() - t0 >= total * 0.95
    # What it slept is what the wall clock lacked (less when the thread was preempted).
    assert 0.0 <= clock.slept <= total - 0.04 + 0.01


def test_pace_does_nothing_on_the_real_clock():
    clock = ComputeClock(emulated=False)
    clock.start()
    t0 = time.perf_counter()
    clock.pace(50.0)
    assert time.perf_counter() - t0 < 0.01 and clock.slept == 0.0

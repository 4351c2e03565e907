"""bench/driver_cost.py's simulated mode at a tiny size (no Ray): one JSON object with the
driver's CPU per step for each checkout and, side by side, their ratio; the runtime meter
leaves SimRuntime as it found it; a checkout without its own environment is named."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from dynabatch.scheduler.sim.runtime import SimRuntime

from bench.driver_cost import RuntimeMeter, measure_sim

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "driver_cost.py"
TINY = ["--sim", "2", "--ray", "", "--repeats", "1", "--steps", "2", "--epochs", "2"]


def test_a_tiny_simulated_run_splits_driver_from_runtime_and_restores_the_class():
    before = dict(vars(SimRuntime))
    args = argparse.Namespace(steps=2, epochs=2, skip=1, seed=0)
    got = measure_sim(2, args)
    assert (got["workers"], got["steps"], got["steady_steps"]) == (2, 4, 2)
    assert got["driver_cpu_ms_per_step"] > 0 and got["runtime_cpu_ms_per_step"] > 0
    assert dict(vars(SimRuntime)) == before


def test_the_meter_counts_only_the_outermost_call():
    class Inner:
        def outer(self) -> int:
            return self.inner() + 1

        def inner(self) -> int:
            return sum(range(20_000))

    original = vars(Inner)["outer"]
    with RuntimeMeter(Inner) as meter:
        Inner().outer()
        assert meter._depth == 0 and meter.cpu_s > 0
    assert vars(Inner)["outer"] is original


def test_side_by_side_prints_one_json_object_with_the_ratio():
    p = subprocess.run([sys.executable, str(BENCH), *TINY, "--repo", str(ROOT),
                        "--repo", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["benchmark"] == "driver_cost" and out["ray"] == {}
    assert len(out["checkouts"]) == 2
    entry = out["simulated"]["2"]
    labels = list(out["checkouts"])
    for label in labels:
        assert {"driver_cpu_ms_per_step", "driver_cpu_ms_per_step_all",
                "runtime_cpu_ms_per_step", "steps", "steady_steps"} <= set(entry[label])
    assert entry["ratio"] > 0


def test_a_checkout_without_its_environment_is_named(tmp_path):
    p = subprocess.run([sys.executable, str(BENCH), *TINY, "--repo", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode != 0
    assert f"--repo {tmp_path}: no " in p.stderr and "Traceback" not in p.stderr

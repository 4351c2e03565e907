"""bench/gpu_check.py on a machine without a GPU (issue 49): every check sizes itself to
the device or skips with its reason, so a CPU run finishes instead of hanging in
torch.compile. In process and small; the bare, all-in-child-processes run is
tests/unit/test_collective_plan.py's."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # spawn's children find the module's functions by name
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("gpu_check", None)


def _sizes(gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, gpu: bool, quick: bool):
    monkeypatch.setattr(gpu_check, "_cuda", lambda: gpu)
    return gpu_check._config(argparse.Namespace(quick=quick, hidden=512))


def test_without_a_gpu_the_throughput_check_is_smaller_and_skips_compile(gpu_check, monkeypatch):
    gpu = _sizes(gpu_check, monkeypatch, gpu=True, quick=False)
    cpu = _sizes(gpu_check, monkeypatch, gpu=False, quick=False)
    # The GPU run's CNN at batch 512 over 53 steps took about 230 s on 2 idle cores.
    cost = ("throughput_batch", "steps", "conv_width")
    assert all(cpu[k] < gpu[k] for k in cost), {k: (cpu[k], gpu[k]) for k in cost}
    assert cpu["sized_for"] == "cpu"
    why = cpu.get("cpu_compile_skip")
    assert isinstance(why, str) and "GPU" in why and "budget" in why
    # Also with --quick: the reason a CPU machine gives is the CPU's.
    assert "GPU" in _sizes(gpu_check, monkeypatch, gpu=False, quick=True)["cpu_compile_skip"]


def test_a_gpu_machine_keeps_the_sizes_its_committed_results_were_measured_at(
    gpu_check, monkeypatch
):
    # bench/results-gpu.json: batch 512, the CPU's compiled figure measured.
    cfg = _sizes(gpu_check, monkeypatch, gpu=True, quick=False)
    assert cfg["sized_for"] == "gpu" and cfg["cpu_compile_skip"] is None
    assert (cfg["throughput_batch"], cfg["steps"], cfg["conv_width"]) == (512, 50, 32)
    assert (cfg["data_n"], cfg["data_steps"], cfg["data_hidden"]) == (32768, 96, 1024)
    quick = _sizes(gpu_check, monkeypatch, gpu=True, quick=True)
    assert quick["cpu_compile_skip"] == "not measured with --quick"


def test_the_throughput_check_on_the_cpu_ends_with_its_figures_and_the_skip(gpu_check, monkeypatch):
    cfg = _sizes(gpu_check, monkeypatch, gpu=False, quick=False)
    # The path the CPU sizes take, at a few samples (the sizes are tested above).
    res = gpu_check.run_one("throughput", {**cfg, "throughput_batch": 8, "steps": 2})
    assert res["status"] == "ok", res
    rates = ("cpu_fp32", "cpu_bf16", "cpu_conv_fp32", "cpu_conv_channels_last_fp32")
    assert all(res[k] > 0 for k in rates), res
    assert res["cpu_compiled_fp32"] == cfg["cpu_compile_skip"]
    assert res["gpu"] == "skipped: no GPU"
    assert res["sized_for"].startswith("cpu")
    assert not any(k.startswith("gpu_") for k in res)


def test_the_gpu_only_checks_are_skipped_with_their_reason_in_the_one_json(
    gpu_check, monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(gpu_check, "_cuda", lambda: False)
    out = tmp_path / "gpu.json"
    names = gpu_check.GPU_ONLY
    assert gpu_check.main(["--only", ",".join(names), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    assert list(report["checks"]) == list(names)
    for name, res in report["checks"].items():
        assert res["status"] == "skipped" and res["reason"], (name, res)

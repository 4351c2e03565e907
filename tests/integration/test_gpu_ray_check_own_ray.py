"""bench/gpu_ray_check.py starting a Ray of its own (issue 53): the check's ``ray_start``
in a child process, and the GPU checks skipped with their reason on a machine without a GPU.

Apart from ``test_gpu_ray_check.py`` because it never uses the session's cluster: the check
starts its own head and node in a process of its own, so the module is in
``OWN_RAY_MODULES`` (tests/conftest.py) and runs beside the session cluster's group under
``pytest -n 2 --dist loadgroup``, not in it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_ray_check", ROOT / "bench" / "gpu_ray_check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU does")
def test_ray_starts_and_gpu_checks_skip_with_their_reason_without_a_gpu(tmp_path, capsys):
    out = tmp_path / "r.json"
    only = "ray_start," + ",".join(check.GPU_ONLY)
    assert check.main(["--only", only, "--no-install", "--quick", "--out", str(out)]) == 0
    checks = json.loads(out.read_text())["checks"]
    assert (
        checks["install"]["status"] == "skipped" and "--no-install" in checks["install"]["reason"]
    )
    assert checks["ray_start"]["status"] == "ok", checks["ray_start"]
    assert checks["ray_start"]["nodes"] == 2  # the head and one CPU node
    assert checks["ray_start"]["resources"]["CPU"] == 1
    for name in check.GPU_ONLY:
        assert checks[name] == {"status": "skipped", "reason": "no GPU"}

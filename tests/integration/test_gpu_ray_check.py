"""bench/gpu_ray_check.py's CPU-side paths (issue 53): a bundle installed with no index into
a fresh target and imported from there, and the mixed job with CPU workers only on the
session's cluster (every epoch verified, each worker's share and speed reported). Ray started
by the check itself is in ``test_gpu_ray_check_own_ray.py``, off the session cluster's
worker."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.unit.test_bundle import make_wheel

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_ray_check", ROOT / "bench" / "gpu_ray_check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def small_bundle(folder: Path) -> Path:
    """A bundle as make bundle writes it, of two pure-Python wheels (one needs the other)."""
    folder.mkdir()
    wheels = [
        make_wheel(
            folder,
            "bundled_a",
            {"bundled_a/__init__.py": b"from bundled_b import B\n"},
            ["bundled-b>=1"],
        ),
        make_wheel(folder, "bundled_b", {"bundled_b.py": b"B = 7\n"}),
    ]
    manifest = {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "platforms": [],
        "wheels": [
            {
                "name": w.name.split("-")[0].replace("_", "-"),
                "file": w.name,
                "sha256": hashlib.sha256(w.read_bytes()).hexdigest(),
            }
            for w in wheels
        ],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_bundle_installs_into_a_fresh_target_with_no_index_and_imports_from_it(tmp_path):
    bundle = small_bundle(tmp_path / "bundle")
    res = check.install_bundle(bundle, tmp_path / "site")
    assert res["status"] == "ok", res
    assert res["importable"] and res["modules"] == ["bundled_a", "bundled_b"]
    assert res["unmet"] == [] and res["versions"] == {"bundled-a": "1.0", "bundled-b": "1.0"}
    # Not fresh: refused; a wheel that is not the manifest's: refused before pip runs.
    again = check.install_bundle(bundle, tmp_path / "site")
    assert again["status"] == "fail" and "not empty" in again["error"]
    (bundle / "bundled_b-1.0-py3-none-any.whl").write_bytes(b"not a wheel")
    bad = check.install_bundle(bundle, tmp_path / "other")
    assert bad["status"] == "fail" and "sha256 differs" in bad["error"]


def test_mixed_job_with_cpu_workers_only_verifies_every_epoch_and_reports_shares(cluster):
    cfg = {**check.QUICK_SIZES, "n_train": 512, "global_batch": 64, "epochs": 2}
    res = check.mixed_jobs(cluster.address, None, cfg, resource="dynabatch_worker")
    assert res["problems"] == [] or all("shares" in p for p in res["problems"]), res
    (job,) = res["jobs"].values()
    assert job["state"] == "SUCCEEDED" and job["verified"] and job["epochs"] == 2
    assert len(job["workers"]) == 2
    assert sum(w["share"] for w in job["workers"]) == pytest.approx(1.0, abs=1e-3)
    assert all(w["samples_per_s"] > 0 for w in job["workers"])
    assert res["speedups"] == {
        "status": "skipped",
        "reason": "no GPU: the mixed job ran with CPU workers only",
    }

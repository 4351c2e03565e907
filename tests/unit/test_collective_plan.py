"""One collective plan per group (issue 30, item 1).

A worker whose device is a GPU in a gloo group (any member on the CPU) stages its
gradients through host memory; its CPU peers reduce in place from backward's hooks. Every
member must still issue the same collectives (the same number, in the same order, over the
same offsets), or gloo fails on a size mismatch, hangs, or sums unrelated slices. The plan
(flat or bucketed, and the bucket boundaries) is therefore the group's, not each worker's.

The mixed group here is three processes on the CPU: one forced onto the staged path
(:func:`dynabatch.actors.reducer.stages_through_host`, what a CUDA worker in gloo takes),
two plain CPU workers, on an MLP 784-512-512-10 whose gradients make several of DDP's
buckets, with unequal shares under the weighted all-reduce. The all-reduced gradient must
be the global batch's, as one process computes it.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch
from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.actors.reducer import CollectivePlan, GradientReducer, group_plan
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.worker import Worker

from tests.gloo import run_members_in_groups

B = 24  # the step's global batch
SHARES = (5, 12, 7)  # unequal shares of the three members; rank 0 is the staged one
N = 48  # samples in the data set
TIMEOUT_S = 10  # the group's collective timeout: a mismatch fails or hangs this long


def _spec(**kw) -> JobSpec:
    base = dict(
        dataset={"name": "synthetic"},
        model={"name": "mlp", "hidden": 512},
        workers=len(SHARES),
        global_batch=B,
        optimizer={"name": "sgd", "lr": 0.1},
        collective_timeout_s=TIMEOUT_S,
    )
    base.update(kw)
    return JobSpec.model_validate(base)


def _worker(ordinal: int, **kw) -> Worker:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=N)
    return Worker(f"w{ordinal}", ordinal, _spec(**kw), x, y, (784,), 10)


def _segment(start: int, size: int) -> SegmentPlan:
    return SegmentPlan(0, 0, N, (StepPlan(0, 0, B, start, size),))


# The plans the mixed group is checked under: bucketed with DDP's bucket sizes, flat, and
# bucketed with small buckets.
KWS = ({}, {"allreduce": "flat"}, {"bucket_kb": 256})


def _member(rank: int, rv, more: tuple, staged: bool, out: mp.Queue) -> None:
    """One member of the mixed group (a child process): one step of its share under each of
    :data:`KWS`, each in its own group (``rv``, then ``more``); the all-reduced gradients (or
    the first error) go to ``out``, one report for all of them."""
    from dynabatch.actors import reducer

    if staged:  # the path a CUDA worker takes in a gloo group, forced on the CPU
        reducer.stages_through_host = lambda _device, _backend: True
    got = []
    try:
        for group, kw in zip((rv, *more), KWS, strict=True):
            w = _worker(rank, **kw)
            w.join(group, rank)
            res = w.run_segment(_segment(sum(SHARES[:rank]), SHARES[rank]))
            w.leave()
            grad = w.reducer.flat[: w.reducer.n_params].numpy().copy()
            got.append((res.error, grad, w.reducer.n_buckets))
        out.put((rank, got))
    except Exception as err:  # reported, so the parent fails with it instead of waiting
        out.put((rank, [(f"{type(err).__name__}: {err}", None, None)]))


def _mixed_groups() -> dict[int, list[tuple]]:
    """Each rank's reports under every plan of :data:`KWS`, from one set of members."""
    got = run_members_in_groups(
        _member, len(SHARES), len(KWS), lambda r: (r == 0,), timeout_s=TIMEOUT_S
    )
    return {rank: reports for rank, (reports,) in got.items()}


def _reference(**kw) -> np.ndarray:
    """The global batch's gradient, in one process (a one-rank group)."""
    w = _worker(0, **kw)
    w.join(w.group.open_store(1, 1, "gloo", host="127.0.0.1"), 0)
    try:
        res = w.run_segment(_segment(0, B))
    finally:
        w.leave()
    assert res.error is None, res.error
    return w.reducer.flat[: w.reducer.n_params].numpy().copy()


def test_a_staged_member_and_cpu_members_reduce_the_global_batchs_gradient():
    got = _mixed_groups()
    assert sorted(got) == [0, 1, 2], f"members that answered: {sorted(got)}"
    errors = {r: e for r, reports in got.items() for e, *_rest in reports if e}
    assert not errors, errors
    for i, kw in enumerate(KWS):
        ref = _reference(**kw)
        buckets = {r: reports[i][2] for r, reports in got.items()}
        if kw.get("allreduce") != "flat":
            assert set(buckets.values()) != {1}, f"{kw}: the model must span several buckets"
        for rank, reports in got.items():
            np.testing.assert_allclose(
                reports[i][1], ref, rtol=0, atol=1e-6, err_msg=f"{kw}, rank {rank}"
            )


# --- the plan itself --------------------------------------------------------------------


def _params(sizes) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n)) for n in sizes]


SIZES = (784 * 512, 512, 512 * 512, 512, 512 * 10, 10)


def test_the_plan_is_the_groups_whatever_the_members_device():
    """A GPU member of a gloo group gets the plan its CPU peers get; a GPU-only (NCCL)
    group gets the GPU's smaller buckets."""
    gloo = group_plan("gloo", list(SIZES), "bucketed", None)
    assert gloo == group_plan("gloo", list(SIZES), "bucketed", None)
    assert len(gloo.buckets) == 2  # DDP's sizes: 1 MiB first, then 25 MiB
    nccl = group_plan("nccl", list(SIZES), "bucketed", None)
    assert nccl.bucket_bytes == (669706, 669706) != gloo.bucket_bytes  # a quarter each
    flat = group_plan("gloo", list(SIZES), "flat", None)
    assert flat.mode == "flat"
    # The buckets tile the gradients from the end of the buffer.
    for plan in (gloo, nccl):
        assert plan.buckets[0][1] == sum(SIZES) and plan.buckets[-1][0] == 0
        assert all(a[0] == b[1] for a, b in zip(plan.buckets, plan.buckets[1:], strict=False))


def test_a_reducer_takes_the_groups_plan_and_refuses_one_for_another_model():
    r = GradientReducer(_params(SIZES), torch.device("cpu"), max_step=8)
    plan = group_plan("nccl", list(SIZES), "bucketed", None)
    r.use_plan(plan, staged=False)
    assert r.plan == plan and r.n_buckets == len(plan.buckets)
    other = CollectivePlan("bucketed", ((0, 7),))
    with pytest.raises(ValueError, match="bucket"):
        r.use_plan(other, staged=False)


# --- bench/gpu_check.py on the CPU ------------------------------------------------------

BARE = '''"""A bare GPU machine's Python: no Ray, no pydantic, dynabatch not installed."""
import sys


class _Bare:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "pydantic"):
            raise ImportError(f"not on a bare GPU machine: {name}")
        return None


def _editable(x):
    return "__editable__" in str(getattr(x, "__module__", x))


# The editable install's finder and its path entry go: the package is not installed.
sys.meta_path[:] = [_Bare()] + [f for f in sys.meta_path if not _editable(f)]
sys.path[:] = [p for p in sys.path if not _editable(p)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not _editable(h)]
sys.path_importer_cache.clear()
'''


def test_the_gpu_check_runs_bare_on_the_cpu_and_reports_its_json(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "sitecustomize.py").write_text(BARE)
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "bench" / "gpu_check.py"),
            "--quick",
            "--out",
            str(out),
            "--only",
            "environment,mixed_plan,two_workers_one_gpu,nccl_missing_peer,oom_recovery,"
            "fp16_found_inf,data_wait,throughput",
        ],
        cwd=tmp_path,
        # One OpenMP thread, as the suite's (tests/conftest.py): the env is replaced here.
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=480,  # a liveness bound (about 45 s alone, 240+ at a load of 30)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    assert isinstance(report["device"], str) and report["device"]
    checks = report["checks"]
    assert all(c["status"] in ("ok", "fail", "skipped") for c in checks.values())
    assert checks["environment"]["status"] == "ok"
    assert checks["environment"]["missing_for_the_suite"] == ["ray", "pydantic"]
    mixed = checks["mixed_plan"]
    assert mixed["status"] == "ok", mixed
    assert [m["staged"] for m in mixed["members"]] == [True, False, False]
    assert all(m["buckets"] == m["calls"] == 2 for m in mixed["members"])
    assert mixed["max_abs_err"] <= 1e-6
    if not torch.cuda.is_available():
        assert checks["two_workers_one_gpu"]["status"] == "skipped"
        assert checks["nccl_missing_peer"]["status"] == "skipped"
    oom = checks["oom_recovery"]
    assert oom["status"] == "ok", oom
    assert oom["out_of_memory_at"] == [96, 48, 24] and oom["cap"] == 12
    fp16 = checks["fp16_found_inf"]
    assert fp16["status"] == "ok", fp16
    assert all([s["overflow"] for s in m["steps"]] == [True, False] for m in fp16["members"])
    wait = checks["data_wait"]
    assert wait["status"] == "ok", wait
    assert wait["threads"] >= 1 and wait["samples_per_s"] > 0
    assert wait["data_wait_per_step_ms"] >= 0 and 0 <= wait["wait_fraction"] <= 1
    speed = checks["throughput"]
    assert speed["status"] == "ok", speed
    assert speed["cpu_fp32"] > 0 and speed["cpu_conv_channels_last_fp32"] > 0
    if not torch.cuda.is_available():  # issue 49: skipped with its reason, not a hang
        assert "only meaningful on a GPU" in speed["cpu_compiled_fp32"]

"""The prepared GPU check in Ray (issue 53): dynabatch's job path on a GPU node, from the
offline bundle, in one call of at most 9 minutes.

Made for a GPU machine without network: Python 3.12 and torch, no Ray, no pydantic. First
it installs the bundle (``make bundle``'s ``.bundle/``: wheels and ``manifest.json``) into a
fresh folder with ``pip install --no-index --no-deps --target`` after checking every wheel's
sha256 against the manifest (``install``); then every check runs in a process of its own
with that folder (and, where dynabatch is not installed, a folder of links onto this
checkout) on ``PYTHONPATH``, which the Ray processes it starts inherit. Where the
interpreter is not the bundle's Python (this 3.11 development machine), the wheels are
installed for the bundle's Python (``--python-version``) and the checks use this
environment's own Ray.

Each Ray check starts a local Ray of several nodes on this machine
(``ray.cluster_utils.Cluster``: one node holding the GPU and one CPU, and one node per CPU
worker, so the job's placement puts one worker on each) and trains through the product's
own path (:func:`dynabatch.api.cli.run.run_job`, which :func:`dynabatch.run` calls), with
the spec's ``worker_gpus``. Without a GPU the GPU checks are ``skipped`` with their reason
and the CPU-side paths run (the install, Ray's start, the mixed job with CPU workers only).

Checks:

* ``ray_start``: the local Ray's nodes and resources, Ray's version and where it was
  imported from (the bundle or this environment), how long the start took.
* ``ray_devices``: ``worker_gpus`` auto, 1 and 0.5 through the runtime that places the
  workers (:class:`dynabatch.scheduler.runtime.ray_runtime.RayRuntime`): inside each worker
  actor, the GPU Ray assigned (``ray.get_gpu_ids()``, ``CUDA_VISIBLE_DEVICES``) against the
  worker's device and its model's; two half-GPU workers on one GPU join over gloo (the
  backend the runtime chose) and train a job to its end, every epoch verified (GPU).
* ``mixed_job``: one GPU worker (``worker_gpus: auto``) and N CPU workers (N = 4, 8, 14),
  the MLP 784-512-512-10 and LeNet, ``dbs`` and ``affine``: every epoch verified; the last
  epoch's shares against the workers' measured speeds (samples per compute-second), within
  10%; the GPU worker alone in the same call, and ``mlp_speedup`` / ``cnn_speedup``: the
  GPU-alone epoch over the best mixed epoch (target: >= 1.2 for the MLP, never < 1), with
  the step breakdown of both (where the time goes). On a CPU: the same job with CPU workers
  only, the speedups skipped with their reason.
* ``oom_in_ray``: a model that really runs out of GPU memory above a share of
  ``oom_limit`` samples (it allocates more than the GPU has): the job goes on, its
  micro-batches capped, SUCCEEDED, every epoch verified (GPU).
* ``slowdown_on_gpu``: an emulated 2x slowdown (``emulation.disturbances``) on the GPU
  worker from epoch 1 step 5: its batch falls within 5 steps (read from the job's
  snapshots, twice a second: an upper bound) (GPU).
* ``spare_on_gpu``: two CPU workers, then a GPU node joins and holds a spare; a CPU
  worker's node is lost and the spare on the GPU node takes over; the job ends SUCCEEDED,
  verified, with a worker on the GPU (GPU).

Prints one JSON object ``{"device": ..., "checks": {NAME: {"status": "ok" | "fail" |
"skipped", ...}}, "seconds": ...}`` and writes it to ``--out`` or, when ``$OUT`` is set, to
``$OUT/gpu_ray_check.json``. Usage:
python bench/gpu_ray_check.py [--bundle .bundle] [--quick] [--only a,b] [--budget-s 500]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "scheduler", "service", "api")
RESULT = "GPU_RAY_CHECK_RESULT "
# Liveness bounds, not speed checks: a local Ray of two nodes took over 60 s to start on a
# loaded 2-core host.
TIMEOUT_S = {
    "ray_start": 180,
    "ray_devices": 90,
    "mixed_job": 300,
    "oom_in_ray": 60,
    "slowdown_on_gpu": 60,
    "spare_on_gpu": 90,
}
GPU_ONLY = ("ray_devices", "oom_in_ray", "slowdown_on_gpu", "spare_on_gpu")
CHECKS = ("install", *TIMEOUT_S)
NO_GPU = "no GPU"
SHARE_TOLERANCE = 0.10  # shares against measured speeds
MOVE_WITHIN_STEPS = 5  # slowdown_on_gpu
MLP_TARGET = 1.2  # mlp_speedup
WORKER_RES = "dynabatch_worker"  # every node a job may use offers it


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _skipped(reason: str) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason}


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"


# --- the bundle --------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def install_bundle(bundle: Path, target: Path) -> dict[str, Any]:
    """Install every wheel of ``bundle`` into the fresh folder ``target`` with no network
    (``--no-index --no-deps``), after checking each against the manifest's sha256. On the
    bundle's Python the installed packages are then imported in a fresh process
    (``importable``) and every ``Requires-Dist`` of theirs checked against what that
    process finds (``unmet``); on another Python they are installed for the bundle's
    (``--python-version``) and not imported (``importable`` False, with the reason)."""
    t0 = time.monotonic()
    manifest_path = bundle / "manifest.json"
    if not manifest_path.is_file():
        return {"status": "fail", "error": f"{manifest_path}: no manifest (run make bundle)"}
    manifest = json.loads(manifest_path.read_text())
    if target.exists() and any(target.iterdir()):
        return {"status": "fail", "error": f"{target}: not empty (the target must be fresh)"}
    target.mkdir(parents=True, exist_ok=True)
    wheels, bad = [], []
    for w in manifest["wheels"]:
        path = bundle / w["file"]
        if not path.is_file():
            bad.append(f"{w['file']}: missing")
        elif _sha256(path) != w["sha256"]:
            bad.append(f"{w['file']}: sha256 differs from the manifest's")
        wheels.append(path)
    if bad:
        return {"status": "fail", "error": "; ".join(bad)}
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    same = here == manifest["python"]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--target",
        str(target),
    ]
    if not same:  # the wheels are cp312: pip installs them for that Python only
        cmd += [
            "--only-binary=:all:",
            "--python-version",
            manifest["python"],
            "--implementation",
            "cp",
        ]
        cmd += [a for p in manifest.get("platforms", []) for a in ("--platform", p)]
    proc = subprocess.run([*cmd, *map(str, wheels)], capture_output=True, text=True)
    res: dict[str, Any] = {
        "bundle": str(bundle),
        "target": str(target),
        "wheels": len(wheels),
        "bundle_mib": manifest.get("bundle_mib"),
        "slimmed": [w["file"] for w in manifest["wheels"] if w.get("slimmed")],
        "python": here,
        "bundle_python": manifest["python"],
    }
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1][:500]
        return {**res, "status": "fail", "error": f"pip install: {why}"}
    res["installed_s"] = round(time.monotonic() - t0, 1)
    if not same:
        res.update(
            status="ok",
            importable=False,
            reason=f"installed for Python {manifest['python']}; this is {here}: the checks "
            "use this environment's packages",
        )
        return res
    names = sorted({w["name"] for w in manifest["wheels"]})
    # The installed top-level modules (packages and single-module wheels), each imported.
    tops = sorted(
        p.stem if p.suffix == ".py" else p.name
        for p in target.iterdir()
        if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.name != "__pycache__"
    )
    probe = textwrap.dedent(f"""
        import importlib, importlib.metadata as md, json
        from packaging.requirements import Requirement
        unmet = []
        for name in {names!r}:
            for line in md.requires(name) or []:
                req = Requirement(line)
                if req.marker is not None and not req.marker.evaluate({{"extra": ""}}):
                    continue
                try:
                    have = md.version(req.name)
                except md.PackageNotFoundError:
                    unmet.append(f"{{name}} needs {{req}}: not installed")
                    continue
                if req.specifier and not req.specifier.contains(have, prereleases=True):
                    unmet.append(f"{{name}} needs {{req}}: {{have}} installed")
        origin = {{m: getattr(importlib.import_module(m), "__file__", None) for m in {tops!r}}}
        versions = {{n: md.version(n) for n in {names!r}}}
        print(json.dumps({{"origin": origin, "versions": versions, "unmet": unmet}}))
        """)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])
    )
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    if got.returncode != 0:
        why = (got.stderr.strip().splitlines() or ["no output"])[-1][:500]
        return {**res, "status": "fail", "importable": False, "error": f"import: {why}"}
    info = json.loads(got.stdout.strip().splitlines()[-1])
    # Each module from the target, not from another copy on the path.
    elsewhere = sorted(
        m for m, f in info.pop("origin").items() if not str(f).startswith(str(target))
    )
    info["modules"] = tops
    if elsewhere:
        info["imported_from_elsewhere"] = elsewhere
    ok = not elsewhere and not info["unmet"]
    return {**res, **info, "importable": True, "status": "ok" if ok else "fail"}


def _shim(folder: Path) -> Path:
    """A folder holding ``dynabatch/`` as links onto this checkout, for a machine where
    dynabatch is not installed, mapped as ``setup.py`` maps it: ``dynabatch`` is
    ``api/public/``, its sub-packages the four top-level folders."""
    pkg = folder / "dynabatch"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        (pkg / name).symlink_to(ROOT / name)
    # ``dynabatch`` itself is api/public/ (the public Python API).
    for entry in (ROOT / "api" / "public").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    return folder


# --- a local Ray of several nodes ----------------------------------------------------------


class Lab:
    """A local Ray on this machine (``cluster_utils.Cluster``): a head without CPUs (the
    job's coordinator), a GPU node (one CPU and the GPU) when asked, and ``cpu_nodes``
    one-CPU nodes, so a job's placement puts one worker on each. Node resources name the
    tiers: CPU node ``i`` offers ``tier{n}`` for every ``n`` in ``tiers`` above ``i``, the
    GPU node every tier and ``gpu_only``: a job's ``node_resource`` picks its nodes."""

    def __init__(self, cpu_nodes: int, gpu: bool, tiers: tuple[int, ...] = ()):
        import ray
        from ray.cluster_utils import Cluster

        t0 = time.monotonic()
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "num_gpus": 0,
                "include_dashboard": False,  # the bundle has Ray without [default]
                "object_store_memory": 200 * 2**20,
                "_system_config": {
                    "health_check_initial_delay_ms": 0,
                    "health_check_period_ms": 200,
                    "health_check_failure_threshold": 3,
                },
            },
        )
        self.gpu_node = None
        if gpu:
            res = {WORKER_RES: 1, "gpu_only": 1, **{f"tier{n}": 1 for n in tiers}}
            self.gpu_node = self.add(res, gpus=1)
        self.cpu_nodes = [
            self.add({WORKER_RES: 1, **{f"tier{n}": 1 for n in tiers if i < n}})
            for i in range(cpu_nodes)
        ]
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace="dynabatch", log_to_driver=False)
        self.start_s = round(time.monotonic() - t0, 1)

    def add(self, resources: dict[str, float], gpus: int = 0) -> Any:
        return self.cluster.add_node(
            num_cpus=1, num_gpus=gpus, resources=resources, object_store_memory=80 * 2**20
        )

    @property
    def address(self) -> str:
        return self.cluster.address

    def close(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()
        with contextlib.suppress(Exception):
            self.cluster.shutdown()


# --- jobs ------------------------------------------------------------------------------


MODELS = {
    "mlp": {"name": "mlp", "hidden": 512, "options": {"layers": 2}},  # 784-512-512-10
    "cnn": {"name": "lenet"},
}


def job_spec(
    name: str, model: str, workers: int, cfg: dict[str, Any], **fields: Any
) -> dict[str, Any]:
    """A job on generated MNIST (``cfg["n_train"]`` samples) for ``workers`` workers."""
    return {
        "name": name,
        "dataset": {"name": "mnist", "options": {"n_train": cfg["n_train"], "n_test": 1000}},
        "model": MODELS[model],
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "workers": workers,
        "global_batch": cfg["global_batch"],
        "epochs": cfg["epochs"],
        "seed": 0,
        "spares": 0,
        "collective_timeout_s": 30,
        "start_timeout_s": 120,
        **fields,
    }


def train(spec: dict[str, Any], address: str, on_update: Any = None) -> dict[str, Any]:
    """Train ``spec`` on the Ray at ``address`` through ``dynabatch run``'s own path (the one
    ``dynabatch.run`` takes) and summarise it: state, each epoch's time and verification,
    the last epoch's shares against the workers' speeds, and the job's log lines."""
    from dynabatch import JobSpec
    from dynabatch.api.cli.run import run_job
    from rich.console import Console

    log = io.StringIO()
    on_update = recording(on_update)
    t0 = time.monotonic()
    snap = run_job(
        JobSpec.model_validate(spec),
        address=address,
        report=None,
        quiet=True,
        console=Console(file=log, width=400, force_terminal=False),
        scheduler=False,
        on_update=on_update,
    )
    hist = _HISTORIES.pop(snap.job_id, [])
    out: dict[str, Any] = {
        "state": snap.state.value,
        "reason": snap.reason,
        "seconds": round(time.monotonic() - t0, 1),
        "log": log.getvalue().splitlines(),
    }
    if hist:
        out.update(summarise(hist))
    if snap.step_breakdown is not None:
        out["breakdown_s_per_step"] = {
            k: round(v, 5) if isinstance(v, float) else v
            for k, v in snap.step_breakdown.model_dump().items()
            if v
        }
    return out


_HISTORIES: dict[str, list] = {}  # each job's latest history, as its polls read it


def recording(then: Any = None) -> Any:
    """An ``on_update`` that keeps each job's latest history (and calls ``then``)."""

    def update(snap: Any, hist: list) -> None:
        _HISTORIES[snap.job_id] = list(hist)
        if then is not None:
            then(snap, hist)

    return update


def summarise(hist: list) -> dict[str, Any]:
    """Epoch times and verification, and the last epoch's shares: each worker's fraction
    of the samples against its fraction of the workers' speeds (samples per
    compute-second); ``share_error`` is the largest relative gap."""
    last = hist[-1]
    parts = sum(w.partition for w in last.workers) or 1
    speed = sum(w.throughput for w in last.workers) or 1.0
    workers = []
    worst = 0.0
    for w in last.workers:
        share, fair = w.partition / parts, w.throughput / speed
        gap = abs(share / fair - 1) if fair > 0 else float("inf")
        worst = max(worst, gap)
        workers.append(
            {
                "worker": w.worker,
                "node": w.node,
                "batch": w.batch,
                "share": round(share, 4),
                "speed_share": round(fair, 4),
                "samples_per_s": round(w.throughput, 1),
                "slowdown": w.slowdown,
            }
        )
    return {
        "epochs": len(hist),
        "verified": all(r.verified for r in hist),
        "epoch_s": [round(r.wall_s, 3) for r in hist],
        # The first epoch trains an equal split before anything is measured.
        "best_epoch_s": round(min(r.wall_s for r in hist[1:] or hist), 3),
        "workers": workers,
        "share_error": round(worst, 4),
    }


def _on(node_id: str, node: str) -> bool:
    """Whether a worker's ``node`` (maybe shortened) is ``node_id``."""
    return bool(node) and (node_id.startswith(node) or node.startswith(node_id))


def _gpu_node_id(lab: Lab) -> str:
    return lab.gpu_node.node_id


# --- the checks ------------------------------------------------------------------------


def check_ray_start(cfg: dict[str, Any]) -> dict[str, Any]:
    import ray

    lab = Lab(cpu_nodes=1, gpu=_cuda())
    try:
        res: dict[str, Any] = {
            "status": "ok",
            "ray": ray.__version__,
            "ray_from": str(Path(ray.__file__).parent),
            "start_s": lab.start_s,
            "nodes": len([n for n in ray.nodes() if n.get("Alive")]),
            "resources": {k: v for k, v in ray.cluster_resources().items() if "memory" not in k},
        }
        if _cuda():

            @ray.remote(num_gpus=1, num_cpus=0)
            def ids() -> dict[str, Any]:
                return {
                    "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                    "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                }

            res["gpu_task"] = ray.get(ids.remote(), timeout=60)
            if not res["gpu_task"]["gpu_ids"]:
                res["status"] = "fail"
        return res
    finally:
        lab.close()


def _probe(worker: Any) -> dict[str, Any]:
    """Inside a worker actor (``__ray_call__``): the GPU Ray assigned and what it uses."""
    import ray
    import torch

    params = {str(p.device) for p in worker.model.parameters()}
    dev = worker.device
    out = {
        "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device": str(dev),
        "model_on": sorted(params),
    }
    if dev.type == "cuda":
        out["uuid"] = str(torch.cuda.get_device_properties(dev).uuid)
    return out


def _physical_uuids() -> dict[str, str]:
    """nvidia-smi's GPU index -> UUID (the index is what Ray assigns)."""
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    out = {}
    for line in proc.stdout.splitlines():
        if "," in line:
            i, u = (s.strip() for s in line.split(",", 1))
            out[i] = u.removeprefix("GPU-")
    return out


def _placed(lab: Lab, worker_gpus: Any, workers: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Workers of ``worker_gpus`` placed by the job's runtime on the GPU node, each probed
    inside its actor; the backend the runtime chooses for their group."""
    import ray
    from dynabatch import JobSpec
    from dynabatch.actors.group import choose_backend
    from dynabatch.scheduler.core.membership import Spawn
    from dynabatch.scheduler.runtime.ray_runtime import RayRuntime

    spec = JobSpec.model_validate(
        job_spec("devices", "mlp", workers, cfg, worker_gpus=worker_gpus, node_resource="gpu_only")
    )
    rt = RayRuntime(spec)
    rt.load_data()
    node = next(n for n in rt.nodes() if n.node_id == _gpu_node_id(lab))
    names = [f"w{i}" for i in range(workers)]
    for i, w in enumerate(names):
        rt.spawn(Spawn(w, i, node.node_id, 1.0, spec.gpus_on(node.gpus)))
    started, deadline = [], time.monotonic() + 60
    while len(started) < workers and time.monotonic() < deadline:
        started += rt.poll_started(1.0)
    errors = [s.error for s in started if getattr(s, "error", None)]
    probes = {w: ray.get(rt._handles[w].__ray_call__.remote(_probe), timeout=60) for w in names}
    backend = choose_backend(
        [rt._devices.get(w, "cpu") for w in names], [rt._gpus.get(w) for w in names]
    )
    for w in names:
        rt.kill(w)
    return {"probes": probes, "backend": backend, "errors": errors}


def check_ray_devices(cfg: dict[str, Any]) -> dict[str, Any]:
    if not _cuda():
        return _skipped(NO_GPU)
    uuids = _physical_uuids()
    lab = Lab(cpu_nodes=0, gpu=True)
    res: dict[str, Any] = {"status": "ok"}
    try:
        for g, n in (("auto", 1), (1, 1), (0.5, 2)):
            got = _placed(lab, g, n, cfg)
            bad = list(got["errors"])
            for w, p in got["probes"].items():
                assigned = p["gpu_ids"][0] if p["gpu_ids"] else None
                if assigned is None or not p["device"].startswith("cuda"):
                    bad.append(f"{w}: on {p['device']} with Ray's GPUs {p['gpu_ids']}")
                elif p["model_on"] != [p["device"]]:
                    bad.append(f"{w}: model on {p['model_on']}, device {p['device']}")
                elif uuids and uuids.get(assigned) not in (None, p.get("uuid")):
                    bad.append(f"{w}: uses GPU {p.get('uuid')}, Ray assigned {assigned}")
            if n == 2 and got["backend"] != "gloo":
                bad.append(f"two workers on one GPU got {got['backend']}, not gloo")
            res[f"worker_gpus_{g}"] = {**got, "problems": bad}
            if bad:
                res["status"] = "fail"
        # Two half-GPU workers train a job to its end over that group.
        job = train(
            job_spec("half-gpus", "mlp", 2, cfg, worker_gpus=0.5, node_resource="gpu_only"),
            lab.address,
        )
        job.pop("log")
        res["half_gpu_job"] = job
        if job["state"] != "SUCCEEDED" or not job.get("verified"):
            res["status"] = "fail"
    finally:
        lab.close()
    return res


def check_mixed_job(cfg: dict[str, Any]) -> dict[str, Any]:
    """One GPU worker and N CPU workers (on a CPU machine: the CPU workers only)."""
    gpu = _cuda()
    tiers = tuple(cfg["cpu_workers"])
    lab = Lab(cpu_nodes=max(tiers), gpu=gpu, tiers=tiers)
    try:
        return mixed_jobs(lab.address, lab.gpu_node.node_id if gpu else None, cfg)
    finally:
        lab.close()


def mixed_jobs(
    address: str, gpu_node: str | None, cfg: dict[str, Any], resource: str = "tier{n}"
) -> dict[str, Any]:
    """The mixed jobs on the Ray at ``address``, N CPU workers on the nodes offering
    ``resource`` (formatted with ``n``: the Lab's ``tier{n}`` is N CPU nodes and the GPU node
    ``gpu_node``), in the order of ``cfg``, until ``cfg["budget_s"]`` is spent; with
    ``gpu_node`` the GPU worker alone first (``gpu_only``)."""
    t0 = time.monotonic()
    res: dict[str, Any] = {"status": "ok", "jobs": {}, "not_run": []}
    problems: list[str] = []
    alone: dict[str, float] = {}
    if gpu_node is not None:
        for model in cfg["models"]:
            spec = job_spec(
                f"alone-{model}", model, 1, cfg, worker_gpus=1, node_resource="gpu_only"
            )
            job = train(spec, address)
            job.pop("log")
            res["jobs"][f"{model}/gpu-alone"] = job
            if job["state"] != "SUCCEEDED":
                problems.append(f"{model} alone: {job['state']} {job['reason']}")
            else:
                alone[model] = job["best_epoch_s"]
    runs = [(m, n, p) for m in cfg["models"] for n in cfg["cpu_workers"] for p in cfg["policies"]]
    best: dict[str, float] = {}
    for model, n, policy in runs:
        key = f"{model}/{n}cpu/{policy}"
        if time.monotonic() - t0 > cfg["budget_s"]:
            res["not_run"].append(key)
            continue
        workers = n + (1 if gpu_node is not None else 0)
        spec = job_spec(
            f"mixed-{model}-{n}-{policy}",
            model,
            workers,
            cfg,
            worker_gpus="auto" if gpu_node is not None else 0,
            node_resource=resource.format(n=n),
            policy=policy,
        )
        job = train(spec, address)
        job.pop("log")
        res["jobs"][key] = job
        if job["state"] != "SUCCEEDED" or not job.get("verified"):
            problems.append(f"{key}: {job['state']}, verified {job.get('verified')}")
            continue
        if job["share_error"] > SHARE_TOLERANCE:
            problems.append(f"{key}: shares {job['share_error']:.0%} off the speeds")
        if gpu_node is not None:
            on_gpu = [w for w in job["workers"] if _on(gpu_node, w["node"])]
            if len(on_gpu) != 1:
                problems.append(f"{key}: {len(on_gpu)} workers on the GPU node")
        best[model] = min(best.get(model, float("inf")), job["best_epoch_s"])
    if gpu_node is None:
        res["speedups"] = _skipped(f"{NO_GPU}: the mixed job ran with CPU workers only")
    else:
        for model, name in (("mlp", "mlp_speedup"), ("cnn", "cnn_speedup")):
            if model in alone and model in best:
                res[name] = round(alone[model] / best[model], 3)
        if res.get("mlp_speedup", 0) < MLP_TARGET:
            problems.append(f"mlp_speedup {res.get('mlp_speedup')} < {MLP_TARGET}")
        for name in ("mlp_speedup", "cnn_speedup"):
            if name in res and res[name] < 1.0:
                problems.append(f"{name} {res[name]}: slower than the GPU alone")
    if problems or res["not_run"]:
        res["status"] = "fail"
    res["problems"] = problems
    return res


OOM_MODULE = '''
"""A model that runs out of GPU memory above a share of {limit} samples (the check's)."""
import torch
from dynabatch.actors.workloads.models import mlp

class Hungry(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if x.is_cuda and x.shape[0] > {limit}:
            free, total = torch.cuda.mem_get_info(x.device)
            torch.empty(total * 2 // 4 + free, dtype=torch.float32, device=x.device)
        return self.inner(x)

def build(input_shape, num_classes, hidden=64):
    import math
    return Hungry(mlp(math.prod(input_shape), hidden, num_classes))
'''


def check_oom_in_ray(cfg: dict[str, Any]) -> dict[str, Any]:
    if not _cuda():
        return _skipped(NO_GPU)
    limit = cfg["oom_limit"]
    code = tempfile.mkdtemp(prefix="hungry-model-")
    Path(code, "hungry_model.py").write_text(OOM_MODULE.format(limit=limit))
    # On PYTHONPATH before Ray starts, so every Ray process imports it: a working_dir is
    # shipped only by the run that starts Ray (README's Limits), and the Lab starts it here.
    os.environ["PYTHONPATH"] = os.pathsep.join([code, os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, code)
    lab = Lab(cpu_nodes=1, gpu=True)
    try:
        spec = job_spec("oom", "mlp", 2, cfg, worker_gpus="auto", node_resource=WORKER_RES)
        spec.update(model={"name": "hungry_model:build", "hidden": 64})
        job = train(spec, lab.address)
    finally:
        lab.close()
        shutil.rmtree(code, ignore_errors=True)
    oom_lines = [ln for ln in job["log"] if "memory" in ln.lower()][:5]
    job["log"] = oom_lines
    gpu_worker = [w for w in job.get("workers", []) if _on(lab.gpu_node.node_id, w["node"])]
    micro = job.get("breakdown_s_per_step", {}).get("micro_batches", 1.0)
    ok = (
        job["state"] == "SUCCEEDED" and job.get("verified") and bool(oom_lines) and bool(gpu_worker)
    )
    return {"status": "ok" if ok else "fail", "limit": limit, "micro_batches": micro, **job}


def check_slowdown_on_gpu(cfg: dict[str, Any]) -> dict[str, Any]:
    if not _cuda():
        return _skipped(NO_GPU)
    import ray

    lab = Lab(cpu_nodes=2, gpu=True)
    gpu_id = lab.gpu_node.node_id
    at_step = 5
    try:
        # The GPU worker's ordinal: the job starts one worker per node, in node-id order.
        nodes = sorted(
            n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(WORKER_RES)
        )
        ordinal = nodes.index(gpu_id)
        seen: dict[str, Any] = {"before": None, "slowed_at": None, "moved_at": None}

        def watch(snap: Any, hist: list) -> None:
            mine = [w for w in snap.workers if _on(gpu_id, w.node)]
            if not mine or snap.epoch < 1:
                return
            w, pos = mine[0], snap.epoch * max(snap.steps_per_epoch, 1) + snap.step
            if w.slowdown < 2 and snap.step < at_step:
                seen["before"] = w.batch
            elif w.slowdown >= 2 and seen["slowed_at"] is None:
                seen["slowed_at"] = pos
            if (
                seen["slowed_at"] is not None
                and seen["moved_at"] is None
                and seen["before"] is not None
                and w.batch < seen["before"]
            ):
                seen["moved_at"] = pos

        spec = job_spec(
            "slowdown",
            "cnn",
            3,
            cfg,
            worker_gpus="auto",
            node_resource=WORKER_RES,
            rebalance={"mode": "adaptive", "check_steps": 2},
        )
        spec["emulation"] = {
            "slowdowns": [1, 1, 1],
            "disturbances": [{"worker": ordinal, "factor": 2, "epoch": 1, "step": at_step}],
        }
        job = train(spec, lab.address, watch)
    finally:
        lab.close()
    job["log"] = [ln for ln in job["log"] if "rebalance" in ln][:6]
    spe = None
    if seen["moved_at"] is not None:
        spe = seen["moved_at"] - (seen["slowed_at"] or 0)
    slowed = [w for w in job.get("workers", []) if w["slowdown"] >= 2]
    ok = (
        job["state"] == "SUCCEEDED"
        and job.get("verified")
        and spe is not None
        and spe <= MOVE_WITHIN_STEPS
        and all(_on(gpu_id, w["node"]) for w in slowed)
        and bool(slowed)
    )
    return {
        "status": "ok" if ok else "fail",
        "gpu_ordinal": ordinal,
        "seen": seen,
        "steps_to_move_at_most": spe,
        "within": MOVE_WITHIN_STEPS,
        **job,
    }


def check_spare_on_gpu(cfg: dict[str, Any]) -> dict[str, Any]:
    if not _cuda():
        return _skipped(NO_GPU)
    lab = Lab(cpu_nodes=2, gpu=False)
    events: dict[str, Any] = {}
    try:
        spec = job_spec(
            "spare",
            "mlp",
            2,
            cfg,
            worker_gpus="auto",
            node_resource=WORKER_RES,
            spares=1,
            max_workers=2,
            epochs=cfg["epochs"] + 2,
        )
        done: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: done.update(job=train(spec, lab.address, follow)),
            daemon=True,
        )

        def follow(snap: Any, hist: list) -> None:
            if snap.epoch >= 1 and "gpu_added" not in events:
                events["gpu_added"] = snap.epoch
                lab.gpu_node = lab.add({WORKER_RES: 1, "gpu_only": 1}, gpus=1)

        thread.start()
        deadline = time.monotonic() + TIMEOUT_S["spare_on_gpu"] - 20
        # Once the spare is up on the GPU node (its log line), a CPU worker's node goes.
        while thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.5)
            if "gpu_added" in events and "removed" not in events:
                time.sleep(cfg["spare_wait_s"])
                lab.cluster.remove_node(lab.cpu_nodes[0], allow_graceful=False)
                events["removed"] = time.monotonic()
        thread.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        lab.close()
    job = done.get("job")
    if job is None:
        return {"status": "fail", "error": "the job did not end in time", **events}
    adopted = [ln for ln in job["log"] if "adopting its spare" in ln]
    spare_lines = [ln for ln in job["log"] if "spare" in ln][:6]
    job["log"] = spare_lines
    on_gpu = [w for w in job.get("workers", []) if _on(lab.gpu_node.node_id, w["node"])]
    ok = job["state"] == "SUCCEEDED" and job.get("verified") and bool(adopted) and bool(on_gpu)
    return {"status": "ok" if ok else "fail", "adopted": bool(adopted), **job}


# --- running them ------------------------------------------------------------------------


GPU_SIZES: dict[str, Any] = {
    "cpu_workers": [4, 8, 14],
    "models": ["mlp", "cnn"],
    "policies": ["dbs", "affine"],
    "n_train": 12000,
    "global_batch": 1024,
    "epochs": 3,
    "budget_s": 270,
    "oom_limit": 64,
    "spare_wait_s": 8,
}
# Without a GPU: the mixed job with CPU workers only, small enough for 2 loaded cores.
CPU_SIZES: dict[str, Any] = {
    **GPU_SIZES,
    "cpu_workers": [2],
    "models": ["mlp"],
    "policies": ["dbs", "affine"],
    "n_train": 2048,
    "global_batch": 256,
    "epochs": 2,
    "budget_s": 150,
}
QUICK_SIZES: dict[str, Any] = {**CPU_SIZES, "policies": ["dbs"], "n_train": 1024}


def _config(args: argparse.Namespace) -> dict[str, Any]:
    sized_for = "quick" if args.quick else "gpu" if _cuda() else "cpu"
    sizes = {"quick": QUICK_SIZES, "gpu": GPU_SIZES, "cpu": CPU_SIZES}[sized_for]
    return {**sizes, "sized_for": sized_for}


def run_one(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    return globals()[f"check_{name}"](cfg)


def run_isolated(name: str, cfg: dict[str, Any], timeout: float, env: dict) -> dict[str, Any]:
    """``name`` in a process of its own (a session, killed whole on timeout)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--check",
        name,
        "--config",
        json.dumps(cfg),
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {
            "status": "fail",
            "error": f"timed out after {timeout:.0f} s (a hang)",
            "seconds": round(time.monotonic() - t0, 1),
        }
    with contextlib.suppress(ProcessLookupError):  # Ray processes the check left behind
        os.killpg(proc.pid, signal.SIGKILL)
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
    if not lines:
        why = (err.strip().splitlines() or ["no output"])[-1][:500]
        return {
            "status": "fail",
            "error": f"exit {proc.returncode}: {why}",
            "seconds": round(time.monotonic() - t0, 1),
        }
    res = json.loads(lines[-1][len(RESULT) :])
    res["seconds"] = round(time.monotonic() - t0, 1)
    return res


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return (
        f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"(torch {torch.__version__})"
    )


def prepare(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``install`` check and the environment the other checks run in."""
    paths: list[str] = []
    bundle = Path(args.bundle)
    if args.no_install:
        res = _skipped("--no-install: this environment's packages")
    elif not (bundle / "manifest.json").is_file():
        res = _skipped(f"no bundle at {bundle} (make bundle): this environment's packages")
    else:
        target = Path(args.target) if args.target else work / "site"
        res = install_bundle(bundle, target)
        if res.get("importable"):
            paths.append(str(target))
    if not _has("dynabatch"):
        paths.append(str(_shim(work / "shim")))
    env = dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return res, env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=str(ROOT / ".bundle"), help="make bundle's folder")
    ap.add_argument("--target", default=None, help="install into (fresh); default: a temp dir")
    ap.add_argument("--no-install", action="store_true", help="use this environment's Ray")
    ap.add_argument("--quick", action="store_true", help="small sizes (tests)")
    ap.add_argument("--only", default=None, help=f"comma-separated, of {', '.join(CHECKS)}")
    ap.add_argument("--budget-s", type=float, default=500.0, help="the whole run's limit")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--check", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.check:  # a child: one check, its result on one line
        try:
            res = run_one(args.check, json.loads(args.config))
        except Exception as err:
            res = {"status": "fail", "error": _short(err)}
        print(RESULT + json.dumps(res, default=str), flush=True)
        return 0
    names = CHECKS if args.only is None else tuple(args.only.split(","))
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(
            f"--only: unknown check {unknown[0]!r}; the checks are {', '.join(CHECKS)}",
            file=sys.stderr,
        )
        return 2
    cfg = _config(args)
    t0 = time.monotonic()
    checks: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="gpu-ray-check-"))
    try:
        checks["install"], env = prepare(args, work)
        if checks["install"]["status"] == "fail":
            names = ()
        for name in names:
            if name == "install":
                continue
            if name in GPU_ONLY and not _cuda():
                checks[name] = _skipped(NO_GPU)
                continue
            left = args.budget_s - (time.monotonic() - t0)
            if left < 10:
                checks[name] = {"status": "fail", "error": "not run: the time budget was spent"}
                continue
            checks[name] = run_isolated(name, cfg, min(TIMEOUT_S[name], left), env)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "device": device_name(),
        "sized_for": cfg["sized_for"],
        "checks": checks,
        "seconds": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(report, indent=1, default=str)
    print(text)
    out = args.out or (
        os.path.join(os.environ["OUT"], "gpu_ray_check.json") if os.environ.get("OUT") else None
    )
    if out:
        Path(out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

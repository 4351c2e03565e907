"""The driver's cost per step: the CPU the per-job coordinator spends per training step, on
the simulated runtime at 2, 16, 64 and 256 workers and on Ray at 2 and 4, for one checkout
or for two side by side (issue 51, must-have 7: before and after the engine rewrite).

**Simulated** (``--sim``): :func:`dynabatch.scheduler.sim.simulator.simulate` runs the
production coordinator over the simulator's runtime on a virtual clock, in one thread, so
the process's CPU time during the run is the coordinator's (engine, policy, ledger, driver)
plus the simulated world's. Every public method of ``SimRuntime`` (the ``Runtime`` seam the
coordinator calls, and what those calls run) is wrapped to add up the CPU spent inside it
(outermost call only); the driver's CPU is the rest. The cluster and job are
``bench/simulate.py``'s scale runs (``workers: auto``, one worker per node of three speed
classes, 64 samples per node per step, policy ``dbs``): ``--steps`` steps per epoch,
``--epochs`` epochs. ``driver_cpu_ms_per_step`` counts the epochs after the first
(``--skip``: the workers' start and the policy's first measurement are the first epoch's);
``driver_cpu_ms_per_step_all`` the whole run, construction included.

**Ray** (``--ray``): the coordinator runs in the bench's own process (as
``bench/equal_workers.py`` runs it) over ``ray.cluster_utils`` nodes of one CPU each, one
worker per node, training LeNet on scikit-learn's digits (8x8, 1,437 training images,
``--ray-batch`` samples per worker per step). The loop is driven by ``Coordinator.step()``
and read at each epoch's end (``history()``). Two figures per step over the epochs after
the first: ``driver_cpu_ms_per_step``, the process's CPU (``/proc``, every thread: the
loop and Ray's core-worker threads that carry its calls, ``bench/procs.py``), and
``loop_cpu_ms_per_step``, the loop's own thread (``time.thread_time``).
``driver_cores``: the process's CPU over the wall time of those epochs (the share of a core
the driver took; on a shared 2-core machine, wall time moves with the load, CPU time less).
``steady_wall_ms_per_step``: those epochs' wall time per step (a steady epoch's speed; with
two checkouts interleaved, a side-by-side figure of the training itself).

**Side by side**: each measurement runs in a child process of the checkout measured, with
that checkout's virtual environment (``--repo PATH``, repeatable: ``PATH/.venv/bin/python``,
which must import that checkout's ``dynabatch``), ``--repeats`` times, the checkouts
interleaved (A B A B ...), reported as medians; on Ray, ``--ray-repeats`` clusters per
checkout, each running ``--ray-rounds`` runs of every size. With two checkouts, ``ratio``
is the second's median over the first's (after / before: below 1 is cheaper). This file
need not be in the checkout measured: run main's copy against both.

Prints one JSON object on stdout (progress on stderr)::

    nice -n 10 .venv/bin/python bench/driver_cost.py --sim 2,16,64,256 --ray 2,4 \\
        --repeats 3 --out bench/results-driver-cost.json
    nice -n 10 .venv/bin/python bench/driver_cost.py --repo . --repo /work/engine3 ...
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# This checkout's root, for bench.* (the helpers below); dynabatch itself comes from the
# interpreter's installed (editable) package: the checkout measured.
sys.path.insert(0, str(ROOT))

from bench.report import emit  # noqa: E402

FIGURES = ("driver_cpu_ms_per_step", "driver_cpu_ms_per_step_all", "loop_cpu_ms_per_step",
           "driver_cores", "steady_wall_ms_per_step", "runtime_cpu_ms_per_step", "wall_s")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ simulated runtime
class RuntimeMeter:
    """Adds up the CPU spent inside ``SimRuntime``'s public methods (outermost calls only),
    by wrapping them on the class for the life of the meter."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.cpu_s = 0.0
        self._depth = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> RuntimeMeter:
        for name in dir(self.cls):
            if name.startswith("_"):
                continue
            raw = getattr(self.cls, name)
            if not callable(raw) or isinstance(raw, type):
                continue
            if name in vars(self.cls):
                self._saved[name] = vars(self.cls)[name]
            else:
                self._saved[name] = None  # inherited: removing the wrapper restores it
            static = isinstance(self.cls.__dict__.get(name), staticmethod)
            wrapped = self._wrap(raw)
            setattr(self.cls, name, staticmethod(wrapped) if static else wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, orig in self._saved.items():
            if orig is None:
                delattr(self.cls, name)
            else:
                setattr(self.cls, name, orig)

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth = 1
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu_s += time.process_time() - t0
                self._depth = 0

        return timed


def measure_sim(workers: int, args: argparse.Namespace) -> dict[str, Any]:
    """One simulated run at ``workers`` workers: the driver's CPU per step."""
    from dynabatch.scheduler.sim.cluster_spec import parse_cluster
    from dynabatch.scheduler.sim.runtime import SimRuntime
    from dynabatch.scheduler.sim.simulator import simulate

    from bench.simulate import scale_cluster, scale_spec

    # A first tiny run imports what the coordinator imports when it is built (torch among
    # them), so the measured run's construction does not count an import.
    simulate(scale_spec(2, "dbs", 1, args.seed), parse_cluster(scale_cluster(2, args.seed)),
             dataset_size=2 * 64)
    cluster = parse_cluster(scale_cluster(workers, args.seed))
    spec = scale_spec(workers, "dbs", args.epochs, args.seed)
    steady_from = args.steps * args.skip
    marks: list[tuple[float, float]] = []  # (process CPU, runtime CPU) as the steady part began

    with RuntimeMeter(SimRuntime) as meter:
        def progress(done: int, _total: int) -> None:
            if not marks and done >= steady_from:
                marks.append((time.process_time(), meter.cpu_s))

        t0, c0 = time.perf_counter(), time.process_time()
        res = simulate(spec, cluster, dataset_size=spec.global_batch * args.steps,
                       progress=progress)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        rt_all = meter.cpu_s
    if res.snapshot.state.value != "SUCCEEDED":
        raise RuntimeError(f"sim {workers}: {res.snapshot.state.value}: {res.snapshot.reason}")
    steps = sum(r.steps for r in res.history)
    steady_steps = sum(r.steps for r in res.history[args.skip:])
    if not marks or not steady_steps:
        raise RuntimeError(f"sim {workers}: no steps after the first {args.skip} epoch(s); "
                           f"raise --epochs")
    steady_cpu = c0 + cpu - marks[0][0]
    steady_rt = rt_all - marks[0][1]
    return {
        "workers": workers, "steps": steps, "steady_steps": steady_steps,
        "driver_cpu_ms_per_step": 1e3 * (steady_cpu - steady_rt) / steady_steps,
        "driver_cpu_ms_per_step_all": 1e3 * (cpu - rt_all) / steps,
        "runtime_cpu_ms_per_step": 1e3 * steady_rt / steady_steps,
        "wall_s": wall,
    }


# ------------------------------------------------------------------------------ Ray
def ray_spec(workers: int, args: argparse.Namespace) -> Any:
    from dynabatch.actors.spec import JobSpec

    return JobSpec.model_validate({
        "name": f"driver-cost-{workers}", "dataset": {"name": "digits"},
        "model": {"name": "lenet"}, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "workers": workers, "global_batch": args.ray_batch * workers,
        "epochs": args.ray_epochs, "seed": 0, "node_resource": "driver_cost_node",
        "collective_timeout_s": 60})


def measure_ray(sizes: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--ray-rounds`` Ray runs at each of ``sizes`` workers, the coordinator in this
    process, on one cluster of ``max(sizes)`` nodes (started once: it costs more than a run)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from dynabatch.scheduler.sync.coordinator import Coordinator
    from dynabatch.service.raycluster import fast_health_check
    from ray.cluster_utils import Cluster

    t_start = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 100 * 2**20,
        "_system_config": fast_health_check()})
    out = []
    try:
        for _ in range(max(sizes)):
            cluster.add_node(num_cpus=1, resources={"driver_cost_node": 1},
                             object_store_memory=80 * 2**20)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="dynabatch-bench", log_to_driver=False)
        log(f"ray: {max(sizes)} nodes up in {time.monotonic() - t_start:.1f}s")
        for rnd in range(args.ray_rounds):
            for n in sizes:
                coord = Coordinator(f"driver-cost-{n}-{rnd}", ray_spec(n, args), resume=False)
                out.append(_ray_run(coord, n, args))
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def _ray_run(coord: Any, workers: int, args: argparse.Namespace) -> dict[str, Any]:
    # (process CPU, loop thread CPU, wall) at the end of each epoch. Process CPU is
    # CLOCK_PROCESS_CPUTIME_ID (time.process_time): every thread, to the nanosecond;
    # /proc's figure (bench/procs.py) moves in 10 ms ticks, coarser than a few steps' cost.
    ends: list[tuple[float, float, float]] = []
    t0 = time.monotonic()
    while coord.step():
        proc, loop, now = time.process_time(), time.thread_time(), time.monotonic()
        if len(coord.history()) > len(ends):
            ends.append((proc, loop, now))
    wall = time.monotonic() - t0
    snap, history = coord.snapshot(), coord.history()
    if snap.state.value != "SUCCEEDED":
        raise RuntimeError(f"ray {workers}: {snap.state.value}: {snap.reason}")
    steady_steps = sum(r.steps for r in history[args.skip:])
    if len(ends) <= args.skip or not steady_steps:
        raise RuntimeError(f"ray {workers}: no epoch after the first {args.skip}; "
                           f"raise --ray-epochs")
    (p0, l0, w0), (p1, l1, w1) = ends[args.skip - 1], ends[-1]
    log(f"ray {workers}: {len(history)} epochs, {wall:.1f}s")
    return {
        "workers": workers, "steps": sum(r.steps for r in history),
        "steady_steps": steady_steps,
        "driver_cpu_ms_per_step": 1e3 * (p1 - p0) / steady_steps,
        "loop_cpu_ms_per_step": 1e3 * (l1 - l0) / steady_steps,
        "driver_cores": (p1 - p0) / (w1 - w0),
        # the steady epochs' wall time per step: a steady epoch's speed, checkouts interleaved
        "steady_wall_ms_per_step": 1e3 * (w1 - w0) / steady_steps,
        "wall_s": wall,
    }


# ------------------------------------------------------------------ side by side
def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"{flag}: {text!r} is not a comma-separated list of worker counts") from None
    if any(v < 1 for v in vals):
        raise SystemExit(f"{flag}: worker counts must be at least 1, got {text!r}")
    return vals


def checkout(path: str) -> dict[str, Any]:
    """A checkout to measure: its root, its interpreter, its commit."""
    root = Path(path).resolve()
    python = root / ".venv" / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"--repo {path}: no {python} (each checkout is measured with its own "
                         f"virtual environment)")
    probe = subprocess.run(
        [str(python), "-c", "import dynabatch.scheduler.sim.simulator as s; print(s.__file__)"],
        capture_output=True, text=True, cwd=root)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"--repo {path}: {python} cannot import dynabatch: {last}")
    if not Path(probe.stdout.strip()).resolve().is_relative_to(root):
        raise SystemExit(f"--repo {path}: {python} imports dynabatch from "
                         f"{probe.stdout.strip()}, not from {root}")
    git = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                         capture_output=True, text=True)
    commit = git.stdout.strip() or "unknown"
    return {"path": str(root), "python": str(python), "commit": commit,
            "label": f"{root.name}@{commit}"}


def run_child(co: dict[str, Any], mode: str, workers: str,
              args: argparse.Namespace) -> list[dict[str, Any]]:
    """One child process of ``co``'s interpreter: ``sim`` at one worker count, or ``ray`` at
    each of a comma-separated list (one cluster)."""
    cmd = [co["python"], str(Path(__file__).resolve()), "--child", f"{mode}:{workers}",
           "--steps", str(args.steps), "--epochs", str(args.epochs), "--skip", str(args.skip),
           "--seed", str(args.seed), "--ray-batch", str(args.ray_batch),
           "--ray-epochs", str(args.ray_epochs), "--ray-rounds", str(args.ray_rounds)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=co["path"])
    if p.returncode != 0:
        tail = "\n".join(p.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"{co['path']}: {mode} at {workers} workers failed:\n{tail}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": runs[0]["steps"], "steady_steps": runs[0]["steady_steps"]}
    for key in FIGURES:
        vals = [r[key] for r in runs if key in r]
        if vals:
            out[key] = round(statistics.median(vals), 4)
    for key in ("driver_cpu_ms_per_step", "steady_wall_ms_per_step"):
        if key in runs[0]:
            out[f"{key}_runs"] = [round(r[key], 4) for r in runs]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", action="append", default=None,
                    help="A checkout to measure (with its .venv); repeat for side by side "
                         "(before first). Default: this one.")
    ap.add_argument("--sim", default="2,16,64,256", help="Simulated worker counts ('' none).")
    ap.add_argument("--ray", default="2,4", help="Worker counts on Ray ('' none).")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="Simulated steps per epoch.")
    ap.add_argument("--epochs", type=int, default=5, help="Simulated epochs.")
    ap.add_argument("--skip", type=int, default=1, help="Epochs left out of the steady figure.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ray-batch", type=int, default=32, help="Samples per worker per step.")
    ap.add_argument("--ray-epochs", type=int, default=3)
    ap.add_argument("--ray-rounds", type=int, default=3,
                    help="Runs of each Ray size on one cluster (a cluster's start costs "
                         "about a minute on 2 busy cores).")
    ap.add_argument("--ray-repeats", type=int, default=1,
                    help="Clusters per checkout, interleaved (each runs --ray-rounds).")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for name in ("repeats", "steps", "epochs", "skip", "ray_batch", "ray_epochs",
                 "ray_rounds", "ray_repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be at least 1")

    if args.child:
        mode, _, ns = args.child.partition(":")
        sizes = _ints(ns, "--child")
        got = [measure_sim(n, args) for n in sizes] if mode == "sim" else measure_ray(sizes, args)
        print(json.dumps(got), flush=True)
        return

    sims, rays = _ints(args.sim, "--sim"), _ints(args.ray, "--ray")
    cos = [checkout(p) for p in (args.repo or [str(ROOT)])]
    if len({co["label"] for co in cos}) < len(cos):
        for i, co in enumerate(cos):
            co["label"] = f"{i}:{co['label']}"
    # (mode, workers) -> per checkout, its runs
    runs: dict[tuple[str, int], list[list[dict[str, Any]]]] = {
        (m, n): [[] for _ in cos] for m, ns in (("sim", sims), ("ray", rays)) for n in ns}
    # Each repeat: every simulated size, then Ray, each checkout in turn (interleaved).
    load0 = os.getloadavg()[0]
    for r in range(max(args.repeats, args.ray_repeats if rays else 0)):
        children = [("sim", str(n)) for n in sims if r < args.repeats]
        children += [("ray", args.ray)] if rays and r < args.ray_repeats else []
        for mode, ns in children:
            for i, co in enumerate(cos):
                for res in run_child(co, mode, ns, args):
                    runs[(mode, res["workers"])][i].append(res)
                    log(f"[{r}] {co['label']} {mode} {res['workers']}: driver "
                        f"{res['driver_cpu_ms_per_step']:.3f} ms/step "
                        f"({res['wall_s']:.1f}s)")
    result: dict[str, Any] = {
        "benchmark": "driver_cost",
        "checkouts": {co["label"]: co["path"] for co in cos},
        "simulated": {}, "ray": {}}
    for (mode, n), per_co in runs.items():
        entry: dict[str, Any] = {co["label"]: summarise(rs)
                                 for co, rs in zip(cos, per_co, strict=True)}
        if len(cos) == 2:
            b, a = (summarise(rs)["driver_cpu_ms_per_step"] for rs in per_co)
            entry["ratio"] = round(a / b, 3) if b else None
        result["simulated" if mode == "sim" else "ray"][str(n)] = entry
    result |= {
        "sim_workload": (f"bench/simulate.py's scale cluster, workers: auto (one per node), "
                         f"64 samples per node per step, policy dbs, {args.steps} steps x "
                         f"{args.epochs} epochs, steady = after epoch {args.skip}"),
        "ray_workload": (f"LeNet on digits, {args.ray_batch} samples per worker per step, "
                         f"{args.ray_epochs} epochs, one 1-CPU cluster_utils node per worker, "
                         f"coordinator in the bench's process; steady = after epoch "
                         f"{args.skip}"),
        "repeats": args.repeats, "ray_rounds": args.ray_rounds,
        "ray_repeats": args.ray_repeats, "cpus": os.cpu_count(),
        "load_average": [round(load0, 1), round(os.getloadavg()[0], 1)],
        "command": "python bench/driver_cost.py " + " ".join(sys.argv[1:]),
    }
    emit(result, args.out, indent=2)


if __name__ == "__main__":
    main()

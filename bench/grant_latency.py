"""What a node assignment costs a running job on Ray, from the assign call to its workers.

Issue 50 ("assigned nodes sit idle"): from the cluster scheduler's ``assign`` call to the
new workers' start, to their coming up, and to the group that trains with them, for one
checkout or for several side by side.

**The run.** A local Ray cluster (``ray.cluster_utils``: a head without CPUs and three
worker nodes of one CPU, each carrying the resource ``grant_node``, as
``tests/integration/conftest.py`` builds the session's) holds a job launched as the
cluster scheduler launches one, :func:`~dynabatch.scheduler.runtime.launch.launch_coordinator`
with an assignment of one node. The job trains an MLP on scikit-learn's digits, every
worker emulated ``--slowdown`` times slower (``emulation.slowdowns``) so that a segment
of steps lasts a few seconds. Once its first epoch has ended and its second is under way (a
segment in flight), it is assigned all three nodes (``handle.assign.remote``) and watched
until its snapshot lists three workers that train (``joined``); then it is cancelled.

**The figures**, in seconds from the ``assign`` call (the bench's ``time.time()`` just
before it; the coordinator runs on this host, so its wall clock is the same), all from what
the job reported (its log lines and membership events, ``logs()`` and
``membership_events()``), none from the plan:

* ``arrived_s``: the job's log line ``assignment requested``;
* ``started_s``: the last new worker's ``starting worker ... on node ...`` line (its actor
  was asked for); ``started_first_s`` the first;
* ``up_s``: the last new worker's ``join`` event (taken in as a member at the first step
  boundary after its actor came up; it trains from the next group formed);
  ``cold_start_s``: the median, over the new workers, of its join event less its start
  line;
* ``joined_s``: the log line ``generation G: 3 workers`` of the group that trains with
  them (the snapshot's workers all ``joined``); ``seen_joined_s``: when the bench's poll
  (every 0.1 s) first saw that snapshot;
* ``segment_s``: the segment in force as the assignment came, the steps of a segment
  (``MAX_SEGMENT_STEPS``, at most the epoch's steps) times the step time of the job's
  first epoch record (its ``wall_s`` over its ``steps``); ``step_at_assign``: the job's step
  in its epoch then.

**Side by side** (``--repo PATH``, repeatable, the checkout before first): each run is a
child process of this interpreter with ``PATH``'s ``dynabatch`` on ``PYTHONPATH`` (a folder
of links onto the checkout, laid out as ``setup.py`` maps it), connected to the one cluster
this process starts, with the same ``PYTHONPATH`` in its Ray job's ``runtime_env`` so that
the job's coordinator and workers import that checkout too (checked: the coordinator's
class must come from ``PATH``). ``--rounds`` rounds, the checkouts alternating (A B A B);
each figure is reported per run and as the median; with two checkouts ``ratio`` is the
second's median over the first's (after / before). This file need not be in the checkout
measured: run main's copy against both, e.g. with the commit before cfbc2b1 in a worktree::

    git worktree add /tmp/before cfbc2b1^
    nice -n 10 .venv/bin/python bench/grant_latency.py --repo /tmp/before --repo . \\
        --rounds 3 --out bench/results-grant-latency.json

Prints one JSON object on stdout (progress on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench.report import emit  # noqa: E402

TAG = "grant_node"  # the resource every worker node carries, and the job's node_resource
NODES = 3
# The four top-level folders setup.py maps under ``dynabatch`` (``dynabatch`` itself is
# api/public/).
PACKAGES = ("service", "actors", "scheduler", "api")
FIGURES = ("arrived_s", "started_first_s", "started_s", "up_s", "cold_start_s", "joined_s",
           "seen_joined_s", "segment_s", "step_s")

START_LINE = re.compile(r"starting worker (\S+) on node ")
GROUP_LINE = re.compile(r"generation (\d+): (\d+) workers")
ASSIGN_LINE = "assignment requested"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the job's reports
def latencies(t_call: float, size: int, logs: Iterable[Mapping[str, Any]],
              events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The assignment's figures (seconds from ``t_call``) from the job's log lines
    (``time``, ``message``) and membership events (``time``, ``kind``, ``worker``), as
    dicts: see the module's docstring. ``size``: the workers the assignment asks for.
    Raises ``ValueError`` naming what the job did not report."""
    after = sorted((x for x in logs if x["time"] >= t_call), key=lambda x: x["time"])
    arrived = next((x["time"] for x in after if x["message"].startswith(ASSIGN_LINE)), None)
    if arrived is None:
        raise ValueError(f"the job logged no '{ASSIGN_LINE}' line after the assign call")
    starts: dict[str, float] = {}
    for x in after:
        m = START_LINE.match(x["message"])
        if m and m.group(1) not in starts:
            starts[m.group(1)] = x["time"]
    if not starts:
        raise ValueError("the job logged no 'starting worker' line after the assign call")
    joins: dict[str, float] = {}
    for e in sorted(events, key=lambda e: e["time"]):
        if e["kind"] == "join" and e["worker"] in starts and e["worker"] not in joins:
            joins[e["worker"]] = e["time"]
    missing = sorted(set(starts) - set(joins))
    if missing:
        raise ValueError(f"worker(s) {', '.join(missing)} started but have no join event")
    formed = None
    for x in after:
        g = GROUP_LINE.match(x["message"])
        if g and int(g.group(2)) == size and x["time"] >= max(joins.values()):
            formed = x["time"]
            break
    if formed is None:
        raise ValueError(f"the job logged no 'generation G: {size} workers' line after its "
                         f"new workers joined")
    return {
        "new_workers": sorted(starts),
        "arrived_s": arrived - t_call,
        "started_first_s": min(starts.values()) - t_call,
        "started_s": max(starts.values()) - t_call,
        "up_s": max(joins.values()) - t_call,
        "cold_start_s": statistics.median(joins[w] - starts[w] for w in starts),
        "joined_s": formed - t_call,
    }


def segment(record: Mapping[str, Any], max_steps: int) -> dict[str, float]:
    """The step time and segment length of an epoch record (``wall_s``, ``steps``): a
    segment is ``max_steps`` steps, or the epoch's steps when fewer."""
    steps = record["steps"]
    if steps < 1:
        raise ValueError(f"epoch {record.get('epoch')}: no steps")
    step_s = record["wall_s"] / steps
    return {"step_s": step_s, "segment_s": step_s * min(max_steps, steps)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over ``runs`` (rounded to ms), and every run's."""
    out: dict[str, Any] = {}
    for key in FIGURES:
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            out[key] = round(statistics.median(vals), 3)
    out["runs"] = [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                   for r in runs]
    return out


def ratios(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float | None]:
    """``after`` / ``before`` for each figure both have (below 1: sooner)."""
    return {k: (round(after[k] / before[k], 3) if before[k] else None)
            for k in FIGURES if k in before and k in after}


# ------------------------------------------------------------------ one run (child)
def job_spec(name: str, slowdown: float) -> Any:
    from dynabatch.actors.spec import JobSpec

    return JobSpec.model_validate(dict(
        name=name, dataset={"name": "digits"}, model={"name": "mlp", "hidden": 64},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        workers=1, min_workers=1, max_workers=NODES, global_batch=64, epochs=20, seed=5,
        node_resource=TAG, spares=0, collective_timeout_s=30, worker_wait_timeout_s=60,
        # Every worker as slow, whatever its ordinal (new workers take higher ones).
        emulation={"slowdowns": [slowdown] * 8}))


def wait(what: str, predicate: Any, timeout_s: float, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")


def measure(address: str, job_id: str, slowdown: float, code: str) -> dict[str, Any]:
    """One run on the cluster at ``address``: the job on one node, assigned all three
    mid-epoch; its figures. ``code``: the checkout whose ``dynabatch`` this process imports
    (the job's coordinator must import the same)."""
    import ray
    from dynabatch.scheduler.core.sync.protocol import MAX_SEGMENT_STEPS
    from dynabatch.scheduler.runtime.launch import launch_coordinator

    ray.init(address=address, namespace="dynabatch", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    try:
        nodes = sorted(n["NodeID"] for n in ray.nodes()
                       if n["Alive"] and n["Resources"].get(TAG))
        if len(nodes) != NODES:
            raise RuntimeError(f"{len(nodes)} nodes carry {TAG}, not {NODES}")
        # The previous run's workers gone: every node's slot free.
        wait("free nodes", lambda: ray.available_resources().get(TAG, 0) >= NODES, 60)
        t0 = time.monotonic()
        handle = launch_coordinator(job_id, job_spec(job_id, slowdown), detached=False,
                                    resume=False, assignment={nodes[0]: 1})
        where = ray.get(handle.__ray_call__.remote(
            lambda self: sys.modules[type(self).__module__].__file__))
        if not Path(where).resolve().is_relative_to(Path(code)):
            raise RuntimeError(f"the job's coordinator runs {where}, not {code}'s")

        def snap() -> Any:
            return ray.get(handle.snapshot.remote())

        def training_epoch_1() -> Any:
            s = snap()
            if s.state.is_terminal:
                raise RuntimeError(f"the job ended before the assignment: {s.state.value}: "
                                   f"{s.reason}")
            return s if s.epoch >= 1 and s.step >= 1 else None

        wait("the job's second epoch", training_epoch_1, 300, 0.25)
        first = ray.get(handle.history.remote())[0]
        seg = segment(first.model_dump(), MAX_SEGMENT_STEPS)
        # Into the segment in flight (its first steps committed, the next sent ahead).
        time.sleep(seg["segment_s"] / 3)
        before = snap()
        t_call = time.time()
        ray.get(handle.assign.remote({n: 1 for n in nodes}))

        def grouped() -> Any:
            s = snap()
            if s.state.is_terminal:
                raise RuntimeError(f"the job ended before its group of {NODES} formed: "
                                   f"{s.state.value}: {s.reason}")
            return s if s.group_size == NODES else None

        try:
            wait(f"a group of {NODES}", grouped, 300)
        except (RuntimeError, TimeoutError):
            for x in ray.get(handle.logs.remote()):  # what the job said, for the reader
                log(f"  job log {x.time - t_call:+8.2f}s {x.level}: {x.message}")
            raise
        seen = time.time() - t_call
        logs = [x.model_dump() for x in ray.get(handle.logs.remote())]
        events = [e.model_dump() for e in ray.get(handle.membership_events.remote())]
        got = latencies(t_call, NODES, logs, events)
        handle.cancel.remote("grant_latency: measured")
        try:
            end = wait("the job's end", lambda: (s := snap()).state.is_terminal and s, 60, 0.5)
            state = end.state.value
        except TimeoutError:
            state = "not ended 60 s after its cancel (killed)"
        ray.kill(handle, no_restart=True)
        return {**got, "seen_joined_s": seen, **seg,
                "step_at_assign": before.step, "steps_per_epoch": before.steps_per_epoch,
                "epoch_at_assign": before.epoch, "run_s": time.monotonic() - t0,
                "end_state": state}
    finally:
        ray.shutdown()


# ------------------------------------------------------------------ side by side (parent)
def shim(root: Path, folder: Path) -> Path:
    """A folder holding ``dynabatch/`` as links onto the checkout ``root``, mapped as
    ``setup.py`` maps it: ``dynabatch`` is ``api/public/``, its sub-packages the four
    top-level folders."""
    pkg = folder / "dynabatch"
    pkg.mkdir(parents=True)
    for name in PACKAGES:
        (pkg / name).symlink_to(root / name)
    for entry in (root / "api" / "public").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    return folder


def checkout(path: str) -> dict[str, Any]:
    root = Path(path).resolve()
    for need in (*PACKAGES, "api/public/__init__.py",
                 "scheduler/runtime/launch.py"):
        if not (root / need).exists():
            raise SystemExit(f"--repo {path}: no {need} (not a dynabatch checkout)")
    git = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                         capture_output=True, text=True)
    commit = git.stdout.strip() or "unknown"
    return {"path": str(root), "commit": commit, "label": f"{root.name}@{commit}"}


def start_cluster() -> Any:
    """Head without CPUs, three 1-CPU nodes carrying :data:`TAG` (and one resource each),
    with the integration tier's head settings."""
    from dynabatch.service.raycluster import fast_health_check
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 150 * 2**20,
        "_system_config": fast_health_check(), "dashboard_port": None,
        "dashboard_agent_listen_port": 0})
    for i in range(NODES):
        c.add_node(num_cpus=1, resources={f"grant{i}": 1, TAG: 1},
                   object_store_memory=100 * 2**20)
    c.wait_for_nodes()
    return c


def run_child(co: dict[str, Any], address: str, job_id: str,
              args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [co["shim"], *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", job_id,
           "--address", address, "--code", co["path"], "--slowdown", str(args.slowdown)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=co["path"])
    if p.returncode != 0:
        said = [x for x in p.stderr.splitlines() if x.startswith("  job log")]
        tail = "\n".join(said + p.stderr.strip().splitlines()[-8:])
        raise SystemExit(f"{co['label']}: run {job_id} failed:\n{tail}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", action="append", default=None,
                    help="A checkout to measure; repeat for side by side (before first). "
                         "Default: this one.")
    ap.add_argument("--rounds", type=int, default=2, help="Runs per checkout, alternating.")
    ap.add_argument("--slowdown", type=float, default=300.0,
                    help="Every worker's emulated slowdown (a segment lasts a few seconds).")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--address", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--code", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds: must be at least 1")
    if not 1.0 <= args.slowdown <= 1000.0:
        raise SystemExit(f"--slowdown: {args.slowdown} is outside 1-1000 (the spec's range)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    if args.child:
        print(json.dumps(measure(args.address, args.child, args.slowdown, args.code)),
              flush=True)
        return

    cos = [checkout(p) for p in (args.repo or [str(ROOT)])]
    if len({co["label"] for co in cos}) < len(cos):
        for i, co in enumerate(cos):
            co["label"] = f"{i}:{co['label']}"
    load0 = os.getloadavg()[0]
    runs: list[list[dict[str, Any]]] = [[] for _ in cos]
    with tempfile.TemporaryDirectory(prefix="grant-latency-") as tmp:
        for i, co in enumerate(cos):
            co["shim"] = str(shim(Path(co["path"]), Path(tmp, str(i))))
        t0 = time.monotonic()
        cluster = start_cluster()
        log(f"cluster: {NODES} nodes up in {time.monotonic() - t0:.1f}s")
        try:
            for r in range(args.rounds):
                for i, co in enumerate(cos):
                    res = run_child(co, cluster.address, f"grant-{i}-{r}", args)
                    runs[i].append(res)
                    log(f"[{r}] {co['label']}: started {res['started_s']:.2f}s, up "
                        f"{res['up_s']:.2f}s, joined {res['joined_s']:.2f}s after the "
                        f"assign (segment {res['segment_s']:.2f}s, run {res['run_s']:.0f}s)")
        finally:
            cluster.shutdown()
    result: dict[str, Any] = {
        "benchmark": "grant_latency",
        "checkouts": {co["label"]: co["path"] for co in cos},
        "results": {co["label"]: summarise(rs) for co, rs in zip(cos, runs, strict=True)},
    }
    if len(cos) == 2:
        a, b = (result["results"][co["label"]] for co in cos)
        result["ratio"] = ratios(a, b)
    result |= {
        "workload": (f"MLP (hidden 64) on digits, global batch 64, every worker "
                     f"{args.slowdown:g}x slower (emulated); launched with an assignment of "
                     f"1 node, assigned all {NODES} in its second epoch, a third of a segment "
                     f"in; {NODES} cluster_utils nodes of 1 CPU, one cluster for every run"),
        "rounds": args.rounds, "cpus": os.cpu_count(),
        "load_average": [round(load0, 1), round(os.getloadavg()[0], 1)],
        "command": "python bench/grant_latency.py " + " ".join(sys.argv[1:]),
    }
    emit(result, args.out, indent=2)


if __name__ == "__main__":
    main()

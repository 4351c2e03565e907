"""Several jobs on one unequal cluster, simulated at job level with the cluster policy's code.

A seeded trace: ``--nodes`` nodes of 4 types, and ``--jobs`` jobs arriving over time. Each
job's progress is its throughput (samples/s) under its current allocation, from the same
:class:`~dynabatch.scheduler.core.cluster.throughput.ThroughputModel` the policy plans with;
the same :func:`~dynabatch.scheduler.core.cluster.decision.decide` allocates. Compared:
``fifo`` (today's behaviour: first come first served, a running job keeps what it got),
``single_type`` (the goodput program with one node type per job, as Gavel and Sia
allocate), ``fair`` (max-min on normalised throughput) and ``goodput`` (jobs may span
types).

The trace (shapes of the public Philly (Jeon et al., ATC'19) and Helios (Hu et al.,
SC'21) traces, not their data):

* nodes: 10% H100 (8 workers each), 20% A100 (8), 30% V100 (4), 40% CPU boxes (1); nominal
  speed of one worker H100 : A100 : V100 : CPU = 1 : 0.6 : 0.3 : 0.05, and each job's own
  ratio to H100 varies around it (lognormal, sigma 0.25): models gain unequally from a fast
  GPU, which is what a heterogeneity-aware policy exploits;
* size: the workers a job asks for, g in 1, 2, 4, ..., 64 with probabilities 0.55, 0.12,
  0.15, 0.12, 0.04, 0.015, 0.005 (most jobs use one GPU; a few use many); ``min_workers``
  = ceil(g/2), ``max_workers`` = 2g;
* duration: its run time on g A100 workers, lognormal with median 20 min and sigma 1.4,
  clipped to [1 min, 48 h] (heavy-tailed: most jobs are short, a few run for days); its
  work in samples is that time × its throughput there;
* scaling: per job, the efficiency on g A100 workers is uniform in [0.7, 0.95]; with
  ``throughput(S) = S / (1 + k·S)`` that fixes k (a fixed per-step cost and the all-reduce);
* arrivals: Poisson, at the rate that offers ``--load`` times the cluster's capacity in
  A100-equivalent worker-seconds (so ``--load 1`` keeps the cluster about busy).

A job learns its speed on a type by running there: until then its rate on that type is the
bootstrap's estimate from other jobs' ratios (hints: the nominal ratios), as the service
would do. Rounds every ``--round-s`` seconds and on every arrival and finish; a round where
neither happened and no job's hold expired is skipped, since its inputs equal the last
decision's and the policy returns the same decision for the same inputs. Every change of a
job's nodes costs it ``--resize-pause-s`` seconds of no progress (a regroup at a step
boundary), under every policy alike.

Prints ONE JSON object::

    {"nodes", "jobs", "policies": {NAME: {"avg_jct_s", "p90_jct_s", "makespan_s",
     "utilization", "resizes", "decisions", "decision_ms": {"p50", "max"}}},
     "decision_ms": {"p50", "max"}}

``utilization``: allocated worker slots over all slots, averaged over the makespan.
The top-level ``decision_ms`` covers every decision of every policy (the policy call with
its bootstrap, wall time); per policy, ``decision_cpu_ms`` is the same in this process's
CPU time, which other processes on a shared machine inflate much less, and ``load_avg_1m``
the host's 1-minute load average as the policy's run started and ended (``host_cpus``: its
CPUs).

    .venv/bin/python bench/cluster.py [--nodes 1000] [--jobs 400] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynabatch.scheduler.core.cluster.decision import decide
from dynabatch.scheduler.core.cluster.throughput import ThroughputModel, bootstrap, prior
from dynabatch.scheduler.core.cluster.values import ClusterJob, ClusterKnobs, ClusterNode

from bench.cluster_inputs import (
    InputError,
    fit_gavel_job,
    gavel_nodes,
    node_speeds,
    read_gavel_throughputs,
    read_gavel_trace,
    read_jobs_csv,
    read_nodes_csv,
    type_speeds,
)

TYPES = ("H100", "A100", "V100", "CPU")
SPEED = {"H100": 1.0, "A100": 0.6, "V100": 0.3, "CPU": 0.05}
SHARE = {"H100": 0.1, "A100": 0.2, "V100": 0.3, "CPU": 0.4}
SLOTS = {"H100": 8, "A100": 8, "V100": 4, "CPU": 1}
SIZES = (1, 2, 4, 8, 16, 32, 64)
SIZE_P = (0.55, 0.12, 0.15, 0.12, 0.04, 0.015, 0.005)
POLICIES = ("fifo", "single_type", "fair", "goodput")

# dynabatch's own resize cost is measured (bench/elastic.py); see measured_resize_s.
ELASTIC_RESULTS = Path(__file__).resolve().parent / "results-elastic.json"
# A peer's resize is a checkpoint-restart. Pollux (Qiao et al., OSDI'21) charges each
# re-allocation 30 s in its published simulator (petuum/adaptdl at de25dcc,
# simulator/simulator.py, Job.reallocate: ``self.rescale_time = 30``). Gavel's simulator
# charges its preemptions nothing; its round of 6 minutes is sized to amortise them.
PEER_RESTART_S = 30.0
# The policies that stand for the peers (one node type per job, as Gavel and Sia allocate),
# charged PEER_RESTART_S per change of nodes instead of dynabatch's resize.
PEER_POLICIES = ("single_type",)


def measured_resize_s(path: Path = ELASTIC_RESULTS) -> float:
    """What a resize at a step boundary costs dynabatch, from ``bench/elastic.py``'s last
    run: the median seconds from a new node being ready to the first step the job takes
    with its worker (``scale_up.median_ready_to_first_step_s``, 2.25 s in the committed
    run), or from a node's loss to training again, whichever is longer. The running workers
    keep training while a newcomer starts, so charging it as a pause of the whole job is an
    upper bound."""
    try:
        data = json.loads(path.read_text())
        grow = float(data["scale_up"]["median_ready_to_first_step_s"])
        shrink = float(data["node_loss"]["median_removal_to_training_s"])
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror or exc}; give --resize-pause-s") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path}: no measured resize ({exc!r}); give --resize-pause-s") from None
    return round(max(grow, shrink), 2)


def pause_for(policy: str, resize_s: float, restart_s: float, peers: tuple[str, ...]) -> float:
    """The seconds a change of nodes costs a job under ``policy``: a peer's restart for the
    policies standing for a peer, dynabatch's resize for the others."""
    return restart_s if policy in peers else resize_s


@dataclasses.dataclass
class TraceJob:
    job_id: str
    arrival: float
    g: int
    model: ThroughputModel  # the truth
    work: float  # samples (steps, for a trace of Gavel's)
    min_workers: int = 0  # 0: ceil(g/2), the generator's rule
    max_workers: int = 0  # 0: 2g

    def bounds(self) -> tuple[int, int]:
        lo = self.min_workers or max(1, math.ceil(self.g / 2))
        return lo, max(lo, self.max_workers or 2 * self.g)


def make_nodes(n: int) -> list[ClusterNode]:
    counts = {t: round(SHARE[t] * n) for t in TYPES}
    counts["CPU"] += n - sum(counts.values())
    nodes = []
    for t in TYPES:
        nodes += [ClusterNode(f"{t.lower()}-{i:04d}", t, SLOTS[t]) for i in range(counts[t])]
    return nodes


def make_jobs(
    n: int, nodes: list[ClusterNode], load: float, seed: int, size_scale: int = 1
) -> list[TraceJob]:
    """``n`` jobs of the trace (module docstring). ``size_scale``: every job asks for that
    many times the workers (the same trace otherwise, arriving at the rate that offers the
    same load): a cluster ten times larger is filled by the same number of jobs, so its
    steady state can be simulated in the time a larger count of decisions would not fit."""
    rng = np.random.default_rng(seed)
    sizes = rng.choice(SIZES, size=n, p=SIZE_P) * size_scale
    durations = np.clip(rng.lognormal(math.log(20 * 60), 1.4, n), 60.0, 48 * 3600.0)
    capacity = sum(nd.capacity * SPEED[nd.node_type] for nd in nodes) / SPEED["A100"]
    demand = float(np.mean(sizes * durations))  # A100 worker-seconds per job
    rate = load * capacity / demand
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    arrivals -= arrivals[0]
    jobs = []
    for j in range(n):
        base = 100.0 * rng.lognormal(0.0, 0.5)  # samples/s of one H100 worker
        rates = {
            t: base * (SPEED[t] * (rng.lognormal(0.0, 0.25) if t != "H100" else 1.0)) for t in TYPES
        }
        g = int(sizes[j])
        s_ref = g * rates["A100"]
        k = (1.0 / rng.uniform(0.7, 0.95) - 1.0) / s_ref
        model = ThroughputModel.of(rates, TYPES, overhead_s=k, global_batch=1.0)
        work = float(durations[j]) * model.of_speed(s_ref)
        jobs.append(TraceJob(f"job-{j:04d}", float(arrivals[j]), g, model, work))
    return jobs


def from_files(
    trace_path: Path,
    *,
    throughputs: Path | None = None,
    cluster: Path | None = None,
    gavel_cluster: str | None = None,
    gpus_per_server: str = "1:1:1",
    bounds: str = "rigid",
    first: int | None = None,
    skip_unknown: bool = False,
) -> tuple[list[ClusterNode], list[TraceJob], dict[str, float], dict]:
    """(nodes, jobs, the prior per node type, what was read) from files
    (:mod:`bench.cluster_inputs`). A job's truth: with a throughput table, Gavel's measured
    steps/s of its model on its ``workers`` GPUs of each type, fitted exactly
    (``fit_gavel_job``); without one, one worker's rate on a type is the type's ``speed``
    (1 where the nodes file gives none) and 90% scaling efficiency at ``workers``.
    ``bounds``: ``rigid`` (min = max = workers, as Gavel runs them) or ``elastic``
    (ceil(workers/2) .. 2·workers); a CSV's own ``min_workers``/``max_workers`` win.
    ``skip_unknown``: leave out jobs the table has no throughput for (else an error)."""
    rows = (
        read_jobs_csv(trace_path) if trace_path.suffix == ".csv" else read_gavel_trace(trace_path)
    )
    if first is not None:
        rows = sorted(rows, key=lambda r: r.arrival_s)[:first]
    if cluster is not None and gavel_cluster is not None:
        raise InputError("give one of --cluster and --gavel-cluster")
    if cluster is not None:
        node_rows = read_nodes_csv(cluster)
    elif gavel_cluster is not None:
        node_rows = gavel_nodes(gavel_cluster, gpus_per_server)
    else:
        raise InputError("a trace from a file needs --cluster FILE or --gavel-cluster SPEC")
    nodes = [ClusterNode(n.node_id, n.node_type, n.gpus) for n in node_rows]
    types = sorted({n.node_type for n in nodes})
    table = read_gavel_throughputs(throughputs) if throughputs is not None else None
    if table is not None:
        missing = [t for t in types if t not in table]
        if missing:
            raise InputError(f"{throughputs}: node types {', '.join(missing)} have no throughputs")
    # The prior per node type: the nodes file's speed, else the table's class of the type,
    # else the GPU model named in the type (throughput.prior).
    known = dict(node_speeds(node_rows))
    if table is not None:
        known = {**type_speeds(table, types), **known}
    hints = prior(types, known)
    jobs: list[TraceJob] = []
    skipped = 0
    for row in rows:
        if table is not None:
            try:
                rates, k = fit_gavel_job(table, row.model, row.workers, types)
            except KeyError as exc:
                if skip_unknown:
                    skipped += 1
                    continue
                raise InputError(f"{trace_path}: job {row.job_id}: {exc.args[0]}") from None
        else:
            rates = {t: hints[t] for t in types}
            k = (1.0 / 0.9 - 1.0) / (row.workers * max(rates.values()))
        model = ThroughputModel.of(rates, types, overhead_s=k, global_batch=1.0)
        if row.steps is not None:
            work = row.steps
        else:
            assert row.duration_s is not None
            work = row.duration_s * model.of_speed(row.workers * max(rates.values()))
        lo = row.min_workers or (row.workers if bounds == "rigid" else 0)
        hi = row.max_workers or (row.workers if bounds == "rigid" else 0)
        jobs.append(TraceJob(row.job_id, row.arrival_s, row.workers, model, work, lo, hi))
    if not jobs:
        raise InputError(f"{trace_path}: no job left (skipped {skipped} without throughputs)")
    biggest = max(sum(n.capacity for n in nodes if n.node_type == t) for t in types)
    too_big = [j.job_id for j in jobs if j.bounds()[0] > biggest]
    if too_big:
        raise InputError(
            f"{trace_path}: job {too_big[0]} needs more workers than any node type has "
            f"({biggest}); {len(too_big)} such jobs"
        )
    info = {
        "trace": str(trace_path),
        "jobs_read": len(rows),
        "skipped_unknown": skipped,
        "bounds": bounds,
        "prior": hints,
    }
    return nodes, jobs, hints, info


def simulate(
    policy: str,
    nodes: list[ClusterNode],
    trace: list[TraceJob],
    round_s: float,
    hold_s: float,
    pause_s: float,
    hints: dict[str, float] | None = None,
    window: tuple[float, float] | None = None,
    timeshare: bool = False,
) -> tuple[dict, list[float]]:
    """One policy over the trace. ``pause_s``: the seconds of no progress a job pays each
    time its nodes change (a resize, or a restart where a peer's is charged).
    ``hints``: the prior per node type for a job that has not run there (default: the
    generator's nominal speeds). ``window``: (start, end) of a measured window (the
    steady-state mode): its ``busy`` fraction of slot-seconds and the average JCT of the
    jobs that arrive inside it are reported too.

    ``timeshare``: Gavel's round-based time-sharing, for calibration against its
    simulator. At every round boundary the policy decides with no job held, admitting in
    the order of the least attained service first (a job's seconds of progress at its
    speed alone on ``max_workers`` of its fastest type, as the policy normalises); a
    running job keeps its nodes only if admitted again. So a long job that started first
    gives way to waiting ones each round, as Gavel's priorities make it; a job whose nodes
    change pays ``pause_s`` (Gavel's simulator charges 0)."""
    knobs = ClusterKnobs(policy=policy, hold_s=hold_s)
    total_slots = sum(n.capacity for n in nodes)
    types = sorted({n.node_type for n in nodes})
    hints = dict(SPEED if hints is None else hints)
    by_id = {j.job_id: j for j in trace}
    # A job's throughput alone on max_workers of its fastest type (timeshare's service unit).
    ref = {j.job_id: max(j.model.throughput({tt: j.bounds()[1]}) for tt in types) for j in trace}
    pending = sorted(trace, key=lambda j: j.arrival)
    nxt = 0
    active: dict[str, dict] = {}
    finished: dict[str, float] = {}
    t = 0.0
    last_decision = -math.inf
    decision_ms: list[float] = []
    cpu_ms: list[
        float
    ] = []  # this process's CPU time: what neighbours on a shared machine do not inflate
    busy = 0.0  # slot-seconds allocated
    window_busy = 0.0  # of them, inside the measured window
    resizes = 0
    need = False
    next_round = 0.0
    while len(finished) < len(trace):
        while nxt < len(pending) and pending[nxt].arrival <= t + 1e-9:
            j = pending[nxt]
            active[j.job_id] = {
                "remaining": j.work,
                "slots": (),
                "types": {},
                "last": None,
                "pause_until": 0.0,
                "measured": set(),
                "attained": 0.0,
            }
            nxt += 1
            need = True
        expired = any(
            s["last"] is not None and last_decision < s["last"] + hold_s <= t
            for s in active.values()
        )
        if need or (t >= next_round - 1e-9 and (expired or timeshare)):
            start = time.perf_counter()
            cpu = time.process_time()
            estimated = {
                jid: ThroughputModel.of(
                    {tt: by_id[jid].model.rate(tt) for tt in s["measured"]},
                    s["measured"],
                    by_id[jid].model.overhead_s,
                    1.0,
                )
                for jid, s in active.items()
            }
            models = bootstrap(estimated, types, hints)
            # A type the job cannot run on at all (rate 0 in its truth: Gavel's table has
            # such, a model too large for the GPU) is known up front, as a job's
            # node_resource is, not learned by running there.
            for jid in models:
                cannot = {tt for tt in types if by_id[jid].model.rate(tt) <= 0.0}
                if cannot:
                    m = models[jid]
                    models[jid] = ThroughputModel.of(
                        {tt: (0.0 if tt in cannot else r) for tt, r in m.rates},
                        m.measured,
                        m.overhead_s,
                        m.global_batch,
                    )
            # Time-sharing: nobody is held; the least attained service is admitted first,
            # and a running job keeps its nodes only if admitted again.
            rank = {
                jid: i
                for i, jid in enumerate(sorted(active, key=lambda j: (active[j]["attained"], j)))
            }
            jobs = [
                ClusterJob(
                    jid,
                    *by_id[jid].bounds(),
                    models[jid],
                    priority=-rank[jid] if timeshare else 0,
                    submit_s=by_id[jid].arrival,
                    allocation=s["slots"],
                    last_resize_s=None if timeshare else s["last"],
                )
                for jid, s in active.items()
            ]
            decision = decide(nodes, jobs, t, knobs)
            decision_ms.append((time.perf_counter() - start) * 1000.0)
            cpu_ms.append((time.process_time() - cpu) * 1000.0)
            for plan in decision.plans:
                s = active[plan.job_id]
                if plan.changed:
                    if s["slots"] and plan.slots:
                        resizes += 1
                    s["slots"], s["types"], s["last"] = plan.slots, dict(plan.by_type), t
                    s["pause_until"] = t + pause_s
                    s["measured"] |= set(s["types"])
            last_decision = t
            need = False
        if t >= next_round - 1e-9:
            next_round = (math.floor(t / round_s) + 1) * round_s
        # The next event: an arrival, a finish, or a round.
        t_next = next_round
        if nxt < len(pending):
            t_next = min(t_next, pending[nxt].arrival)
        speeds = {}
        for jid, s in active.items():
            if s["types"]:
                v = by_id[jid].model.throughput(s["types"])
                speeds[jid] = v
                t_next = min(t_next, max(t, s["pause_until"]) + s["remaining"] / v)
        dt = t_next - t
        inside = 0.0 if window is None else max(0.0, min(t_next, window[1]) - max(t, window[0]))
        for jid, s in active.items():
            if s["types"]:
                busy += sum(s["types"].values()) * dt
                window_busy += sum(s["types"].values()) * inside
                run = max(0.0, t_next - max(t, s["pause_until"]))
                s["remaining"] -= speeds[jid] * run
                s["attained"] += speeds[jid] * run / ref[jid]
        t = t_next
        for jid in [
            jid
            for jid, s in active.items()
            if s["types"] and s["remaining"] <= 1e-6 * by_id[jid].work
        ]:
            finished[jid] = t
            del active[jid]
            need = True
    jct = np.array([finished[j.job_id] - j.arrival for j in trace])
    makespan = max(finished.values())
    measured = {}
    if window is not None:
        inside_jobs = [
            finished[j.job_id] - j.arrival for j in trace if window[0] <= j.arrival <= window[1]
        ]
        measured = {
            "window": {
                "start_s": round(window[0], 1),
                "end_s": round(window[1], 1),
                "busy": round(window_busy / (total_slots * (window[1] - window[0])), 4),
                "jobs": len(inside_jobs),
                "avg_jct_s": round(float(np.mean(inside_jobs)), 1) if inside_jobs else None,
            }
        }
    return {
        **measured,
        "avg_jct_s": round(float(jct.mean()), 1),
        "p90_jct_s": round(float(np.percentile(jct, 90)), 1),
        "makespan_s": round(makespan, 1),
        "utilization": round(busy / (total_slots * makespan), 4),
        "resizes": resizes,
        "decisions": len(decision_ms),
        "decision_ms": _summary(decision_ms),
        "decision_cpu_ms": _summary(cpu_ms),
    }, decision_ms


def _summary(ms: list[float]) -> dict:
    return {"p50": round(float(np.median(ms)), 2), "max": round(float(np.max(ms)), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--load", type=float, default=1.0)
    ap.add_argument(
        "--size-scale",
        type=int,
        default=1,
        help="every generated job asks for this many times the workers (a large cluster "
        "filled by fewer jobs)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--round-s", type=float, default=30.0)
    ap.add_argument("--hold-s", type=float, default=120.0)
    ap.add_argument(
        "--resize-pause-s",
        type=float,
        help="dynabatch's cost of a resize at a step boundary (default: measured, "
        "bench/results-elastic.json)",
    )
    ap.add_argument(
        "--restart-s",
        type=float,
        default=PEER_RESTART_S,
        help="a peer's checkpoint-restart, charged per change of nodes to --peer-policies "
        f"(default {PEER_RESTART_S:g}: Pollux's simulator)",
    )
    ap.add_argument("--peer-policies", default=",".join(PEER_POLICIES))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--steady",
        type=float,
        metavar="WARM",
        help="steady-state mode: measure from the arrival of the first WARM fraction of jobs "
        "(warm-up) to the last arrival (drain excluded); busy and JCT over that window",
    )
    ap.add_argument("--out", type=Path)
    files = ap.add_argument_group("inputs from files (docs/cluster.md, 'Inputs from files')")
    files.add_argument("--trace", type=Path, help="Gavel's trace, or a CSV of jobs (.csv)")
    files.add_argument("--throughputs", type=Path, help="Gavel's throughput JSON")
    files.add_argument("--cluster", type=Path, help="a CSV of nodes: id,type,gpus[,speed]")
    files.add_argument("--gavel-cluster", help="Gavel's spec #v100:#p100:#k80 (GPUs)")
    files.add_argument("--gpus-per-server", default="1:1:1")
    files.add_argument("--bounds", choices=("rigid", "elastic"), default="rigid")
    files.add_argument("--first", type=int, help="only the first N jobs by arrival")
    files.add_argument(
        "--skip-unknown", action="store_true", help="leave out jobs the throughput table lacks"
    )
    args = ap.parse_args()
    hints = None
    out: dict = {}
    try:
        resize_s = measured_resize_s() if args.resize_pause_s is None else args.resize_pause_s
    except InputError as exc:
        sys.exit(f"error: {exc}")
    peers = tuple(p for p in args.peer_policies.split(",") if p)
    out["costs"] = {"resize_s": resize_s, "restart_s": args.restart_s, "peer_policies": peers}
    if args.trace is not None:
        try:
            nodes, trace, hints, info = from_files(
                args.trace,
                throughputs=args.throughputs,
                cluster=args.cluster,
                gavel_cluster=args.gavel_cluster,
                gpus_per_server=args.gpus_per_server,
                bounds=args.bounds,
                first=args.first,
                skip_unknown=args.skip_unknown,
            )
        except InputError as exc:
            sys.exit(f"error: {exc}")
        out.update(info)
    else:
        nodes = make_nodes(args.nodes)
        if args.size_scale < 1:
            sys.exit(f"error: --size-scale: {args.size_scale} is below 1")
        trace = make_jobs(args.jobs, nodes, args.load, args.seed, args.size_scale)
        out.update(seed=args.seed, load=args.load, size_scale=args.size_scale)
    out.update(nodes=len(nodes), jobs=len(trace), slots=sum(n.capacity for n in nodes), policies={})
    window = None
    if args.steady is not None:
        arrivals = sorted(j.arrival for j in trace)
        window = (arrivals[min(len(arrivals) - 1, int(args.steady * len(arrivals)))], arrivals[-1])
    every: list[float] = []
    out["host_cpus"] = os.cpu_count()
    for policy in args.policies.split(","):
        load_before = os.getloadavg()[0]
        out["policies"][policy], ms = simulate(
            policy,
            nodes,
            trace,
            args.round_s,
            args.hold_s,
            pause_for(policy, resize_s, args.restart_s, peers),
            hints,
            window,
        )
        # The host's 1-minute load average as the policy started and ended: how far its wall
        # times are from a quiet machine's (its decision_cpu_ms much less so).
        out["policies"][policy]["load_avg_1m"] = [
            round(load_before, 2),
            round(os.getloadavg()[0], 2),
        ]
        every += ms
        print(f"{policy}: {out['policies'][policy]}", file=sys.stderr, flush=True)
    out["decision_ms"] = _summary(every)
    text = json.dumps(out)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

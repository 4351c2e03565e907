"""dynabatch's cluster policies beside Gavel's, on Gavel's own traces and throughputs.

Each case is one of Gavel's traces (its Philly-derived ``traces/msr/seed=S/VC.trace``, or
any trace in its format), cut to its first ``--first`` jobs that Gavel's throughput table
covers (a job type it measured at that scale factor; the others are left out of both
simulators, and counted), on a cluster in Gavel's notation (``#v100:#p100:#k80`` GPUs,
``--gpus-per-server``). The same cut trace runs in

* **Gavel's simulator** (``scripts/drivers/simulate_scheduler_with_trace.py`` of
  stanford-futuredata/gavel), outside this repository, for each of ``--gavel-policies``:
  with ``--gavel-dir DIR`` (its checkout) and ``--gavel-python PY`` (a Python with its
  dependencies) this script writes the cut trace in Gavel's 10-field format to a temporary
  directory and runs it there, reading ``Average job completion time`` from its output;
  or with ``--gavel-results FILE`` it takes Gavel's figures from an earlier output of this
  script (a case matched by trace and cluster), so nothing of Gavel's is needed here;
* **dynabatch's job-level simulator** (``bench/cluster.py``'s ``simulate``, the policy's
  own code) for ``fair``, ``single_type`` and ``goodput``, with each job's truth fitted
  exactly to Gavel's measured steps/s on its GPUs of each type
  (``bench/cluster_inputs.py``'s ``fit_gavel_job``), rigid (``min = max = scale_factor``,
  as Gavel runs it) and elastic (``ceil(g/2) .. 2g``). A change of a job's nodes costs
  dynabatch's measured resize (``--resize-pause-s``, default from
  ``bench/results-elastic.json``) and, under ``single_type`` (which stands for Gavel and
  Sia, one type per job), a peer's checkpoint-restart (``--restart-s``, default Pollux's
  30 s; ``bench/cluster.py``'s ``PEER_RESTART_S``).
* **the calibration row** (``--rows ...,timeshare``): the rigid jobs under dynabatch's
  ``--timeshare-policies`` with Gavel's time-sharing (``simulate(timeshare=True)``: every
  round every job is placed afresh, least attained service first) and Gavel simulator's
  free preemption (``--timeshare-restart-s`` 0): where the policies agree, the two
  simulators should agree. It decides every round, so it is the slow row.

``--merge FILE`` (repeatable) adds the traces of earlier outputs of this script: runs of
one trace each (several at once, say) become one file. They must come from the same Gavel
commit, command and settings as each other and as this run's cases, else the merge is
refused, naming the file and what differs; a trace run later (a later file, or a case of
this run) replaces an earlier one of the same trace and cluster. With ``--merge`` alone no
case is run.

Prints ONE JSON object::

    {"gavel_commit", "gavel_command", "settings", "traces": [{"trace", "cluster", "jobs",
     "skipped_unknown", "gavel": {POLICY: {"avg_jct_s"}},
     "dynabatch": {POLICY: {"avg_jct_s", ...}},            # rigid jobs
     "dynabatch_elastic": {POLICY: {"avg_jct_s", ...}},    # elastic jobs
     "dynabatch_timeshare": {POLICY: {"avg_jct_s", ...}},  # rigid, time-shared (calibration)
     "ratios": {...}}]}

    .venv/bin/python bench/cluster_gavel.py --case TRACE@36:36:36 [--case ...] \\
        --throughputs bench/data/gavel/simulation_throughputs.json --first 100 \\
        (--gavel-dir /tmp/gavel/scheduler --gavel-python /tmp/gavel-venv/bin/python \\
         --gavel-commit SHA | --gavel-results bench/results-cluster-gavel.json)
    .venv/bin/python bench/cluster_gavel.py --merge A.json --merge B.json --out C.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster import (
    PEER_POLICIES,
    PEER_RESTART_S,
    from_files,
    measured_resize_s,
    pause_for,
    simulate,
)
from bench.cluster_inputs import (
    InputError,
    JobRow,
    read_gavel_throughputs,
    read_gavel_trace,
)

GAVEL_POLICIES = ("max_min_fairness", "max_min_fairness_perf", "finish_time_fairness_perf")
OURS = ("fair", "single_type", "goodput")
# Row sets: the key in a trace's entry, the jobs' bounds, whether Gavel's time-sharing.
ROWS = {
    "rigid": ("dynabatch", "rigid", False),
    "elastic": ("dynabatch_elastic", "elastic", False),
    "timeshare": ("dynabatch_timeshare", "rigid", True),
}
DRIVER = "scripts/drivers/simulate_scheduler_with_trace.py"
JCT = re.compile(r"Average job completion time:\s*([0-9.eE+-]+)\s*seconds")


class MergeError(ValueError):
    """Outputs that cannot be merged; its message is one line."""


# What says how an output's figures were made: outputs merged must agree on all of them.
PROVENANCE = ("gavel_commit", "gavel_command", "settings")


def merge(outputs: list[tuple[str, dict]]) -> dict:
    """Outputs of this script (each with the name of where it came from) as one: their
    traces in order, a later trace of the same (trace, cluster) replacing the earlier in
    its place. Raises :class:`MergeError` when two differ in how they were made."""
    if not outputs:
        raise MergeError("nothing to merge")
    first_name, first = outputs[0]
    merged: dict = {k: first.get(k) for k in PROVENANCE}
    traces: dict[tuple[str, str], dict] = {}
    for name, out in outputs:
        for key in PROVENANCE:
            if out.get(key) != merged[key]:
                raise MergeError(
                    f"{name}: {key}: {json.dumps(out.get(key))} differs from "
                    f"{first_name}'s {json.dumps(merged[key])}"
                )
        for entry in out.get("traces", []):
            traces[(entry["trace"], entry["cluster"])] = entry
    merged["traces"] = list(traces.values())
    return merged


def read_output(path: Path) -> dict:
    """An earlier output of this script; a file that is not one is a one-line error."""
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MergeError(f"{path}: cannot be read as JSON: {exc}") from None
    if not isinstance(out, dict) or not isinstance(out.get("traces"), list):
        raise MergeError(f"{path}: traces: missing; not an output of bench/cluster_gavel.py")
    return out


def cut(trace: Path, table: dict, first: int) -> tuple[list[JobRow], int]:
    """The first ``first`` jobs (by arrival) whose (model, workers) the table has on every
    type; and how many jobs before the cut it left out."""
    rows = sorted(read_gavel_trace(trace), key=lambda r: r.arrival_s)
    kept: list[JobRow] = []
    skipped = 0
    for r in rows:
        if len(kept) == first:
            break
        if all((r.model, r.workers) in table[t] for t in table):
            kept.append(r)
        else:
            skipped += 1
    return kept, skipped


def write_gavel_trace(rows: list[JobRow], path: Path) -> None:
    """Rows in Gavel's 10-field trace format (``utils.parse_trace``); the command and
    directory are placeholders, which its simulator does not run."""
    lines = []
    for r in rows:
        assert r.steps is not None
        fields = [r.model, "-", "-", "-step", "0", str(int(r.steps)), str(r.workers), "1", "-1"]
        lines.append("\t".join([*fields, repr(r.arrival_s)]))
    path.write_text("\n".join(lines) + "\n")


def run_gavel(
    gavel_dir: Path,
    python: str,
    trace: Path,
    throughputs: Path,
    spec: str,
    per_server: str,
    policy: str,
    round_s: int,
) -> tuple[dict, list[str]]:
    """Gavel's simulator on the trace: ({"avg_jct_s", "wall_s"}, the command)."""
    cmd = [
        python,
        DRIVER,
        "-t",
        str(trace),
        "-p",
        policy,
        "--throughputs_file",
        str(throughputs.resolve()),
        "-c",
        spec,
        "--num_gpus_per_server",
        per_server,
        "--seed",
        "0",
        "--solver",
        "ECOS",
        "--time_per_iteration",
        str(round_s),
    ]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=gavel_dir, capture_output=True, text=True, check=False)
    found = JCT.findall(done.stdout + done.stderr)
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"Gavel {policy} on {trace.name}: exit {done.returncode}: {tail[0]}")
    return {
        "avg_jct_s": round(float(found[-1]), 1),
        "wall_s": round(time.monotonic() - start, 1),
    }, cmd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", help="TRACE@#v100:#p100:#k80 (repeatable)")
    ap.add_argument("--throughputs", type=Path, help="Gavel's throughput JSON (with --case)")
    ap.add_argument("--gpus-per-server", default="4:4:4")
    ap.add_argument("--first", type=int, default=100)
    ap.add_argument(
        "--round-s",
        type=float,
        default=360.0,
        help="dynabatch's round, and Gavel's --time_per_iteration",
    )
    ap.add_argument("--hold-s", type=float, default=720.0)
    ap.add_argument(
        "--resize-pause-s",
        type=float,
        help="dynabatch's resize (default: measured, bench/results-elastic.json)",
    )
    ap.add_argument(
        "--restart-s",
        type=float,
        default=PEER_RESTART_S,
        help=f"a peer's checkpoint-restart, charged to {', '.join(PEER_POLICIES)}",
    )
    ap.add_argument(
        "--rows",
        default="rigid,elastic",
        help=f"dynabatch's row sets, of {', '.join(ROWS)} (timeshare: the calibration row)",
    )
    ap.add_argument("--timeshare-policies", default="single_type,fair")
    ap.add_argument(
        "--timeshare-restart-s",
        type=float,
        default=0.0,
        help="a preemption's cost in the timeshare row (Gavel's simulator: 0)",
    )
    ap.add_argument("--gavel-policies", default=",".join(GAVEL_POLICIES))
    ap.add_argument("--gavel-dir", type=Path, help="Gavel's scheduler/ directory")
    ap.add_argument("--gavel-python", default="python3")
    ap.add_argument("--gavel-commit", default=None)
    ap.add_argument("--gavel-results", type=Path, help="Gavel's figures from an earlier run")
    ap.add_argument(
        "--merge",
        type=Path,
        action="append",
        default=[],
        help="an earlier output whose traces join this one's (repeatable)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    try:
        earlier_outputs = [(str(p), read_output(p)) for p in args.merge]
    except MergeError as exc:
        sys.exit(f"error: --merge: {exc}")
    if not args.case:
        if not earlier_outputs:
            sys.exit("error: give --case (run a trace) or --merge (join earlier outputs)")
        _emit(earlier_outputs, None, args.out)
        return
    if args.throughputs is None:
        sys.exit("error: --throughputs: needed with --case")
    if (args.gavel_dir is None) == (args.gavel_results is None):
        sys.exit("error: give one of --gavel-dir (run Gavel) and --gavel-results (read them)")
    rows_wanted = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows_wanted if r not in ROWS]
    if unknown or not rows_wanted:
        sys.exit(f"error: --rows: {', '.join(unknown) or 'empty'}: not of {', '.join(ROWS)}")
    try:
        table = read_gavel_throughputs(args.throughputs)
        resize_s = measured_resize_s() if args.resize_pause_s is None else args.resize_pause_s
    except InputError as exc:
        sys.exit(f"error: {exc}")
    earlier: dict = {}
    commit = args.gavel_commit
    command = None
    if args.gavel_results is not None:
        old = json.loads(args.gavel_results.read_text())
        earlier = {(c["trace"], c["cluster"], c.get("jobs")): c["gavel"] for c in old["traces"]}
        commit = commit or old.get("gavel_commit")
        command = old.get("gavel_command")
    policies = args.gavel_policies.split(",")
    out: dict = {
        "gavel_commit": commit,
        "gavel_command": command,
        "settings": {
            "first": args.first,
            "gpus_per_server": args.gpus_per_server,
            "round_s": args.round_s,
            "hold_s": args.hold_s,
            "resize_pause_s": resize_s,
            "restart_s": args.restart_s,
            "peer_policies": list(PEER_POLICIES),
            "rows": rows_wanted,
            "timeshare_policies": args.timeshare_policies.split(","),
            "timeshare_restart_s": args.timeshare_restart_s,
            "throughputs": str(args.throughputs),
        },
        "traces": [],
    }
    for name, other in earlier_outputs:
        for key in ("gavel_commit", "settings"):
            if other.get(key) != out[key]:
                sys.exit(
                    f"error: --merge: {name}: {key}: {json.dumps(other.get(key))} differs "
                    f"from this run's {json.dumps(out[key])}"
                )
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.case:
            trace_s, _, spec = case.rpartition("@")
            trace = Path(trace_s)
            name = "/".join(trace.parts[-2:])
            try:
                rows, skipped = cut(trace, table, args.first)
            except InputError as exc:
                sys.exit(f"error: {exc}")
            cut_path = Path(tmp) / f"{len(out['traces'])}.trace"
            write_gavel_trace(rows, cut_path)
            entry: dict = {
                "trace": name,
                "cluster": spec,
                "jobs": len(rows),
                "skipped_unknown": skipped,
                "gavel": {},
            }
            if args.gavel_dir is not None:
                for policy in policies:
                    entry["gavel"][policy], cmd = run_gavel(
                        args.gavel_dir,
                        args.gavel_python,
                        cut_path,
                        args.throughputs,
                        spec,
                        args.gpus_per_server,
                        policy,
                        int(args.round_s),
                    )
                    out["gavel_command"] = " ".join(
                        "TRACE" if c == str(cut_path) else c for c in cmd
                    ).replace(str(args.throughputs.resolve()), str(args.throughputs))
                    print(f"{name} gavel {policy}: {entry['gavel'][policy]}", file=sys.stderr)
            else:
                found = earlier.get((name, spec, len(rows)))
                if found is None:
                    sys.exit(
                        f"error: {args.gavel_results}: no Gavel figures for {name} on {spec} "
                        f"with {len(rows)} jobs"
                    )
                entry["gavel"] = found
            for row in rows_wanted:
                key, bounds, timeshare = ROWS[row]
                nodes, jobs, hints, _ = from_files(
                    cut_path,
                    throughputs=args.throughputs,
                    gavel_cluster=spec,
                    gpus_per_server=args.gpus_per_server,
                    bounds=bounds,
                )
                entry[key] = {}
                for policy in args.timeshare_policies.split(",") if timeshare else OURS:
                    pause = (
                        args.timeshare_restart_s
                        if timeshare
                        else pause_for(policy, resize_s, args.restart_s, PEER_POLICIES)
                    )
                    res, _ms = simulate(
                        policy,
                        nodes,
                        jobs,
                        args.round_s,
                        args.hold_s,
                        pause,
                        hints,
                        timeshare=timeshare,
                    )
                    entry[key][policy] = {
                        k: res[k]
                        for k in ("avg_jct_s", "p90_jct_s", "makespan_s", "utilization", "resizes")
                    }
                    print(f"{name} {key} {policy}: {entry[key][policy]}", file=sys.stderr)
            aware = [p for p in entry["gavel"] if p.endswith("_perf")]
            best = min((entry["gavel"][p]["avg_jct_s"] for p in aware), default=None)
            entry["ratios"] = _ratios(entry, best)
            out["traces"].append(entry)
            if args.out:  # after every case, so a long run that is stopped keeps what it did
                _emit(earlier_outputs, out, args.out, final=False)
            print(f"{name}: {entry['ratios']}", file=sys.stderr, flush=True)
    _emit(earlier_outputs, out, args.out)


def _emit(
    earlier: list[tuple[str, dict]], out: dict | None, path: Path | None, final: bool = True
) -> None:
    """This run's output joined to the earlier ones: written to ``path``, and printed when
    final. If they differ in how they were made, the final call prints this run's output
    alone (its figures are not lost) and ends the run with one line saying what differs."""
    outputs = earlier + ([("this run", out)] if out is not None else [])
    try:
        whole = merge(outputs) if earlier else out
    except MergeError as exc:
        if not final:
            return
        if out is not None:
            print(json.dumps(out))
        sys.exit(f"error: --merge: {exc}")
    if final:
        print(json.dumps(whole))
    if path:
        path.write_text(json.dumps(whole, indent=1) + "\n")


def _ratios(entry: dict, best_aware: float | None) -> dict:
    """Average JCT over Gavel's best heterogeneity-aware policy's, and goodput's over
    dynabatch's own single_type, rigid and elastic; for the calibration, each policy's
    over Gavel's ``max_min_fairness_perf`` (the heterogeneity-aware policy)."""
    out: dict = {}
    aware = entry["gavel"].get("max_min_fairness_perf", {}).get("avg_jct_s")
    for key, _bounds, _ts in ROWS.values():
        ours = entry.get(key)
        if not ours:
            continue
        if aware:
            for p, res in ours.items():
                out[f"{key}.{p}/gavel_mmf_perf"] = round(res["avg_jct_s"] / aware, 3)
        if best_aware:
            for p, res in ours.items():
                out[f"{key}.{p}/gavel_best_aware"] = round(res["avg_jct_s"] / best_aware, 3)
        if "goodput" in ours and "single_type" in ours:
            out[f"{key}.goodput/single_type"] = round(
                ours["goodput"]["avg_jct_s"] / ours["single_type"]["avg_jct_s"], 3
            )
    return out


if __name__ == "__main__":
    main()

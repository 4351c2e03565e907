"""A cluster trace and a cluster from files, for ``bench/cluster.py`` and
``bench/cluster_gavel.py``.

Formats (documented in ``docs/cluster.md``, "Inputs from files"):

* Gavel's throughput table (``scheduler/simulation_throughputs.json`` of
  stanford-futuredata/gavel): ``{worker_type: {"(job_type, scale_factor)": {"null":
  steps/s, ...}}}``; ``"null"`` is the job alone on ``scale_factor`` GPUs of that type (the
  other keys, two jobs sharing a GPU, are not used). Types ending in ``_unconsolidated``
  (Gavel's spread placements) are left out.
* Gavel's trace: one job a line, tab-separated: ``job_type, command, working_directory,
  num_steps_arg, needs_data_dir, total_steps, scale_factor, priority_weight, SLO,
  arrival_time`` (10 fields, Gavel's ``utils.parse_trace``), or the 7 fields of its
  Philly-derived traces (``traces/msr/seed=*/*.trace``: ``job_type, command,
  num_steps_arg, needs_data_dir, total_steps, arrival_time, scale_factor``).
* A CSV of jobs with a header: ``arrival_s, workers, model`` and one of ``steps`` (work) or
  ``duration_s`` (its run time on ``workers`` workers of its fastest type); optional
  ``job_id``, ``min_workers``, ``max_workers``.
* A CSV of nodes with a header: ``id, type, gpus``; optional ``speed`` (the type's
  relative throughput class, the prior for a job that has not run there).

Bad input raises :class:`InputError` with one line: ``FILE:LINE: FIELD: problem``.
"""

from __future__ import annotations

import ast
import csv
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

# Throughputs: worker type -> (job type, workers) -> steps/s of the job alone there.
Table = dict[str, dict[tuple[str, int], float]]


class InputError(ValueError):
    """A trace or cluster file that cannot be read; its message is one line."""


def _err(path: Path | str, line: int | None, field: str, problem: str) -> InputError:
    where = f"{path}:{line}" if line is not None else f"{path}"
    return InputError(f"{where}: {field}: {problem}")


@dataclass(frozen=True)
class JobRow:
    """One job of a trace: ``steps`` (its work) or ``duration_s`` (its run time on
    ``workers`` workers of its fastest type), whichever the file gave."""

    job_id: str
    arrival_s: float
    workers: int
    model: str
    steps: float | None = None
    duration_s: float | None = None
    min_workers: int | None = None
    max_workers: int | None = None


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    node_type: str
    gpus: int
    speed: float | None = None


def _number(path, line, field, text, *, whole=False, low=0.0, strict=False) -> float:
    try:
        value = int(text) if whole else float(text)
    except (TypeError, ValueError):
        kind = "a whole number" if whole else "a number"
        raise _err(path, line, field, f"{text!r} is not {kind}") from None
    if not math.isfinite(value) or value < low or (strict and value <= low):
        bound = f"> {low:g}" if strict else f">= {low:g}"
        raise _err(path, line, field, f"{text!r} is not {bound}")
    return value


def _open_text(path: Path | str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise _err(path, None, "file", exc.strerror or str(exc)) from None


def read_gavel_throughputs(path: Path | str) -> Table:
    """Gavel's throughput JSON: per worker type, each (job type, scale factor)'s steps/s
    alone on that many GPUs."""
    try:
        raw = json.loads(_open_text(path))
    except json.JSONDecodeError as exc:
        raise _err(path, exc.lineno, "json", exc.msg) from None
    if not isinstance(raw, dict) or not raw:
        raise _err(path, 1, "json", "not an object of worker types")
    table: Table = {}
    for wtype, entries in raw.items():
        if wtype.endswith("_unconsolidated"):
            continue
        if not isinstance(entries, dict):
            raise _err(path, None, wtype, "not an object of job types")
        out: dict[tuple[str, int], float] = {}
        for key, value in entries.items():
            if key == "null":
                continue
            try:
                job_type, scale = ast.literal_eval(key)
                scale = int(scale)
            except (ValueError, SyntaxError, TypeError):
                raise _err(path, None, f"{wtype}.{key}", "not '(job_type, scale_factor)'") from None
            alone = value.get("null") if isinstance(value, dict) else None
            # 0: the job does not run on that type (Gavel's table has such entries).
            if not isinstance(alone, (int, float)) or not math.isfinite(alone) or alone < 0:
                raise _err(path, None, f"{wtype}.{key}.null", f"{alone!r} is not a number >= 0")
            out[(str(job_type), scale)] = float(alone)
        table[wtype] = out
    if not table:
        raise _err(path, None, "json", "no worker types")
    return table


GAVEL_FIELDS = (
    "job_type",
    "command",
    "working_directory",
    "num_steps_arg",
    "needs_data_dir",
    "total_steps",
    "scale_factor",
    "priority_weight",
    "SLO",
    "arrival_time",
)
MSR_FIELDS = (
    "job_type",
    "command",
    "num_steps_arg",
    "needs_data_dir",
    "total_steps",
    "arrival_time",
    "scale_factor",
)


def read_gavel_trace(path: Path | str) -> list[JobRow]:
    """Gavel's trace (10 fields a line, or the 7 of its Philly-derived traces); job ids
    ``job-LINE`` (1-based lines)."""
    rows: list[JobRow] = []
    for i, raw in enumerate(_open_text(path).splitlines(), start=1):
        if not raw.strip():
            continue
        parts = raw.split("\t")
        if len(parts) == len(GAVEL_FIELDS):
            f = dict(zip(GAVEL_FIELDS, parts, strict=True))
        elif len(parts) == len(MSR_FIELDS):
            f = dict(zip(MSR_FIELDS, parts, strict=True))
        else:
            raise _err(
                path, i, "line", f"{len(parts)} tab-separated fields; Gavel's trace has 10 or 7"
            )
        if not f["job_type"]:
            raise _err(path, i, "job_type", "empty")
        rows.append(
            JobRow(
                job_id=f"job-{i:05d}",
                arrival_s=_number(path, i, "arrival_time", f["arrival_time"]),
                workers=int(_number(path, i, "scale_factor", f["scale_factor"], whole=True, low=1)),
                model=f["job_type"],
                steps=_number(path, i, "total_steps", f["total_steps"], strict=True),
            )
        )
    if not rows:
        raise _err(path, None, "file", "no jobs")
    return rows


def _csv_rows(path: Path | str, required: Iterable[str]) -> tuple[list[str], list[dict]]:
    text = _open_text(path)
    reader = csv.DictReader(text.splitlines())
    header = [h.strip() for h in (reader.fieldnames or [])]
    for name in required:
        if name not in header:
            raise _err(path, 1, "header", f"missing column {name!r} (has {', '.join(header)})")
    rows = []
    for row in reader:
        if None in row:
            raise _err(path, reader.line_num, "line", "more fields than the header")
        clean = {k.strip(): (v or "").strip() for k, v in row.items()}
        if any(clean.values()):
            rows.append((reader.line_num, clean))
    if not rows:
        raise _err(path, None, "file", "no rows")
    return header, rows


def read_jobs_csv(path: Path | str) -> list[JobRow]:
    """A CSV of jobs (see the module's docstring)."""
    header, rows = _csv_rows(path, ("arrival_s", "workers", "model"))
    work = [c for c in ("steps", "duration_s") if c in header]
    if len(work) != 1:
        raise _err(path, 1, "header", "needs exactly one of the columns 'steps', 'duration_s'")
    out: list[JobRow] = []
    seen: set[str] = set()
    for line, r in rows:
        job_id = r.get("job_id") or f"job-{line:05d}"
        if job_id in seen:
            raise _err(path, line, "job_id", f"{job_id!r} appears twice")
        seen.add(job_id)
        if not r["model"]:
            raise _err(path, line, "model", "empty")
        workers = int(_number(path, line, "workers", r["workers"], whole=True, low=1))
        bounds = {}
        for name in ("min_workers", "max_workers"):
            if r.get(name):
                bounds[name] = int(_number(path, line, name, r[name], whole=True, low=1))
        lo = bounds.get("min_workers", workers)
        hi = bounds.get("max_workers", workers)
        if not lo <= workers <= hi:
            raise _err(
                path,
                line,
                "workers",
                f"{workers} is not within min_workers {lo} and max_workers {hi}",
            )
        amount = _number(path, line, work[0], r[work[0]], strict=True)
        out.append(
            JobRow(
                job_id=job_id,
                arrival_s=_number(path, line, "arrival_s", r["arrival_s"]),
                workers=workers,
                model=r["model"],
                steps=amount if work[0] == "steps" else None,
                duration_s=amount if work[0] == "duration_s" else None,
                **bounds,
            )
        )
    return out


def read_nodes_csv(path: Path | str) -> list[NodeRow]:
    """A CSV of nodes (see the module's docstring)."""
    _header, rows = _csv_rows(path, ("id", "type", "gpus"))
    out: list[NodeRow] = []
    seen: set[str] = set()
    speeds: dict[str, float] = {}
    for line, r in rows:
        if not r["id"]:
            raise _err(path, line, "id", "empty")
        if r["id"] in seen:
            raise _err(path, line, "id", f"{r['id']!r} appears twice")
        seen.add(r["id"])
        if not r["type"]:
            raise _err(path, line, "type", "empty")
        speed = None
        if r.get("speed"):
            speed = _number(path, line, "speed", r["speed"], strict=True)
            if speeds.setdefault(r["type"], speed) != speed:
                raise _err(
                    path,
                    line,
                    "speed",
                    f"{speed:g} differs from type {r['type']!r}'s "
                    f"{speeds[r['type']]:g} on an earlier line",
                )
        gpus = int(_number(path, line, "gpus", r["gpus"], whole=True, low=1))
        out.append(NodeRow(r["id"], r["type"], gpus, speed))
    return out


def gavel_nodes(spec: str, per_server: str = "1:1:1") -> list[NodeRow]:
    """Gavel's cluster spec (``#v100:#p100:#k80`` GPUs, ``--num_gpus_per_server`` alike) as
    nodes."""
    types = ("v100", "p100", "k80")
    try:
        counts = [int(x) for x in spec.split(":")]
        sizes = [int(x) for x in per_server.split(":")]
    except ValueError:
        raise InputError(f"cluster spec {spec!r} / {per_server!r}: not whole numbers") from None
    if len(counts) != 3 or len(sizes) != 3 or min(counts) < 0 or min(sizes) < 1:
        raise InputError(f"cluster spec {spec!r} / {per_server!r}: not #v100:#p100:#k80")
    nodes = []
    for t, n, size in zip(types, counts, sizes, strict=True):
        for i in range(math.ceil(n / size)):
            nodes.append(NodeRow(f"{t}-{i:04d}", t, min(size, n - i * size)))
    return nodes


def fit_gavel_job(
    table: Table, job_type: str, workers: int, types: Iterable[str]
) -> tuple[dict[str, float], float]:
    """(rate of one worker per type, saturation k) so that ``n·r / (1 + k·n·r)`` (the
    dynabatch throughput model) equals Gavel's measured steps/s of ``job_type`` on
    ``workers`` GPUs of every type exactly; k is the median over the types of the fit of
    one GPU against the most GPUs Gavel measured (0 with nothing to fit). Raises
    ``KeyError`` naming what the table lacks."""
    types = list(types)
    for t in types:
        if (job_type, workers) not in table.get(t, {}):
            raise KeyError(f"no throughput for ({job_type!r}, {workers}) on {t!r}")
    usable = [t for t in types if table[t][(job_type, workers)] > 0]
    if not usable:
        raise KeyError(f"({job_type!r}, {workers}) runs on none of {', '.join(types)}")
    ks = []
    for t in usable:
        sizes = sorted(
            g for jt, g in table[t] if jt == job_type and g > 1 and table[t][(jt, g)] > 0
        )
        if sizes and table[t].get((job_type, 1), 0.0) > 0:
            g, one = sizes[-1], table[t][(job_type, 1)]
            many = table[t][(job_type, g)]
            # many = g·one / (1 + k·g·one)  ->  k = (g·one/many - 1) / (g·one)
            ks.append(max(0.0, (g * one / many - 1.0) / (g * one)))
    ks.sort()
    k = ks[len(ks) // 2] if ks else 0.0
    # Exact at `workers` on every type needs k·T_t < 1; keep a margin.
    k = min([k] + [0.9 / table[t][(job_type, workers)] for t in usable])
    rates = {t: 0.0 for t in types}
    for t in usable:
        at = table[t][(job_type, workers)]
        rates[t] = at / (workers * (1.0 - k * at))
    return rates, k


def type_speeds(table: Table, types: Iterable[str]) -> dict[str, float]:
    """Each type's throughput class: the median over the job types of its one-GPU steps/s
    over the fastest type's (a prior per node type)."""
    types = list(types)
    common = [
        jt
        for jt, g in table[types[0]]
        if g == 1 and all(table[t].get((jt, 1), 0.0) > 0 for t in types)
    ]
    ratios: dict[str, list[float]] = {t: [] for t in types}
    for jt in common:
        best = max(table[t][(jt, 1)] for t in types)
        for t in types:
            ratios[t].append(table[t][(jt, 1)] / best)
    return {t: (sorted(v)[len(v) // 2] if v else 1.0) for t, v in ratios.items()}


def node_speeds(nodes: Iterable[NodeRow]) -> Mapping[str, float]:
    """The ``speed`` column per type (types without one left out)."""
    return {n.node_type: n.speed for n in nodes if n.speed is not None}

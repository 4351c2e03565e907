"""What a simulated cluster is (:class:`ClusterSpec`), as a YAML file or a mapping gives it,
and the checks on it; what each thing costs in virtual time is
:mod:`dynabatch.scheduler.sim.cost_model`. Pure: pydantic and yaml only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from dynabatch.actors.spec.loading import format_validation_error
from dynabatch.actors.spec.sections import _Strict
from dynabatch.actors.spec.validation import CombinationError
from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

MB = 1 << 20
NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"


class ClusterError(ValueError):
    """A cluster description that cannot be used; ``str()`` is one line naming the field."""


class NodeClass(_Strict):
    """``count`` nodes with per-step cost ``a_ms`` and per-sample cost ``c_ms_per_sample``.
    ``eval_ms_per_sample``: what scoring one held-out sample costs (a forward pass; 0, the
    default: evaluation is free). ``cpus``/``gpus`` are what the nodes offer; the engine
    reads them as its first guess at a new worker's speed, as it does on Ray."""

    name: str = Field(min_length=1, max_length=64, pattern=NAME_PATTERN)
    count: StrictInt = Field(ge=0, le=1_000_000)
    a_ms: float = Field(ge=0.0, le=1e7)
    c_ms_per_sample: float = Field(gt=0.0, le=1e7)
    eval_ms_per_sample: float = Field(default=0.0, ge=0.0, le=1e7)
    cpus: float = Field(default=1.0, gt=0.0, le=4096.0)
    gpus: float = Field(default=0.0, ge=0.0, le=64.0)


class AllReduceModel(_Strict):
    """Ring all-reduce: ``2(n−1)·alpha + 2(n−1)/n · bytes · beta``."""

    alpha_ms: float = Field(default=0.005, ge=0.0, le=1e5, description="Per-hop latency.")
    beta_ms_per_mb: float = Field(default=0.1, ge=0.0, le=1e6,
                                  description="Milliseconds per MiB per link (0.1: ~10 GB/s).")
    model_mb: float = Field(default=0.0, ge=0.0, le=1e6,
                            description="Gradient bytes per step, in MiB.")


class ParameterServerModel(_Strict):
    """Push/pull costs of the parameter-server protocols. Over ``k > 1`` server actors the
    slices move in parallel, and a push has two phases (the slices to their shards, then the
    commit to the server that decides)."""

    push_ms: float = Field(default=0.0, ge=0.0, le=1e6)
    pull_ms: float = Field(default=0.0, ge=0.0, le=1e6)
    beta_ms_per_mb: float = Field(default=0.1, ge=0.0, le=1e6)

    def push_s(self, nbytes: float, shards: int = 1) -> float:
        """One gradient push of ``nbytes`` over ``shards`` server actors."""
        hops = 1 if shards <= 1 else 2
        return (hops * self.push_ms + nbytes / max(1, shards) / MB * self.beta_ms_per_mb) / 1e3

    def pull_s(self, nbytes: float, shards: int = 1) -> float:
        """One weights pull of ``nbytes`` from ``shards`` server actors (in parallel)."""
        return (self.pull_ms + nbytes / max(1, shards) / MB * self.beta_ms_per_mb) / 1e3


class RecoveryModel(_Strict):
    """Costs of membership changes (defaults: medians measured on Ray; docs/benchmarks.md,
    "Elastic recovery")."""

    detect_s: float = Field(default=0.5, ge=0.0, le=1e5)
    regroup_s: float = Field(default=0.1, ge=0.0, le=1e5)
    start_s: float = Field(default=6.5, ge=0.0, le=1e5)


class _ByClass(_Strict):
    # ``class`` is a Python keyword: the attribute ``node_class`` is accepted too.
    model_config = ConfigDict(validate_by_name=True)


class NodeSelector(_ByClass):
    """``count`` nodes of class ``class`` (any class when omitted); ``index`` picks the
    class's ``index``-th node (in creation order) instead."""

    node_class: str | None = Field(default=None, alias="class")
    count: StrictInt = Field(default=1, ge=1, le=1_000_000)
    index: StrictInt | None = Field(default=None, ge=0)


class JoinSpec(_ByClass):
    node_class: str = Field(alias="class")
    count: StrictInt = Field(default=1, ge=1, le=1_000_000)


class SlowdownSpec(_ByClass):
    """From the event on, the step time of the class's ``index``-th node (every node of the
    class when ``index`` is omitted) is multiplied by ``factor``."""

    node_class: str = Field(alias="class")
    index: StrictInt | None = Field(default=None, ge=0)
    factor: float = Field(gt=0.0, le=1e4)


class Event(_Strict):
    """Something that happens to the cluster, at ``at_s`` seconds of simulated time (0 is the
    job's launch) or when the job reaches ``epoch`` (and ``step``)."""

    at_s: float | None = Field(default=None, ge=0.0)
    epoch: StrictInt | None = Field(default=None, ge=0)
    step: StrictInt = Field(default=0, ge=0)
    fail: StrictInt | NodeSelector | None = Field(default=None)
    join: JoinSpec | None = None
    slowdown: SlowdownSpec | None = None

    @field_validator("fail", mode="before")
    @classmethod
    def _fail_shape(cls, v: Any) -> Any:
        # One message instead of one per member of the int | NodeSelector union.
        if v is None or isinstance(v, dict) or (isinstance(v, int) and not isinstance(v, bool)):
            return v
        raise ValueError("must be a number of nodes or {class, count, index}")

    @model_validator(mode="after")
    def _one_of(self) -> Event:
        kinds = [k for k in ("fail", "join", "slowdown") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("give exactly one of fail, join, slowdown")
        if (self.at_s is None) == (self.epoch is None):
            raise ValueError("give exactly one of at_s, epoch")
        if isinstance(self.fail, int) and self.fail < 1:
            raise CombinationError([("fail", "must be at least 1 node")])
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("fail", "join", "slowdown") if getattr(self, k) is not None)

    @property
    def selector(self) -> NodeSelector | None:
        if self.fail is None:
            return None
        return NodeSelector(count=self.fail) if isinstance(self.fail, int) else self.fail


STEP_FAULTS = ("die", "hang", "error", "straggle", "oom", "lose_result")
CALL_FAULTS = ("die_in_regroup", "die_in_evaluation", "die_in_checkpoint")
NODE_FAULTS = ("spare_dies", "spare_dies_silently")
FaultKind = Literal["die", "hang", "error", "straggle", "oom", "lose_result", "die_in_regroup",
                    "die_in_evaluation", "die_in_checkpoint", "eval_error", "spare_dies",
                    "spare_dies_silently"]


class Fault(_Strict):
    """Something that goes wrong with one of the job's workers (``worker``: its ordinal) or
    with the spare on one node (``node``: a class and an index), as the simulator's runtime
    plays it (:mod:`dynabatch.scheduler.sim.faults`); the kinds and their fields are
    docs/simulator.md's table."""

    kind: FaultKind
    worker: StrictInt | None = Field(default=None, ge=0)
    node: NodeSelector | None = None
    epoch: StrictInt | None = Field(default=None, ge=0)
    step: StrictInt = Field(default=0, ge=0)
    nth: StrictInt = Field(default=1, ge=1, le=1_000_000)
    seconds: float | None = Field(default=None, gt=0.0, le=1e6)
    batch: StrictInt | None = Field(default=None, ge=0)
    error: str | None = Field(default=None, min_length=1, max_length=500)
    uneven: StrictBool = False

    @model_validator(mode="after")
    def _fields_of_kind(self) -> Fault:
        k, given = self.kind, self.model_fields_set
        on_node = k in NODE_FAULTS
        need = {"node" if on_node else "worker"}
        if k in STEP_FAULTS:
            need.add("epoch")
        need |= {"straggle": {"seconds"}, "oom": {"batch"}}.get(k, set())
        allowed = need | {"kind"} | ({"step"} if k in STEP_FAULTS else set())
        allowed |= {"nth"} if k in CALL_FAULTS or on_node else set()
        allowed |= {"error"} if k == "eval_error" else set()
        allowed |= {"uneven"} if k in ("die", "hang") else set()
        for name in self.__class__.model_fields:
            if name in need and getattr(self, name) is None:
                raise CombinationError([(name, f"required for kind {k}")])
        for name in self.__class__.model_fields:
            if name in given and name not in allowed:
                raise CombinationError([(name, f"does not apply to kind {k}")])
        if on_node and (self.node.node_class is None or self.node.index is None
                        or self.node.count != 1):
            raise CombinationError([("node", "give {class, index} (one node)")])
        return self


class ClusterSpec(_Strict):
    """A simulated cluster: node classes with counts, noise, communication and events."""

    classes: Annotated[list[NodeClass], Field(min_length=1)]
    noise_sigma: float = Field(default=0.0, ge=0.0, le=2.0)
    node_sigma: float = Field(default=0.0, ge=0.0, le=2.0)
    seed: StrictInt = Field(default=0, ge=0, le=2**31 - 1)
    allreduce: AllReduceModel = Field(default_factory=AllReduceModel)
    parameter_server: ParameterServerModel = Field(default_factory=ParameterServerModel)
    recovery: RecoveryModel = Field(default_factory=RecoveryModel)
    events: list[Event] = Field(default_factory=list)
    faults: list[Fault] = Field(default_factory=list)

    @model_validator(mode="after")
    def _references(self) -> ClusterSpec:
        names = [c.name for c in self.classes]
        seen: set[str] = set()
        for i, n in enumerate(names):
            if n in seen:
                raise CombinationError([(f"classes.{i}.name", f"duplicate node class {n!r}")])
            seen.add(n)
        if self.nodes < 1:
            raise CombinationError([("classes", "no nodes (every count is 0)")])
        for i, e in enumerate(self.events):
            target = e.fail if isinstance(e.fail, NodeSelector) else e.join or e.slowdown
            if getattr(target, "node_class", None) is not None and (
                    err := self.node_error(target)):
                raise CombinationError([(f"events.{i}.{e.kind}.{err[0]}", err[1])])
            if isinstance(e.fail, NodeSelector) and e.fail.index is not None and e.fail.count != 1:
                raise CombinationError([(f"events.{i}.fail.count", "give count 1 with index")])
        for i, f in enumerate(self.faults):
            if f.node is not None and (err := self.node_error(f.node)):
                raise CombinationError([(f"faults.{i}.node.{err[0]}", err[1])])
        return self

    def node_error(self, sel: NodeSelector | JoinSpec | SlowdownSpec) -> tuple[str, str] | None:
        """Why ``sel`` (a class and an index) names no node of this cluster at its start,
        (field, problem); None when it does (an index past the class's nodes does when
        nodes of the class join)."""
        counts = {c.name: c.count for c in self.classes}
        if sel.node_class not in counts:
            return "class", f"unknown node class {sel.node_class!r} (classes: {', '.join(counts)})"
        n = counts[sel.node_class]
        joins = any(e.join is not None and e.join.node_class == sel.node_class
                    for e in self.events)
        index = getattr(sel, "index", None)  # a join names no index
        if index is not None and index >= n and not joins:
            return "index", f"class {sel.node_class!r} has {n} nodes (indices 0..{n - 1})"
        return None

    @property
    def nodes(self) -> int:
        return sum(c.count for c in self.classes)


def parse_cluster(data: Any) -> ClusterSpec:
    if not isinstance(data, dict):
        raise ClusterError(f"cluster: expected a mapping of fields, got {type(data).__name__}")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as err:
        # One line: ``field: problem; field: problem``, as a job spec's errors read.
        raise ClusterError(" ".join("; ".join(format_validation_error(err)).split())) from None


def load_cluster(path: str | Path) -> ClusterSpec:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ClusterError(f"{p}: cannot read cluster ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ClusterError(" ".join(f"{p}: not valid YAML ({err})".split())) from None
    return parse_cluster(data)


def check_job(cluster: ClusterSpec, global_batch: int, workers: int | None) -> None:
    """The job's workers must each get a sample per step (``workers``: None = one per node)."""
    n = cluster.nodes if workers is None else min(workers, cluster.nodes)
    if n > global_batch:
        what = "nodes (workers: auto)" if workers is None else "workers"
        raise ClusterError(
            f"classes: {n} {what} is more than global_batch ({global_batch}): every worker "
            "needs at least one sample per step")

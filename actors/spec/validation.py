"""Rules across a job spec's fields: combinations that cannot run, and values that are
accepted but have no effect.

:func:`check_combinations` runs as the last step of ``JobSpec`` validation. It collects every
invalid combination as a ``(field path, problem)`` pair and raises them together as one
:class:`CombinationError` (a ``ValueError``), which
:func:`dynabatch.actors.spec.loading.format_validation_error` expands to one ``field:
problem`` line each; a value that is accepted but ignored produces a ``SpecWarning``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dynabatch.actors.spec.sections import (
    DEFAULT_METRICS,
    BatchScheduleSpec,
    LrScheduleSpec,
    ProtocolSpec,
    RebalanceSpec,
    hf_option_problems,
    warn_spec,
)

if TYPE_CHECKING:
    from dynabatch.actors.spec.schema import JobSpec

Bad = Callable[[str, str], None]  # records (field path, problem)

PS_ONLY_FIELDS = ("mode", "n", "lr_staleness", "max_staleness", "on_stale", "batch",
                  "replan_pushes", "scale_lr", "shards")
# Built-ins whose targets are not class labels (the ps learners train cross-entropy on labels).
PS_NOT_CLASSES = {"dataset.name": ("pysource",), "model.name": ("charlm",)}


class CombinationError(ValueError):
    """Invalid combinations of fields, each as (dotted field path, problem)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{loc}: {msg}" for loc, msg in problems))


def check_combinations(spec: JobSpec) -> None:
    """Raise :class:`CombinationError` with every invalid combination in ``spec``; warn
    about values it accepts but ignores."""
    problems: list[tuple[str, str]] = []

    def bad(field: str, problem: str) -> None:
        problems.append((field, problem))

    n = spec.workers if isinstance(spec.workers, int) else None
    lo, hi = spec.min_workers, spec.max_workers
    if lo is not None and hi is not None and lo > hi:
        bad("min_workers", f"min_workers ({lo}) is greater than max_workers ({hi})")
    if n is not None and lo is not None and n < lo:
        bad("workers", f"workers ({n}) is below min_workers ({lo})")
    if n is not None and hi is not None and n > hi:
        bad("workers", f"workers ({n}) is above max_workers ({hi})")
    if n is not None and n > spec.global_batch:
        bad(
            "global_batch",
            f"global_batch ({spec.global_batch}) is smaller than workers ({n}): "
            "every worker needs at least one sample per step",
        )
    if spec.max_batch is not None and n is not None and spec.max_batch * n < spec.global_batch:
        bad(
            "max_batch",
            f"max_batch ({spec.max_batch}) x workers ({n}) cannot hold global_batch "
            f"({spec.global_batch})",
        )
    _schedule_problems(spec, bad, n)
    slow = spec.emulation.slowdowns
    # Workers that join later take the ordinals after the first n, up to max_workers.
    most = max(n, hi or n) if n is not None else None
    if slow and n is not None and len(slow) < n:
        bad(
            "emulation.slowdowns",
            f"emulation.slowdowns has {len(slow)} entries but workers is {n}",
        )
    for i, d in enumerate(spec.emulation.disturbances):
        if most is not None and d.worker >= most:
            bad(
                f"emulation.disturbances.{i}.worker",
                f"worker {d.worker} does not exist: at most {most} workers "
                f"(ordinals 0..{most - 1})",
            )
    _ps_problems(spec, bad)
    _model_problems(spec, bad)
    _best_problems(spec, bad)
    if spec.device == "cuda" and spec.worker_gpus == 0:
        bad("worker_gpus", "device 'cuda' needs worker_gpus > 0 or 'auto'")
    if spec.device == "cpu" and spec.worker_gpus == "auto":
        bad("worker_gpus", "worker_gpus 'auto' places workers on GPUs; device is 'cpu'")
    if spec.worker_gpus != "auto" and spec.worker_gpus > 1:
        bad("worker_gpus", f"worker_gpus {spec.worker_gpus:g} is more than one GPU: a worker "
            "drives one device; for more GPUs use more workers (worker_gpus: 1)")
    if spec.precision == "fp16" and spec.isgd.enabled:
        bad("precision", "precision fp16 cannot be combined with isgd.enabled: ISGD's extra "
            "passes are not loss-scaled (use bf16)")
    if problems:
        raise CombinationError(problems)
    _ps_warnings(spec)
    if slow and most is not None and len(slow) > most:
        # Not "ignored": a scale request is an explicit size and may go past max_workers
        # (Membership.request_scale), and the workers it adds take these entries.
        bound = "max_workers" if spec.max_workers else "workers"
        warn_spec(
            f"emulation.slowdowns has {len(slow)} entries; entries past {most} apply only "
            f"to workers that a scale request adds beyond {bound} ({most})", stacklevel=3)
    rb = spec.rebalance
    # Against the default, as the other warnings: a stored spec read back has every field set.
    if rb.threshold != type(rb).model_fields["threshold"].default and (
            spec.protocol.name == "sync") and rb.min_gain(spec.policy) is None:
        why = (f"rebalance mode {rb.mode} re-plans at fixed points"
               if rb.mode != "adaptive" else "policy static never re-sizes")
        warn_spec(f"rebalance.threshold is ignored: {why} (it applies to "
                  "rebalance: adaptive with dbs or affine)", stacklevel=3)
    if spec.precision != "fp32" and spec.protocol.name != "sync":
        warn_spec(f"precision {spec.precision} is ignored by protocol "
                  f"{spec.protocol.name} (it applies to the sync protocol's workers)",
                  stacklevel=3)
    elif spec.precision == "tf32" and (spec.device == "cpu" or spec.worker_gpus == 0):
        warn_spec("precision tf32 is ignored on the CPU (TF32 is a CUDA matmul mode): "
                  "the job trains in fp32", stacklevel=3)
    speed = [f for f, on in (("channels_last", spec.channels_last),
                             ("compile", spec.compile is not None)) if on]
    if speed and spec.protocol.name != "sync":
        warn_spec(f"{' and '.join(speed)} ignored by protocol {spec.protocol.name} (it "
                  "applies to the sync protocol's workers)", stacklevel=3)
    for d in spec.emulation.disturbances:
        if d.epoch >= spec.epochs:
            warn_spec(
                f"emulation disturbance at epoch {d.epoch} is ignored: the job has "
                f"{spec.epochs} epochs", stacklevel=3)


def _schedule_problems(spec: JobSpec, bad: Bad, n: int | None) -> None:
    sched = spec.schedule
    if sched.mode == "stages":
        total = sum(st.epochs for st in sched.stages)
        if total != spec.epochs:
            bad("schedule.stages", f"the stages' epochs add up to {total}, not to epochs "
                                   f"({spec.epochs})")
        if sched.stages[0].global_batch != spec.global_batch:
            bad("global_batch", f"global_batch ({spec.global_batch}) must be the first "
                                f"stage's ({sched.stages[0].global_batch}) or left out")
        for i, st in enumerate(sched.stages):
            where = f"schedule.stages.{i}.global_batch"
            if n is not None and st.global_batch < n:
                bad(where, f"global_batch ({st.global_batch}) is smaller than workers "
                           f"({n}): every worker needs at least one sample per step")
            if spec.max_batch is not None and n is not None and (
                    spec.max_batch * n < st.global_batch):
                bad(where, _share_cap_problem(spec.max_batch, n, st.global_batch,
                                              spec.micro_batch))
    if sched.mode == "goodput":
        top = sched.max_global_batch
        if top is None:
            bad("schedule.max_global_batch", "mode goodput needs max_global_batch")
        elif top < spec.global_batch:
            bad("schedule.max_global_batch", f"max_global_batch ({top}) is below "
                                             f"global_batch ({spec.global_batch})")
        elif spec.max_batch is not None and n is not None and spec.max_batch * n < top:
            bad("schedule.max_global_batch",
                _share_cap_problem(spec.max_batch, n, top, spec.micro_batch))
        low = sched.min_global_batch
        if low is not None and top is not None and low > top:
            bad("schedule.min_global_batch", f"min_global_batch ({low}) is above "
                                             f"max_global_batch ({top})")
        elif low is not None and n is not None and low < n:
            bad("schedule.min_global_batch", f"min_global_batch ({low}) is smaller than "
                                             f"workers ({n}): every worker needs at "
                                             "least one sample per step")
    sched = spec.optimizer.lr_scheduler
    if sched is not None and sched.interval == "step" and spec.schedule.mode != "fixed":
        bad("optimizer.lr_scheduler.interval", "step counts optimizer steps over the job: it "
            f"needs a fixed global batch (schedule.mode is {spec.schedule.mode})")
    if spec.optimizer.lr_scheduler is not None and spec.optimizer.schedule != LrScheduleSpec():
        bad("optimizer.lr_scheduler", "optimizer.lr_scheduler and optimizer.schedule both set "
            "the learning rate over the job: use one of them")
    ms = spec.optimizer.schedule.milestones
    if ms and ms[-1] >= spec.epochs:
        bad("optimizer.schedule.milestones", f"milestone {ms[-1]} is not before the last "
                                             f"epoch ({spec.epochs})")


def computed_metrics(spec: JobSpec) -> tuple[str, ...]:
    """The held-out values a job reports by name: ``loss`` and its metrics (those it names,
    or its loss's defaults; with the loss chosen from the data, any built-in loss's)."""
    if spec.metrics is not None:
        # A confusion matrix is a table, not a number an epoch can be judged by.
        names = [m.name for m in spec.metrics if m.fn != "confusion_matrix"]
    elif spec.loss in DEFAULT_METRICS:
        names = list(DEFAULT_METRICS[spec.loss])
    else:  # the loss (or a user loss's metrics) follows the dataset's targets
        names = [n for ms in DEFAULT_METRICS.values() for n in ms]
    return tuple(dict.fromkeys(["loss", *names]))


def _best_problems(spec: JobSpec, bad: Bad) -> None:
    """early_stopping and checkpoint.keep_best judge a metric the job computes."""
    judged = [("early_stopping", spec.early_stopping),
              ("checkpoint.keep_best", spec.checkpoint.keep_best)]
    known = computed_metrics(spec)
    for field, section in judged:
        if section is None:
            continue
        if spec.protocol.name == "ps":
            bad(field, "runs with the synchronous protocol only")
        elif section.metric not in known:
            bad(f"{field}.metric", f"{section.metric!r} is not a metric this job computes: "
                f"use one of {', '.join(known)}")
    if spec.checkpoint.keep_best is not None and not spec.checkpoint.dir:
        bad("checkpoint.keep_best", "needs checkpoint.dir (where best.pt is kept)")


def batch_fits_data(spec: JobSpec, n_train: int) -> tuple[str, str] | None:
    """The first global batch the job would train that is larger than its training set, as
    ``(field, problem)``, or None. One step can use each sample at most once, so such a
    batch cannot be split into steps; the set's size is known only once the data is loaded,
    so this runs then, not with the other combinations."""
    sched = spec.schedule
    sizes = [("global_batch", spec.global_batch)]
    if sched.mode == "stages":
        sizes += [(f"schedule.stages.{i}.global_batch", st.global_batch)
                  for i, st in enumerate(sched.stages)]
    if sched.mode == "goodput" and sched.max_global_batch is not None:
        sizes.append(("schedule.max_global_batch", sched.max_global_batch))
    for where, batch in sizes:
        if batch > n_train:
            name = where.rsplit(".", 1)[-1]
            return where, (f"{name} {batch} is larger than the training set "
                           f"({n_train} samples)")
    return None


def _share_cap_problem(max_batch: int, workers: int, batch: int,
                       micro_batch: int | list[int] | None) -> str:
    """Why a global batch does not fit the workers' share cap. ``max_batch`` caps what a
    worker trains per step, whatever its memory; ``micro_batch`` caps its memory only (a
    larger share is accumulated), so it never makes room above ``max_batch``."""
    need = -(-batch // workers)
    fix = (f"raise max_batch to at least {need}, or leave it out: micro_batch "
           f"({micro_batch}) already bounds each worker's memory" if micro_batch is not None
           else f"raise max_batch to at least {need}, or leave it out and bound memory "
           "with micro_batch (larger shares accumulate)")
    return (f"global batch {batch} does not fit max_batch ({max_batch}) x workers "
            f"({workers}): max_batch caps every worker's share; {fix}")


def _ps_problems(spec: JobSpec, bad: Bad) -> None:
    """Options the parameter server cannot honour, and ps options on a sync job. Only values
    that differ from the defaults count, so a dumped spec validates again."""
    p = spec.protocol
    default = ProtocolSpec()
    if p.name != "ps":
        for f in PS_ONLY_FIELDS:
            if getattr(p, f) != getattr(default, f):
                bad(f"protocol.{f}", "applies only to protocol ps")
        return
    n = spec.initial_workers
    if n is None:
        bad("workers", "protocol ps needs a number of learners, not 'auto'")
    elif p.mode == "softsync" and p.n > n:
        bad("protocol.n", f"n ({p.n}) is greater than the number of learners (workers = {n})")
    if p.mode != "softsync" and p.n != default.n:
        bad("protocol.n", f"applies only to mode softsync, not {p.mode}")
    # The default is accepted (a stored spec round-trips with every field set).
    if spec.policy != type(spec).model_fields["policy"].default:
        bad("policy", "protocol ps sizes batches with protocol.batch, not a policy")
    if spec.rebalance != RebalanceSpec():
        bad("rebalance", "protocol ps re-plans with protocol.replan_pushes")
    if spec.checkpoint.dir:
        bad("checkpoint.dir", "protocol ps does not write checkpoints")
    if spec.checkpoint.from_:
        bad("checkpoint.from", "protocol ps does not start from checkpoints")
    if spec.worker_gpus != 0 or spec.device == "cuda":
        bad("worker_gpus", "protocol ps learners run on the CPU")
    if spec.max_batch is not None:
        bad("max_batch", "protocol ps bounds batches itself (perf_aware: 4·b0)")
    # The learners and the server compute cross-entropy and accuracy only.
    if spec.loss not in (None, "cross_entropy"):
        bad("loss", "protocol ps trains with cross_entropy only")
    if spec.metrics is not None and [(m.fn, m.name) for m in spec.metrics] != [
            ("accuracy", "accuracy")]:
        bad("metrics", "protocol ps reports accuracy only")
    # The server applies the base rate alpha0 (scaled by the staleness rule) at a fixed
    # per-learner batch; the synchronous engine's schedules and ISGD are not applied there.
    if spec.schedule != BatchScheduleSpec():
        bad("schedule", "protocol ps keeps each learner's batch (protocol.batch), not a "
            "global batch schedule")
    if spec.isgd.enabled:
        bad("isgd.enabled", "ISGD runs with the synchronous protocol only")
    if spec.dataset.shuffle != "every_epoch":
        bad("dataset.shuffle", "protocol ps learners draw a new order every epoch")
    if spec.optimizer.schedule != LrScheduleSpec():
        bad("optimizer.schedule", "protocol ps uses the staleness rule "
            "(protocol.lr_staleness), not a learning-rate schedule")
    if spec.optimizer.lr_scheduler is not None:
        bad("optimizer.lr_scheduler", "protocol ps uses the staleness rule "
            "(protocol.lr_staleness), not a learning-rate scheduler")
    if spec.optimizer.clip_grad_norm is not None:
        bad("optimizer.clip_grad_norm", "clips the all-reduced gradient of the synchronous "
            "protocol; protocol ps has none (each learner pushes its own)")
    if p.batch != "perf_aware" and (p.replan_pushes != default.replan_pushes
                                    or p.scale_lr != default.scale_lr):
        bad("protocol.batch", "replan_pushes and scale_lr need batch perf_aware")
    if p.on_stale == "wait" and p.max_staleness is None:
        bad("protocol.on_stale", "wait needs max_staleness (the bound to wait for)")
    for field, names in PS_NOT_CLASSES.items():
        name = spec.dataset.name if field == "dataset.name" else spec.model.name
        if name in names:
            bad(field, f"protocol ps trains classification (class labels) only; {name!r} "
                "has token targets")


def _model_problems(spec: JobSpec, bad: Bad) -> None:
    """``model.name: hf``'s options (a hub id among them) and the outputs adapter, which
    the ps learners, scoring raw outputs with cross-entropy, do not apply."""
    if spec.model.name == "hf":
        for field, problem in hf_option_problems(spec.model.options):
            bad(field, problem)
    if spec.protocol.name == "ps":
        if spec.model.name == "hf":
            bad("model.name", "protocol ps trains models that return a tensor of logits; "
                "hf needs protocol sync")
        if spec.model.output is not None:
            bad("model.output", "protocol ps scores the model's own output; model.output "
                "needs protocol sync")


def _ps_warnings(spec: JobSpec) -> None:
    """Accepted ps settings that have no effect (the API returns them as warnings)."""
    p = spec.protocol
    if p.name == "ps" and p.mode == "hardsync":
        for f in ("max_staleness", "lr_staleness", "on_stale"):
            if getattr(p, f) != getattr(ProtocolSpec(), f):
                warn_spec(f"protocol.{f} is ignored by mode hardsync (staleness is always "
                          "0)", stacklevel=4)


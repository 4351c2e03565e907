"""The worker's optimizer and what it does with a step plan's learning rate and ISGD rule.

Workers never compute schedules: the coordinator's pure schedule
(:mod:`dynabatch.scheduler.core.regime.schedule`) puts each step's learning rate in its
:class:`~dynabatch.actors.contracts.StepPlan`, and a segment's plan carries ISGD's control
chart (:class:`~dynabatch.actors.contracts.IsgdPlan`). ISGD's conservative sub-problem and
the order of a flagged step's passes (:func:`isgd_extras`): docs/schedules.md ("ISGD").
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from dynabatch.actors.contracts import IsgdRule
from dynabatch.actors.errors import first_line
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.spec.sections import (
    IMPORT_PATH_PATTERN,
    LrSchedulerSpec,
    OptimizerSpec,
)
from dynabatch.actors.workloads import WorkloadError
from dynabatch.actors.workloads.imports import call_user, resolve_callable

# The spec's own fields, passed to a torch.optim class when they differ from their defaults.
_COMMON = (("momentum", 0.0), ("nesterov", False), ("weight_decay", 0.0))
# Optimizers a distributed step cannot drive: LBFGS's step re-evaluates the loss through a
# closure, which would be a collective of its own on every call.
_REFUSED_OPTIMIZERS = {"LBFGS": "its step needs a closure that re-evaluates the loss"}
# Schedulers whose sequence cannot be computed ahead from the spec.
_REFUSED_SCHEDULERS = {
    "ReduceLROnPlateau": "it follows a metric, so its rates are not known ahead; use "
    "early_stopping or a scheduler by epoch",
    "LambdaLR": "its options are Python functions",
    "MultiplicativeLR": "its options are Python functions",
    "SequentialLR": "it takes scheduler objects",
    "ChainedScheduler": "it takes scheduler objects",
}


def _torch_class(
    module: Any, base: type, name: str, field: str, refused: dict[str, str], what: str
) -> type:
    """The subclass of ``base`` called ``name`` in ``module``, or a WorkloadError naming
    ``field`` (and, for a name it does not have, the ones it has)."""
    found = getattr(module, name, None)
    if not (isinstance(found, type) and issubclass(found, base)) or found is base:
        have = sorted(
            k
            for k, v in vars(module).items()
            if isinstance(v, type)
            and issubclass(v, base)
            and v is not base
            and not k.startswith("_")
            and k not in refused
        )
        raise WorkloadError(
            f"{field}: {module.__name__} has no {what} {name!r} (it has: {', '.join(have)})"
        )
    if name in refused:
        raise WorkloadError(f"{field}: {name} cannot be used here: {refused[name]}")
    return found


def _parameters(cls: type) -> list[str]:
    """The keyword parameters of ``cls``'s constructor after its first (params, optimizer)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _torch_kwargs(o: OptimizerSpec) -> tuple[type, dict[str, Any]]:
    """A torch.optim class named by ``o.name`` and its keyword arguments: ``lr``, the
    spec's momentum, nesterov and weight_decay where set, and ``o.options`` (each checked
    against the constructor, naming the field it came from)."""
    cls = _torch_class(
        torch.optim,
        torch.optim.Optimizer,
        o.name,
        "optimizer.name",
        _REFUSED_OPTIMIZERS,
        "optimizer",
    )
    takes = _parameters(cls)
    kwargs: dict[str, Any] = {"lr": o.lr}
    for field, default in _COMMON:
        value = getattr(o, field)
        if value != default:
            if field not in takes:
                raise WorkloadError(f"optimizer.{field}: {o.name} takes no {field}")
            kwargs[field] = value
    for key, value in o.options.items():
        if key == "lr" or key in dict(_COMMON):
            raise WorkloadError(f"optimizer.options.{key}: set optimizer.{key} instead")
        if key not in takes:
            raise WorkloadError(
                f"optimizer.options.{key}: {o.name} has no option {key!r} "
                f"(it takes: {', '.join(takes)})"
            )
        kwargs[key] = value
    return cls, kwargs


def build_optimizer(spec: JobSpec, params) -> torch.optim.Optimizer:
    """The spec's optimizer over ``params``: a built-in, a torch.optim class by name, or the
    user's ``make(params, **options)``. A problem is a WorkloadError naming the field."""
    o = spec.optimizer
    if o.name == "adam":
        return torch.optim.Adam(params, lr=o.lr, weight_decay=o.weight_decay)
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
    if o.name == "sgd":
        return torch.optim.SGD(
            params, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay
        )
    if re.match(IMPORT_PATH_PATTERN, o.name):
        made = call_user(
            partial(resolve_callable(o.name, "optimizer.name"), params),
            o.name,
            "optimizer.name",
            **o.options,
        )
        if not isinstance(made, torch.optim.Optimizer):
            raise WorkloadError(
                f"optimizer.name: {o.name!r} returned a "
                f"{type(made).__name__}, not a torch.optim.Optimizer"
            )
        return made
    cls, kwargs = _torch_kwargs(o)
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as err:  # a value the constructor refuses
        raise WorkloadError(
            f"optimizer.options: {o.name} refused them: {first_line(err)}"
        ) from None


def _lr_scheduler(sched: LrSchedulerSpec, base_lr: float
                  ) -> tuple[torch.optim.Optimizer, Any]:
    """``sched`` built on an SGD over one dummy parameter at ``base_lr``: a
    torch.optim.lr_scheduler class by name with its ``options``, or the user's
    ``make(optimizer, **options)`` by import path (Hugging Face's
    ``get_linear_schedule_with_warmup``, say). A problem is a WorkloadError naming the field."""
    dummy = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([dummy], lr=base_lr)
    if re.match(IMPORT_PATH_PATTERN, sched.name):
        field = "optimizer.lr_scheduler.name"
        made = call_user(partial(resolve_callable(sched.name, field), opt), sched.name, field,
                         **sched.options)
        if not isinstance(made, torch.optim.lr_scheduler.LRScheduler):
            raise WorkloadError(f"{field}: {sched.name!r} returned a {type(made).__name__}, "
                                "not a torch.optim.lr_scheduler.LRScheduler")
        return opt, made
    cls = _torch_class(
        torch.optim.lr_scheduler,
        torch.optim.lr_scheduler.LRScheduler,
        sched.name,
        "optimizer.lr_scheduler.name",
        _REFUSED_SCHEDULERS,
        "scheduler",
    )
    takes = _parameters(cls)
    for key in sched.options:
        if key not in takes:
            raise WorkloadError(
                f"optimizer.lr_scheduler.options.{key}: {sched.name} has no "
                f"option {key!r} (it takes: {', '.join(takes)})"
            )
    needed = [p.name for p in inspect.signature(cls).parameters.values()
              if p.default is inspect.Parameter.empty and p.name != "optimizer"
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [k for k in needed if k not in sched.options]
    if missing:
        raise WorkloadError(
            f"optimizer.lr_scheduler.options: {sched.name} needs {', '.join(missing)} "
            "(no default)")
    try:
        return opt, cls(opt, **sched.options)
    except (TypeError, ValueError, KeyError) as err:
        raise WorkloadError(
            f"optimizer.lr_scheduler.options: {sched.name} refused them: {first_line(err)}"
        ) from None


class LrSteps:
    """The learning rate after each of the scheduler's ``step()`` calls, as a factor of
    ``base_lr``, computed on demand and kept: ``factor(k)`` is the rate after ``k`` steps.

    The scheduler runs on a dummy parameter (:func:`_lr_scheduler`), so the sequence is a
    pure function of ``k``: the driver stamps step ``k`` of the job with ``factor(k)``, and
    the same step after a lost node, a retry or a resume from a checkpoint (which keeps the
    epoch and step, the scheduler's position) trains at the same rate."""

    def __init__(self, sched: LrSchedulerSpec, base_lr: float, unit: str = "step"):
        self.name, self.base_lr, self.unit = sched.name, base_lr, unit
        self._opt, self._scheduler = _lr_scheduler(sched, base_lr)
        self._factors = [self._opt.param_groups[0]["lr"] / base_lr]

    def factor(self, k: int) -> float:
        k = max(k, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on call order; nothing is trained
            while len(self._factors) <= k:
                self._opt.step()  # no gradient: changes nothing, keeps torch's call order
                try:
                    self._scheduler.step()
                except (ValueError, ZeroDivisionError) as err:  # OneCycleLR past total_steps
                    raise WorkloadError(
                        f"optimizer.lr_scheduler.options: {self.name} cannot step "
                        f"{len(self._factors)} {self.unit}s: {first_line(err)}"
                    ) from None
                self._factors.append(self._opt.param_groups[0]["lr"] / self.base_lr)
        return self._factors[k]

    __call__ = factor


def lr_schedule(spec: JobSpec) -> tuple[float, ...] | LrSteps:
    """The spec's ``optimizer.lr_scheduler`` as the driver's schedule takes it: a factor per
    epoch (``interval: epoch``, empty without one: epoch ``e`` trains at the rate after
    ``e`` steps), or the factor after each committed optimizer step (``interval: step``).
    A problem is a WorkloadError naming the field."""
    sched = spec.optimizer.lr_scheduler
    if sched is None:
        return ()
    if sched.interval == "step":
        steps = LrSteps(sched, spec.optimizer.lr)
        steps.factor(1)  # one step now: a schedule that cannot step fails the job at once
        return steps
    steps = LrSteps(sched, spec.optimizer.lr, "epoch")
    # No step after the last epoch (OneCycleLR's total_steps may be epochs).
    return tuple(steps.factor(e) for e in range(spec.epochs))


def check_optimizer(spec: JobSpec) -> None:
    """Check the optimizer and LR scheduler a spec names (torch classes, their options and
    values) without training: built on one dummy parameter. User code is not imported (the
    service never runs it). Raises a WorkloadError naming the field."""
    o = spec.optimizer
    if o.name not in ("sgd", "adam", "adamw") and not re.match(IMPORT_PATH_PATTERN, o.name):
        build_optimizer(spec, [torch.nn.Parameter(torch.zeros(1))])
    if o.lr_scheduler is not None and not re.match(IMPORT_PATH_PATTERN, o.lr_scheduler.name):
        lr_schedule(spec)


def set_lr(optimizer: torch.optim.Optimizer, lr: float | None) -> None:
    """Use the plan's learning rate for the next step (None: leave it as it is)."""
    if lr is None:
        return
    for group in optimizer.param_groups:
        group["lr"] = lr


def isgd_extras(
    rule: IsgdRule,
    psi: float,
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    global_loss_and_grad: Callable[[], float],
    on_update: Callable[[int], None] | None = None,
) -> int:
    """Run the conservative sub-problem's extra iterations on a batch whose loss is ``psi``
    and whose global mean gradient is in every ``p.grad``; returns how many ran.

    ``global_loss_and_grad()`` fills every ``p.grad`` with the global batch's mean gradient
    at the current weights and returns its mean loss ψ (the caller does the all-reduce).
    On return ``p.grad`` holds the gradient of the last pass, for the batch's ordinary step.
    ``on_update(k)`` is told after the k-th conservative update (a caller whose pass then
    fails still knows how many updates it applied).
    """
    w_prev = [p.detach().clone() for p in params]
    n_w = sum(p.numel() for p in params)
    done = 0
    while rule.more(psi, done):
        with torch.no_grad():
            for p, p0 in zip(params, w_prev, strict=True):
                p.grad.mul_(psi - rule.limit).add_(p - p0, alpha=rule.epsilon / n_w)
        optimizer.step()
        done += 1
        if on_update is not None:
            on_update(done)
        psi = global_loss_and_grad()
    return done

"""ISGD on the coordinator's side (Wang et al., arXiv 1603.05544). Pure.

The control chart (:class:`~dynabatch.actors.contracts.ControlChart`) lives in
``dynabatch.actors.contracts`` because workers run it too: every worker sees the same
all-reduced loss of every step, so each keeps the chart up to date itself within a segment
(no round trip per step). The coordinator replays its own copy from the workers' reports
(:func:`judge`); a report that breaks the chart is a bug in a driver, and the job fails with it
rather than count what did not happen.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynabatch.actors.contracts import ControlChart, IsgdPlan, IsgdRule, StepTelemetry

__all__ = ["ControlChart", "IsgdPlan", "IsgdReportError", "judge", "plan_for"]


class IsgdReportError(ValueError):
    """Workers' ISGD reports that do not follow the replayed chart (one line)."""


def plan_for(chart: ControlChart, epoch: int, epsilon: float, max_extra: int) -> IsgdPlan:
    """The segment's ISGD plan: monitoring starts after the first epoch."""
    return IsgdPlan(chart, epsilon, max_extra, monitor=epoch >= 1)


def judge(rule: IsgdRule | None, reports: Sequence[StepTelemetry]) -> tuple[float, bool, int]:
    """(ψ, flagged, extra iterations) of one committed step, checked against ``rule``, the
    replayed chart's rule for it (None: not monitored). ψ is the loss the workers judged;
    a report without one (a driver that does not chart) counts the summed losses."""
    first = reports[0]
    where = f"epoch {first.epoch} step {first.step}"
    losses = {r.isgd_loss for r in reports}
    if len(losses) > 1:
        raise IsgdReportError(f"ISGD at {where}: workers charted different losses {losses}")
    psi = losses.pop()
    if psi is None:
        psi = sum(r.loss_sum for r in reports) / max(first.step_size, 1)
    flags = {r.flagged for r in reports}
    if len(flags) > 1:
        raise IsgdReportError(f"ISGD at {where}: workers disagree on the flag")
    flagged = flags.pop()
    want = rule is not None and rule.flagged(psi)
    if flagged != want:
        limit = None if rule is None else rule.limit
        raise IsgdReportError(f"ISGD at {where}: loss {psi!r} against limit {limit!r} is "
                              f"{'' if want else 'not '}flagged, but the workers report "
                              f"flagged={flagged}")
    top = rule.max_extra if rule is not None and flagged else 0
    low = 1 if top else 0
    for r in reports:
        if not low <= r.extra_iters <= top:
            raise IsgdReportError(f"ISGD at {where}: {r.worker} reports {r.extra_iters} "
                                  f"extra iterations on a {'flagged' if flagged else 'normal'}"
                                  f" batch (from {low} to {top})")
    # Workers stop together (they judge the same all-reduced losses); a failure inside the
    # extra iterations can leave them one apart, and the step cost the most any of them ran.
    return psi, flagged, max(r.extra_iters for r in reports)

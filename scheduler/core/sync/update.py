"""Plan updates: a new allocation that takes effect inside a segment already sent.

Pure (no ray, no torch, no clock). The driver decides the new allocation from step ``at``
(:func:`update_at`: the earliest step no worker can have started) and posts each worker's
steps from there as a :class:`PlanUpdate` under the step's key in the group's store. Every
worker claims that key before it starts the step, and the first claim seals it: either the
update was posted first (every worker applies it from ``at``) or the post is refused and
the allocation takes effect at the next segment (``SyncProtocol.defer``). Step ``s`` still
trains ``order[s·B : s·B + B_s]``, only cut differently (:func:`check_update`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dynabatch.actors.contracts import SegmentPlan, StepPlan, plan_key
from dynabatch.scheduler.core.sync.allocation import Decision


@dataclass(frozen=True, slots=True)
class OfferedUpdate:
    """A re-plan that changed the batches, adopted from step ``early`` of the segment in
    flight (which ends at ``end``): its workers must be sent their steps from ``early``
    under it, or it takes effect from ``end``."""

    decision: Decision
    early: int
    end: int
    why: str


@dataclass(frozen=True, slots=True)
class PlanUpdate:
    """Each worker's steps from ``at_step`` to the end of what was sent, in ``epoch``."""

    epoch: int
    at_step: int
    plans: dict[str, tuple[StepPlan, ...]]

    @property
    def key(self) -> str:
        return plan_key(self.epoch, self.at_step)


def update_at(*, committed: int, ahead_start: int | None, ahead_end: int | None,
              started: int = 1) -> int | None:
    """The step from which a re-plan decided now can take effect inside the segment in
    flight (``[ahead_start, ahead_end)``), or None (it takes effect at ``ahead_end``): the
    workers may have started ``started`` of its steps since ``committed``."""
    if ahead_start is None or ahead_end is None or ahead_start != committed:
        return None
    at = committed + max(started, 0)
    return at if at < ahead_end else None


def updated_plans(plans: dict[str, SegmentPlan], update: PlanUpdate) -> dict[str, SegmentPlan]:
    """``plans`` (a segment sent) with the steps from ``update.at_step`` on replaced."""
    out = {}
    for w, seg in plans.items():
        new = {sp.step: sp for sp in update.plans.get(w, ())}
        out[w] = replace(seg, steps=tuple(new.get(sp.step, sp) if sp.step >= update.at_step
                                          else sp for sp in seg.steps))
    return out


def check_update(plans: dict[str, SegmentPlan], update: PlanUpdate) -> str | None:
    """Why ``update`` cannot apply to the segment ``plans`` (None: it can): it must name the
    same workers and steps from its ``at_step``, and every step must keep its global batch
    (``start``, ``size``) with the workers' shares tiling it exactly once."""
    if set(plans) != set(update.plans):
        return "the update names other workers than the segment"
    seg = next(iter(plans.values()))
    if seg.epoch != update.epoch:
        return f"the segment is in epoch {seg.epoch}, the update in {update.epoch}"
    wanted = [sp for sp in seg.steps if sp.step >= update.at_step]
    if not wanted:
        return f"the segment has no step from {update.at_step}"
    for sp in wanted:
        shares = []
        for w in plans:
            got = [u for u in update.plans[w] if u.step == sp.step]
            if len(got) != 1:
                return f"{w} has {len(got)} plans for step {sp.step}"
            u = got[0]
            if (u.start, u.size) != (sp.start, sp.size):
                return f"step {sp.step}'s global batch changed"
            shares.append((u.own_start, u.own_start + u.own_size))
        pos = sp.start
        for lo, hi in sorted(shares):
            if lo != pos or hi < lo:
                return f"step {sp.step}'s shares do not tile its batch"
            pos = hi
        if pos != sp.start + sp.size:
            return f"step {sp.step}'s shares do not cover its batch"
    return None

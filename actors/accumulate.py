"""Micro-batches: a worker's memory cap limits what it computes at once, not its share.

A worker whose share of a step is b_i and whose memory holds at most m_i samples at once
computes the share as k_i = ceil(b_i / m_i) micro-batches of nearly equal size and
accumulates their gradients before the all-reduce (:mod:`dynabatch.actors.step`).

Step time. With a per-micro-batch overhead a_i and per-sample cost c_i, a share of b takes
``t_i(b) = ceil(b / m_i)·a_i + c_i·b`` (see
``dynabatch.scheduler.core.sync.steptime.accumulated``). Pure.
"""

from __future__ import annotations


def micro_ranges(size: int, cap: int | None) -> list[tuple[int, int]]:
    """Cut ``[0, size)`` into ``ceil(size / cap)`` contiguous ranges of nearly equal size
    (one range when ``cap`` is None or not exceeded; none for an empty share)."""
    if size <= 0:
        return []
    if cap is None or size <= cap:
        return [(0, size)]
    return even_ranges(size, -(-size // cap))


def even_ranges(size: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous ranges covering ``[0, size)`` whose sizes differ by at most one
    (the first ``size mod k`` are the longer ones). Also the parameter server's shards."""
    q, r = divmod(size, k)
    out, lo = [], 0
    for j in range(k):
        hi = lo + q + (1 if j < r else 0)
        out.append((lo, hi))
        lo = hi
    return out


def micro_cap(caps: int | list[int] | None, ordinal: int) -> int | None:
    """Worker ``ordinal``'s micro-batch cap from the spec's ``micro_batch`` (one value for
    every worker, or one per ordinal; workers past the list's end are uncapped)."""
    if caps is None or isinstance(caps, int):
        return caps
    return caps[ordinal] if ordinal < len(caps) else None


def tighter_cap(a: int | None, b: int | None) -> int | None:
    """The tighter of two micro-batch caps (None: uncapped): the spec's and the memory cap
    the driver learned for the worker's node and device."""
    if a is None or b is None:
        return b if a is None else a
    return min(a, b)


def largest_micro(size: int, cap: int | None) -> int:
    """The largest micro-batch a share of ``size`` is computed in under ``cap`` (0 for an
    empty share): what an out-of-memory error in that share's pass had tried to fit."""
    return max((hi - lo for lo, hi in micro_ranges(size, cap)), default=0)

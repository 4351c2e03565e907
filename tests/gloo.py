"""A real gloo group of worker processes for unit tests (no Ray).

The tests of the collective plan, precision, clipping and a lost peer each need several
processes that join one group through the rendezvous' store, run a step and report back.
:func:`run_members` is that harness, once: it starts the members (from a fork server that
has imported torch once), serves their store from this process, and collects one report per
rank with a bound, so a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable

from dynabatch.actors.group import ProcessGroup

# The start and the imports are slow on a loaded machine; a member then runs for at most
# its collective timeout. A report later than this is a hang.
REPORT_WAIT_S = 120.0

# What every member imports before its test module: loaded once, in the fork server.
PRELOAD = ["torch", "dynabatch.actors.worker", "dynabatch.actors.group"]


def _context() -> mp.context.BaseContext:
    """Members start from a fork server that has imported torch and the worker once, in
    this test process's session, instead of each importing them anew (``spawn``: 2-3 s a
    member on this machine, most of such a test's time). A fork server forks from a
    single-threaded process that has run nothing, so the members start as clean as spawned
    ones (no inherited threads, gloo state or torch thread pools)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_members(
    target: Callable[..., None],
    members: int,
    extra: Callable[[int], tuple] = lambda rank: (),
    *,
    timeout_s: float,
    join_timeout_s: float | None = None,
) -> dict[int, tuple]:
    """Run ``target(rank, rendezvous, *extra(rank), out)`` in ``members`` spawned processes
    and return what each put on ``out`` as ``(rank, *report)``, by rank: ``{rank: report}``.
    A rank missing from the result never reported (it hung or died)."""
    ctx = _context()
    out = ctx.Queue()
    store = ProcessGroup(timeout_s, join_timeout_s)  # held: it serves the members' store
    rv = store.open_store(1, members, "gloo", host="127.0.0.1")
    procs = [
        ctx.Process(target=target, args=(r, rv, *extra(r), out), daemon=True)
        for r in range(members)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    try:
        while len(got) < members:
            rank, *rest = out.get(timeout=REPORT_WAIT_S)
            got[rank] = tuple(rest)
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return got


def run_members_in_groups(
    target: Callable[..., None],
    members: int,
    groups: int,
    extra: Callable[[int], tuple] = lambda rank: (),
    *,
    timeout_s: float,
) -> dict[int, tuple]:
    """:func:`run_members` for several configurations of one test in the same processes:
    ``target(rank, rendezvous, more, *extra(rank), out)``, where ``more`` holds the
    rendezvous of ``groups - 1`` further groups of the same members, each with its own
    store (held here while they run). Spawning the members and importing torch in them is
    most of such a test's time; a member runs one configuration per group, one after
    another, and reports them all at once."""
    stores = [ProcessGroup(timeout_s) for _ in range(groups - 1)]
    more = tuple(s.open_store(1, members, "gloo", host="127.0.0.1") for s in stores)
    return run_members(target, members, lambda rank: (more, *extra(rank)), timeout_s=timeout_s)

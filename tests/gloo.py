"""A real gloo group of worker processes for unit tests (no Ray).

The tests of the collective plan, precision, clipping and a lost peer each need several
processes that join one group through the rendezvous' store, run a step and report back.
:func:`run_members` is that harness, once: it spawns the members, serves their store from
this process, and collects one report per rank with a bound, so a hang fails the test
instead of blocking the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable

from dynabatch.actors.group import ProcessGroup

# The spawn and the imports are slow on a loaded machine; a member then runs for at most
# its collective timeout. A report later than this is a hang.
REPORT_WAIT_S = 120.0


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
    ctx = mp.get_context("spawn")
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

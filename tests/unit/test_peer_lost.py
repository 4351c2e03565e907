"""A peer that dies after the join, before the step's collective (issue 30, item 4).

Three members join one gloo group as workers do; the third then exits without leaving (a
process killed after its check-in). Each survivor's next step must fail, as a *peer*
error (the driver regroups and retries; not the survivor's own compute error), within the
collective timeout rather than hang, and must leave the group (destroyed, so the survivor
can join the next generation). Members are plain processes: no Ray.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.worker import Worker

from tests.gloo import run_members

MEMBERS = 3
B = 12
N = 24
TIMEOUT_S = 4.0  # the collectives' timeout; the join's is longer, as in a real job
JOIN_TIMEOUT_S = 30.0


def _member(rank: int, rv, dies: bool, out: mp.Queue) -> None:
    try:
        spec = JobSpec.model_validate(
            dict(
                dataset={"name": "synthetic"},
                model={"name": "mlp", "hidden": 16},
                workers=MEMBERS,
                global_batch=B,
                collective_timeout_s=TIMEOUT_S,
                join_timeout_s=JOIN_TIMEOUT_S,
            )
        )
        rng = np.random.default_rng(0)
        x = rng.normal(size=(N, 8)).astype(np.float32)
        y = rng.integers(0, 3, size=N)
        w = Worker(f"w{rank}", rank, spec, x, y, (8,), 3)
        w.join(rv, rank)
        if dies:
            out.put((rank, "joined", None, None))
            out.close()
            out.join_thread()  # the message is sent before the process goes
            os._exit(0)  # gone without leaving: its peers find out in the collective
        share = B // MEMBERS
        plan = SegmentPlan(0, 0, N, (StepPlan(0, 0, B, rank * share, share),))
        t0 = time.monotonic()
        res = w.run_segment(plan)
        took = time.monotonic() - t0
        out.put((rank, res.error_kind, took, w.group.active))
    except Exception as err:  # reported, so the parent fails with it instead of waiting
        out.put((rank, f"{type(err).__name__}: {err}", None, None))


def test_a_peer_that_dies_after_the_join_fails_the_survivors_step_as_a_peer_error():
    got = run_members(
        _member, MEMBERS, lambda r: (r == MEMBERS - 1,),
        timeout_s=TIMEOUT_S, join_timeout_s=JOIN_TIMEOUT_S,
    )
    assert got.get(MEMBERS - 1, (None,))[0] == "joined", got
    for rank in range(MEMBERS - 1):
        assert rank in got, f"survivor {rank} never answered (hung): {got}"
        kind, took, active = got[rank]
        assert kind == "peer", f"survivor {rank}: {kind}"
        # Within the collective timeout (plus scheduling slack), not the join's.
        assert took < TIMEOUT_S + 10.0 < JOIN_TIMEOUT_S, f"survivor {rank} took {took:.1f} s"
        assert active is False, f"survivor {rank} is still in the broken group"

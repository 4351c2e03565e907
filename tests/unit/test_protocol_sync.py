"""The synchronous protocol: plans cover every position of an epoch exactly once, whatever
the allocations, re-plans and membership in between."""

from __future__ import annotations

import numpy as np
import pytest
from dynabatch.scheduler.core.sync.allocation import WorkerTelemetry
from dynabatch.scheduler.core.sync.policy import policy_for
from dynabatch.scheduler.core.sync.protocol import Position, RebalanceRule, SyncProtocol
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(deadline=None)  # many draws per example; a loaded CI machine is slow
@given(n=st.integers(1, 400), b=st.integers(1, 50), data=st.data())
def test_segments_cover_the_epoch_exactly_once_across_replans(n, b, data):
    rule = data.draw(st.sampled_from([RebalanceRule("epoch"), RebalanceRule("steps", 3),
                                      RebalanceRule("adaptive", check_steps=2)]))
    p = SyncProtocol(global_batch=b, dataset_size=n, seed=1, rule=rule)
    counts = np.zeros(n, dtype=np.int64)
    while not p.epoch_complete:
        k = data.draw(st.integers(1, min(b, 4)))  # membership may change between segments
        speeds = data.draw(st.lists(st.floats(0.5, 8.0), min_size=k, max_size=k))
        tel = [WorkerTelemetry(worker=f"w{i}", samples=int(100 * s), compute_s=1.0)
               for i, s in enumerate(speeds)]
        p.replan(policy_for(data.draw(st.sampled_from(["static", "dbs"]))), tel)
        plans = p.plan_segment()
        assert plans
        steps = len(next(iter(plans.values())).steps)
        # A failure may complete only part of the segment.
        done = data.draw(st.integers(1, steps))
        for sp_list in list(zip(*(pl.steps for pl in plans.values()), strict=True))[:done]:
            assert sum(sp.own_size for sp in sp_list) == sp_list[0].size
            for sp in sp_list:
                counts[sp.own_start:sp.own_start + sp.own_size] += 1
        p.advance(done)
    assert (counts == 1).all()
    assert p.step * p.global_batch >= p.dataset_size  # no sample left
    assert p.replan(policy_for("static"), tel) is None


def test_epoch_completes_on_the_last_step_even_when_n_is_a_multiple_of_b():
    p = SyncProtocol(global_batch=10, dataset_size=100, seed=0, position=Position(3, 9))
    assert not p.epoch_complete and p.step_size(9) == 10
    p.advance(1)
    assert p.epoch_complete and p.plan_segment if p.allocation else True
    assert p.segment_length() == 0
    p.next_epoch()
    assert p.position == Position(4, 0)


def test_before_the_data_loads_the_protocol_holds_where_training_restarts():
    # A checkpoint's position and batch are kept as they are until the data says how long
    # an epoch is; the load then clamps the step to the epoch (a smaller dataset).
    p = SyncProtocol(global_batch=64, seed=0)
    assert not p.loaded and p.steps_per_epoch == 0 and p.allocation is None
    p.rewind(Position(2, 30), 48)
    assert (p.position, p.global_batch) == (Position(2, 30), 48)
    p.load(480)
    assert p.loaded and p.steps_per_epoch == 10 and p.position == Position(2, 10)
    with pytest.raises(ValueError, match="dataset_size must be at least 1, got 0"):
        SyncProtocol(global_batch=64, seed=0).load(0)


def test_cannot_advance_past_the_epoch_or_skip_it():
    p = SyncProtocol(global_batch=10, dataset_size=95, seed=0)
    with pytest.raises(ValueError):
        p.advance(11)
    with pytest.raises(ValueError, match="not complete"):
        p.next_epoch()


def test_steps_rule_lands_on_multiples():
    p = SyncProtocol(global_batch=4, dataset_size=400, seed=0, rule=RebalanceRule("steps", 5))
    p.advance(3)
    assert p.segment_length() == 2 and not p.rule.due(p.step, p.steps_per_epoch)
    p.advance(2)
    assert p.rule.due(p.step, p.steps_per_epoch)

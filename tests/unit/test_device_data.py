"""Gathering micro-batches where the training set lives (actors/device_data.py), on the
CPU paths: the epoch's order placed once, and the staging path that pinned host memory
uses on a GPU node (pinned buffers need a GPU; here the same code runs with pageable ones).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dynabatch.actors.device_data import BatchGather, stage_dataset


def _data(n=50):
    x = torch.arange(n * 6, dtype=torch.float32).reshape(n, 2, 3)
    y = torch.arange(n, dtype=torch.int64) * 7
    order = np.random.default_rng(1).permutation(n)
    return x, y, order


@pytest.mark.parametrize("where", ["host", "pinned"])
def test_a_gather_is_the_samples_at_those_order_positions(where):
    x, y, order = _data()
    g = BatchGather(x, y, torch.device("cpu"), where)
    g.set_order(("e", 0), order)
    for lo, hi in [(0, 7), (7, 30), (30, 50), (3, 3)]:
        xb, yb = g.gather(lo, hi)
        ids = torch.from_numpy(order[lo:hi])
        assert torch.equal(xb, x[ids]) and torch.equal(yb, y[ids])


def test_the_order_is_placed_once_per_epoch():
    x, y, order = _data()
    g = BatchGather(x, y, torch.device("cpu"), "host")
    g.set_order(("e", 0), order)
    placed = g._order
    g.set_order(("e", 0), order[::-1].copy())  # same key: not placed again
    assert g._order is placed
    g.set_order(("e", 1), order[::-1].copy())
    assert g._order is not placed and int(g._order[0]) == int(order[-1])


def test_staging_gathers_into_two_preallocated_buffers_in_turn():
    """index_select of a pinned tensor returns pageable memory (its non_blocking copy to a
    GPU is synchronous), so the pinned path gathers into its own buffers, alternating, so a
    gather never overwrites the batch before it."""
    x, y, order = _data()
    g = BatchGather(x, y, torch.device("cpu"), "pinned")
    g.set_order(0, order)
    a, _ = g.gather(0, 10)
    b, _ = g.gather(10, 20)
    bufs = g.staging
    assert a.data_ptr() == bufs[0].x.data_ptr() and b.data_ptr() == bufs[1].x.data_ptr()
    assert torch.equal(a, x[torch.from_numpy(order[0:10])])  # not overwritten by b
    c, yc = g.gather(20, 28)  # smaller: the first buffer again, no new allocation
    assert g.staging[0] is bufs[0] and c.data_ptr() == bufs[0].x.data_ptr()
    assert yc.data_ptr() == bufs[0].y.data_ptr()
    d, _ = g.gather(0, 40)  # larger: that buffer grows
    assert g.staging[1].rows >= 40 and torch.equal(d, x[torch.from_numpy(order[:40])])


def test_training_data_stays_where_it_is_on_the_cpu():
    x, y, _ = _data(4)
    sx, sy, where = stage_dataset(x, y, torch.device("cpu"))
    assert sx is x and sy is y and where == "host"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pinned_staging_feeds_the_gpu_asynchronously():
    x, y, order = _data()
    x, y = x.pin_memory(), y.pin_memory()
    g = BatchGather(x, y, torch.device("cuda", 0), "pinned")
    g.set_order(0, order)
    outs = [g.gather(lo, lo + 10) for lo in range(0, 50, 10)]
    assert all(s.x.is_pinned() for s in g.staging)
    for k, (xb, yb) in enumerate(outs):
        ids = torch.from_numpy(order[10 * k:10 * k + 10])
        assert xb.is_cuda and torch.equal(xb.cpu(), x[ids]) and torch.equal(yb.cpu(), y[ids])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_device_the_order_lives_on_the_gpu():
    x, y, order = _data()
    g = BatchGather(x.cuda(), y.cuda(), torch.device("cuda", 0), "device")
    g.set_order(0, order)
    assert g._order.is_cuda
    xb, _ = g.gather(5, 15)
    assert torch.equal(xb.cpu(), x[torch.from_numpy(order[5:15])])

"""Gathering micro-batches where the training set lives (actors/device_data.py), on the
CPU paths: the epoch's order placed once, the staging path a GPU node uses when the set is
not on the device (pinned buffers need a GPU; here the same code runs with pageable ones),
and the device budget the set gets after the model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dynabatch.actors.device_data import (
    DATA_HEADROOM,
    BatchGather,
    data_budget,
    model_bytes,
    stage_dataset,
)


def _data(n=50):
    x = torch.arange(n * 6, dtype=torch.float32).reshape(n, 2, 3)
    y = torch.arange(n, dtype=torch.int64) * 7
    order = np.random.default_rng(1).permutation(n)
    return x, y, order


@pytest.mark.parametrize("where", ["host", "staged"])
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
    GPU is synchronous), so the staged path gathers into its own buffers, alternating, so a
    gather never overwrites the batch before it."""
    x, y, order = _data()
    g = BatchGather(x, y, torch.device("cpu"), "staged")
    g.set_order(0, order)
    a, ya = g.gather(0, 10)
    b, _ = g.gather(10, 20)
    assert a.data_ptr() != b.data_ptr() and g.pool.allocated == 2
    assert torch.equal(a, x[torch.from_numpy(order[0:10])])  # not overwritten by b
    c, yc = g.gather(20, 28)  # smaller: the first buffer again, no new allocation
    assert c.data_ptr() == a.data_ptr() and yc.data_ptr() == ya.data_ptr()
    assert g.pool.allocated == 2
    d, _ = g.gather(0, 40)  # larger: a larger buffer replaces one
    assert g.pool.allocated == 3 and torch.equal(d, x[torch.from_numpy(order[:40])])


def test_training_data_stays_where_it_is_on_the_cpu():
    x, y, _ = _data(4)
    sx, sy, where = stage_dataset(x, y, torch.device("cpu"), None)
    assert sx is x and sy is y and where == "host"


@pytest.mark.parametrize("budget", [None, 0, 100])
def test_a_set_that_does_not_fit_the_budget_is_never_pinned_whole(monkeypatch, budget):
    """On a GPU node a set larger than its budget stays in host memory as it is (each
    micro-batch is staged through a small pinned buffer): no page-locked copy of the whole
    set in every worker, and no look at free memory before the model is built."""
    x, y, _ = _data()
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda *_a, **_k: pytest.fail("the whole set was pinned"))
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda *_a: pytest.fail("budget decided from free memory"))
    sx, sy, where = stage_dataset(x, y, torch.device("cuda", 0), budget)
    assert sx is x and sy is y and where == "staged"


def test_the_data_budget_is_what_the_model_and_its_activations_leave():
    gib = 1 << 30
    # 10 GiB free, 2 GiB of model+optimizer, 1 MiB a sample at a micro-batch of 1024.
    got = data_budget(10 * gib, 2 * gib, 1 << 20, 1024)
    assert got == int((10 * gib - 2 * gib - gib) * (1 - DATA_HEADROOM))
    # A larger micro-batch or model leaves less; nothing left: 0, never negative.
    assert data_budget(10 * gib, 2 * gib, 1 << 20, 4096) < got
    assert data_budget(10 * gib, 4 * gib, 1 << 20, 1024) < got
    assert data_budget(gib, 2 * gib, 1 << 20, 1024) == 0
    assert data_budget(gib, 0, 0, 0, headroom=0.0) == gib


def test_model_bytes_count_gradients_and_the_optimizer_state():
    p = [torch.nn.Parameter(torch.zeros(10, 10)), torch.nn.Parameter(torch.zeros(5))]
    n = 105 * 4
    assert model_bytes(p, torch.optim.Adam(p)) == n * 4  # weights, gradients, two moments
    assert model_bytes(p, torch.optim.SGD(p, lr=0.1, momentum=0.9)) == n * 3
    assert model_bytes(p, torch.optim.SGD(p, lr=0.1)) == n * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pinned_staging_feeds_the_gpu_asynchronously():
    x, y, order = _data()
    g = BatchGather(x, y, torch.device("cuda", 0), "staged")
    g.set_order(0, order)
    outs = [g.gather(lo, lo + 10) for lo in range(0, 50, 10)]
    assert all(s.x.is_pinned() and s.y.is_pinned() for s in [g._held, *g.pool._free])
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

"""The epoch's order for sources that read blocks of consecutive ids (Parquet row groups).

A plain permutation (:func:`dynabatch.actors.contracts.epoch_order`) scatters every step
over the whole file, so each sample would cost a row group's decode. :func:`block_order`
is a permutation of ``range(n)`` too (so the ledger and its proof do not change): the
blocks of ``block`` consecutive ids in a seeded random order, then the ids shuffled within
each window of ``WINDOW`` consecutive blocks. A step's samples then come from at most
``WINDOW`` blocks, and a worker decodes each block about once per epoch while its cache
holds a window. Seeded from (seed, epoch) like the plain order: every worker computes the
same one.
"""

from __future__ import annotations

import numpy as np
from dynabatch.actors.contracts import epoch_order

WINDOW = 16


def block_order(seed: int, epoch: int, n: int, block: int, shuffle: str = "every_epoch"
                ) -> np.ndarray:
    """The order a worker trains: the plain permutation when ``block`` is 1, else blocked."""
    if block <= 1:
        return epoch_order(seed, epoch, n, shuffle)
    e = epoch if shuffle == "every_epoch" else 0
    rng = np.random.default_rng([seed, e, 0x424C4B])
    nb = -(-n // block)
    dt = np.int32 if nb * block < 2**31 else np.int64  # half the memory of a large order
    blocks = rng.permutation(nb).astype(dt)
    ids = (blocks[:, None] * dt(block) + np.arange(block, dtype=dt)[None, :]).ravel()
    if nb * block > n:  # the last block is short
        ids = ids[ids < n]
    span = WINDOW * block
    for s in range(0, n, span):
        rng.shuffle(ids[s:s + span])
    return ids

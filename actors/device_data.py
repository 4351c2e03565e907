"""Where a worker's training samples live, and how a micro-batch is gathered from them.

A GPU worker gathers every micro-batch from the training set. Copying the whole set to
the device once (when it fits in ``fraction`` of the free device memory) turns each step's
host-to-device copies into an on-device ``index_select``; otherwise the set is pinned in
host memory. On the CPU the arrays stay as they are (zero-copy views of the object store).

Gathering (:class:`BatchGather`). A worker trains order *positions*; the epoch's order (a
permutation of sample ids) is set once per epoch, and on the device when the set is there,
so a step sends no index to the GPU. In the pinned case, ``index_select`` of a pinned
tensor returns ordinary pageable memory, whose ``non_blocking`` copy to the device is in
fact synchronous; the gather therefore writes into a preallocated pinned *staging* buffer
(``index_select(out=...)``) and copies that asynchronously. Two staging buffers alternate,
each guarded by a CUDA event recorded after its copy, so the host never overwrites a buffer
whose copy the device has not done (it waits on that one event, which in practice has long
completed, never on the whole device).
"""

from __future__ import annotations

import numpy as np
import torch


def stage_dataset(x: torch.Tensor, y: torch.Tensor, device: torch.device,
                  fraction: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(x, y, where): the training set on ``device`` when it fits, else pinned on the
    host; unchanged on the CPU. ``where`` is "device", "pinned" or "host"."""
    if device.type != "cuda":
        return x, y, "host"
    need = x.numel() * x.element_size() + y.numel() * y.element_size()
    free, _total = torch.cuda.mem_get_info(device)
    if need <= fraction * free:
        try:
            return x.to(device), y.to(device), "device"
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
    return x.pin_memory(), y.pin_memory(), "pinned"


class _Staging:
    """One pinned host buffer pair for gathered samples, reused while large enough."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, rows: int, pin: bool):
        self.x = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, pin_memory=pin)
        self.y = torch.empty((rows, *y.shape[1:]), dtype=y.dtype, pin_memory=pin)
        self.copied: torch.cuda.Event | None = None  # recorded after its last copy

    @property
    def rows(self) -> int:
        return self.x.shape[0]


class BatchGather:
    """Micro-batches of the epoch's order, gathered from the training set where it lives
    (``where`` as returned by :func:`stage_dataset`) and delivered on ``device``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, device: torch.device, where: str):
        self.x, self.y, self.device, self.where = x, y, device, where
        self._cuda = device.type == "cuda"
        self._order: torch.Tensor | None = None
        self._key: object = None
        self._staging: list[_Staging | None] = [None, None]
        self._turn = 0

    def set_order(self, key: object, order: np.ndarray) -> None:
        """Use ``order`` (sample ids by position) until the next call with another key;
        on the device when the set is there, so each epoch's order crosses once."""
        if key == self._key:
            return
        ids = torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64))
        self._order = ids.to(self.x.device) if self.x.device != ids.device else ids
        self._key = key

    def gather(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at order positions ``[lo, hi)``, on the worker's device."""
        ids = self._order[lo:hi]
        if self.where != "pinned":
            # On the CPU a view of the order; on the GPU both live on the device.
            return self.x.index_select(0, ids), self.y.index_select(0, ids)
        buf = self._buffer(hi - lo)
        n = hi - lo
        xs, ys = buf.x[:n], buf.y[:n]
        torch.index_select(self.x, 0, ids, out=xs)
        torch.index_select(self.y, 0, ids, out=ys)
        if not self._cuda:  # only in tests: the staging path without a GPU
            return xs, ys
        xb = xs.to(self.device, non_blocking=True)
        yb = ys.to(self.device, non_blocking=True)
        buf.copied = torch.cuda.Event()
        buf.copied.record()
        return xb, yb

    def _buffer(self, rows: int) -> _Staging:
        k, self._turn = self._turn, 1 - self._turn
        buf = self._staging[k]
        if buf is not None and buf.copied is not None:
            buf.copied.synchronize()  # its previous copy must be done before it is rewritten
        if buf is None or buf.rows < rows:
            # Grow geometrically: pinned allocations are slow, and shares change size.
            grow = max(rows, 2 * buf.rows) if buf is not None else rows
            buf = self._staging[k] = _Staging(self.x, self.y, grow, pin=self._cuda)
        return buf

    @property
    def staging(self) -> list[_Staging | None]:
        """The staging buffers (tests)."""
        return self._staging

"""Where a worker's training samples live: on its GPU once, when they fit.

A GPU worker gathers every micro-batch from the training set. Copying the whole set to
the device once (when it fits in ``fraction`` of the free device memory) turns each step's
host-to-device copies into an on-device ``index_select``; otherwise the set is pinned in
host memory, so the per-step copies (``non_blocking=True``) are asynchronous DMA instead
of synchronous pageable copies. On the CPU the arrays stay as they are (zero-copy views of
the object store).
"""

from __future__ import annotations

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

"""Process-group rendezvous, one fresh TCP store per membership generation: reusing a store
across generations would let a stale member's keys leak into the new group. The backend
(:func:`choose_backend`), the bounded join (:func:`check_in`) and NCCL fault handling
(:func:`configure_nccl_fault_handling`, :meth:`ProcessGroup.leave`): docs/elasticity.md.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# How an NCCL collective's failure reaches the worker: the communicator is aborted and the
# process kept (2; 1 would kill it), and wait() blocks the host and raises at the
# collectives' timeout (BLOCKING_WAIT=1), so a lost peer raises in the survivors.
NCCL_FAULT_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "1"}


SEALED = b"-"  # a key claimed before anything was posted under it


@dataclass(frozen=True)
class Rendezvous:
    generation: int
    host: str
    port: int
    world_size: int
    backend: str = "gloo"


def choose_backend(devices: Sequence[str], gpus: Sequence[str | None] | None = None) -> str:
    """NCCL when every member's device is a GPU of its own, gloo otherwise: when any member
    is on the CPU, or when two members share one GPU (fractional ``worker_gpus``: NCCL
    refuses two ranks on one device; through gloo each stages its buckets through host
    memory). ``gpus``: each member's physical GPU, as :func:`gpu_key` names it (None where
    unknown: not counted as shared)."""
    if not devices or not all(d.startswith("cuda") for d in devices):
        return "gloo"
    known = [g for g in gpus or () if g is not None]
    return "nccl" if len(set(known)) == len(known) else "gloo"


def gpu_key(node_id: str, gpu_ids: Sequence[str | int]) -> str | None:
    """The physical GPU a worker drives, unique in the cluster (its node and Ray's GPU id),
    to tell members that share one; None when Ray gave it none."""
    return f"{node_id}/{gpu_ids[0]}" if gpu_ids else None


def configure_nccl_fault_handling() -> None:
    """Make NCCL raise in survivors instead of killing them (:data:`NCCL_FAULT_ENV`); read
    by torch when the group is formed."""
    os.environ.update(NCCL_FAULT_ENV)


def _reset_group_counter() -> None:
    """Name the next default group "0" in every member.

    torch derives the default group's store prefix from a per-process counter, which
    ``init_process_group`` increments *before* its rendezvous and only
    ``destroy_process_group`` of a live group resets. A member whose earlier join failed
    (a peer died during the rendezvous) would otherwise look for its peers under another
    prefix than the others, and every later regroup would time out.
    """
    dist.distributed_c10d._world.group_count = 0


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit tests): loopback is where peers are
        return socket.gethostbyname(socket.gethostname())


def check_in(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
    """Post this member's arrival in the generation's store and wait, at most ``timeout``,
    until every member has: the part of a join that waits for peers, bounded by the
    start-up timeout (a missing peer raises ``DistStoreError`` here)."""
    store.set(f"in/{rank}", "1")
    store.wait([f"in/{r}" for r in range(world_size)], timeout)


def abort_group() -> None:
    """Abort the default group's communicators, so a collective blocked on a dead peer
    returns and the group can be destroyed. ``abort`` is looked up outside the error
    handling: a torch without it raises AttributeError instead of silently skipping the
    abort. Errors of the abort itself (a communicator already broken) are expected: the
    group is being replaced."""
    abort = dist.group.WORLD.abort
    with contextlib.suppress(RuntimeError):
        abort()


class ProcessGroup:
    """Owns this process's membership in the default torch.distributed group.

    ``timeout_s`` bounds each collective; ``join_timeout_s`` (default: the same) bounds a
    join's start-up: the store, waiting for the peers, and NCCL's communicator."""

    def __init__(self, timeout_s: float, join_timeout_s: float | None = None):
        self.timeout = timedelta(seconds=timeout_s)
        self.join_timeout = timedelta(seconds=join_timeout_s or timeout_s)
        self.generation = -1
        self.backend: str | None = None
        self._store: dist.TCPStore | None = None
        self._store_generation = -1

    def open_store(
        self, generation: int, world_size: int, backend: str = "gloo", host: str | None = None
    ) -> Rendezvous:
        """Rank 0 only: listen on a free port for this generation's members."""
        host = host or node_ip()
        self._store = dist.TCPStore(
            host, 0, world_size, is_master=True, wait_for_workers=False,
            timeout=self.join_timeout,
        )
        self._store_generation = generation
        return Rendezvous(generation, host, self._store.port, world_size, backend)

    def join(self, rv: Rendezvous, rank: int, device: torch.device | None = None) -> None:
        """Join generation ``rv`` as ``rank``, within the start-up timeout. ``device``: the
        member's GPU, required for NCCL, whose communicator is then created here."""
        self.leave()
        if rv.backend == "nccl":
            if device is None or device.type != "cuda":
                raise ValueError(f"an NCCL group needs the member's GPU, not {device}")
            configure_nccl_fault_handling()
        own = rank == 0 and self._store is not None and self._store_generation == rv.generation
        store = self._store if own else dist.TCPStore(
            rv.host, rv.port, rv.world_size, is_master=False, timeout=self.join_timeout
        )
        check_in(store, rank, rv.world_size, self.join_timeout)
        _reset_group_counter()
        dist.init_process_group(
            rv.backend, store=store, rank=rank, world_size=rv.world_size,
            timeout=self.timeout, device_id=device if rv.backend == "nccl" else None,
        )
        self._store = store
        self.generation = rv.generation
        self.backend = rv.backend

    def leave(self) -> None:
        """Leave the group. Peers blocked in a collective with this process fail fast
        (their connections close) instead of waiting out the timeout."""
        if dist.is_initialized():
            if self.backend == "nccl":
                # A communicator stuck on a dead peer would block destroy: abort it first.
                abort_group()
            # A broken group (a peer died) can fail to tear down cleanly; it is being
            # replaced either way.
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.generation = -1

    def claim(self, key: str) -> bytes | None:
        """Claim ``key`` in this generation's store, atomically: the value the driver posted
        there, or None after sealing it (the driver's later post is then refused)."""
        if self._store is None:
            raise RuntimeError("no store: not in a group")
        got = self._store.compare_set(key, "", SEALED)
        return None if got == SEALED else got

    @property
    def active(self) -> bool:
        return dist.is_initialized()

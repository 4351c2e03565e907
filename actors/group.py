"""Process-group rendezvous, one fresh TCP store per membership generation.

Re-forming after a change of membership is destroy + init with a new store: reusing a
store across generations would let a stale member's keys leak into the new group.

Backends. The scheduler picks the backend per generation (:func:`choose_backend`): NCCL
when every member trains on a GPU, gloo otherwise (a job that mixes GPU and CPU nodes;
GPU members stage their flat gradient buffer through pinned host memory for it).

NCCL faults. By default a lost peer makes PyTorch's NCCL watchdog tear the *process*
down after the timeout, which would kill every survivor. Before an NCCL group is formed,
:func:`configure_nccl_fault_handling` sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean
up only: abort the communicator and raise, keep the process) and
``TORCH_NCCL_BLOCKING_WAIT=1`` (a timed-out collective raises in the calling thread), and
:meth:`ProcessGroup.leave` aborts the communicator before destroying the group, so a
survivor raises, leaves and re-forms.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

NCCL_FAULT_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "1"}


SEALED = b"-"  # a key claimed before anything was posted under it


@dataclass(frozen=True)
class Rendezvous:
    generation: int
    host: str
    port: int
    world_size: int
    backend: str = "gloo"


def choose_backend(devices: Sequence[str]) -> str:
    """NCCL when every member's device is a GPU, gloo when any member is on the CPU."""
    return "nccl" if devices and all(d.startswith("cuda") for d in devices) else "gloo"


def configure_nccl_fault_handling() -> None:
    """Make NCCL raise in survivors instead of killing them (see the module docstring)."""
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


class ProcessGroup:
    """Owns this process's membership in the default torch.distributed group."""

    def __init__(self, timeout_s: float):
        self.timeout = timedelta(seconds=timeout_s)
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
            host, 0, world_size, is_master=True, wait_for_workers=False, timeout=self.timeout
        )
        self._store_generation = generation
        return Rendezvous(generation, host, self._store.port, world_size, backend)

    def join(self, rv: Rendezvous, rank: int) -> None:
        self.leave()
        if rv.backend == "nccl":
            configure_nccl_fault_handling()
        own = rank == 0 and self._store is not None and self._store_generation == rv.generation
        store = self._store if own else dist.TCPStore(
            rv.host, rv.port, rv.world_size, is_master=False, timeout=self.timeout
        )
        _reset_group_counter()
        dist.init_process_group(
            rv.backend, store=store, rank=rank, world_size=rv.world_size, timeout=self.timeout
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
                with contextlib.suppress(Exception):
                    dist.distributed_c10d._abort_process_group()
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

"""Process-group rendezvous, one fresh TCP store per membership generation.

Re-forming after a change of membership is destroy + init with a new store: reusing a
store across generations would let a stale member's keys leak into the new group.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class Rendezvous:
    generation: int
    host: str
    port: int
    world_size: int


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit tests): loopback is where peers are
        return socket.gethostbyname(socket.gethostname())


class ProcessGroup:
    """Owns this process's membership in the default torch.distributed group."""

    def __init__(self, backend: str, timeout_s: float):
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        self.generation = -1
        self._store: dist.TCPStore | None = None
        self._store_generation = -1

    def open_store(self, generation: int, world_size: int, host: str | None = None) -> Rendezvous:
        """Rank 0 only: listen on a free port for this generation's members."""
        host = host or node_ip()
        self._store = dist.TCPStore(
            host, 0, world_size, is_master=True, wait_for_workers=False, timeout=self.timeout
        )
        self._store_generation = generation
        return Rendezvous(generation, host, self._store.port, world_size)

    def join(self, rv: Rendezvous, rank: int) -> None:
        self.leave()
        own = rank == 0 and self._store is not None and self._store_generation == rv.generation
        store = self._store if own else dist.TCPStore(
            rv.host, rv.port, rv.world_size, is_master=False, timeout=self.timeout
        )
        dist.init_process_group(
            self.backend, store=store, rank=rank, world_size=rv.world_size, timeout=self.timeout
        )
        self._store = store
        self.generation = rv.generation

    def leave(self) -> None:
        if dist.is_initialized():
            # A broken group (a peer died) can fail to tear down cleanly; it is being
            # replaced either way.
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.generation = -1

    @property
    def active(self) -> bool:
        return dist.is_initialized()

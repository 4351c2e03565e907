"""The output of a job's actors (the user's ``print``s, warnings, errors) for the job log,
read through Ray's log API (``ray.util.state.get_log``) by actor id, also after the actor
died, as long as its node lives. How it reaches the job log and its limits:
docs/operations.md ("The processes' own output").
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynabatch.actors.errors import first_line

POLL_S = 2.0  # how often live actors' files are read
FETCH_TIMEOUT_S = 10  # the log API's own bound on one read (Ray takes whole seconds)
RESOLVE_TIMEOUT_S = 10.0  # waiting for an actor's id once it has left
CLOSE_WAIT_S = 20.0  # how long close() waits for the last pass
MAX_LINE = 2000  # characters kept of one line
MAX_LINES_PER_READ = 2000  # lines handed on from one file in one pass; the rest is counted
MAX_FOLLOWED_BYTES = 16 * 2**20  # of one file; Ray keeps the rest (`ray logs actor --id`)
LOST_AFTER = 5  # failed reads in a row before a live actor's output is given up
# The log files' two streams, as Ray names the files and as the job log names them.
STREAMS = (("out", "stdout"), ("err", "stderr"))
# Lines Ray itself writes into worker log files to attribute what follows (its
# LOG_PREFIX_* and task-attempt markers): not the program's output.
_RAY_MARKER = re.compile(r"^:(job_id|actor_name|task_name|task_attempt_start|task_attempt_end):")

# (source, stream, line): stream is "stdout", "stderr", or "note" (about the collection).
Sink = Callable[[str, str, str], None]
# (actor id, "out" | "err") -> the whole file as it is now.
Fetch = Callable[[str, str], bytes]
# An actor-id reference -> the id, None while not known yet; ``block`` waits a bounded time.
Resolve = Callable[[Any, bool], "str | None"]


class LogApiUnavailable(RuntimeError):
    """Nothing serves Ray's log API on this cluster (no dashboard / no ``ray[default]``)."""


def own_actor_id() -> str | None:
    """The calling process's Ray actor id (hex), or None outside a Ray actor."""
    import ray

    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_actor_id()


def ray_log_fetch(address: str, timeout_s: int = FETCH_TIMEOUT_S) -> Fetch:
    """Reads one actor's log file through ``ray.util.state.get_log``."""
    import requests
    from ray.util.state import get_log

    def fetch(actor_id: str, suffix: str) -> bytes:
        try:
            chunks = get_log(address=address, actor_id=actor_id, suffix=suffix, tail=-1,
                             encoding=None, timeout=timeout_s)
            return b"".join(chunks)  # type: ignore[arg-type]
        except requests.exceptions.ConnectionError as err:
            raise LogApiUnavailable(first_line(err)) from err

    return fetch


def ray_resolve(ref: Any, block: bool) -> str | None:
    """The actor id an ``actor_id.remote()`` reference resolves to. An actor that died
    before answering still has its files: its id comes with the error."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    if not block and not ray.wait([ref], timeout=0)[0]:
        return None
    try:
        return ray.get(ref, timeout=RESOLVE_TIMEOUT_S if block else 1.0)
    except GetTimeoutError:
        if block:
            raise
        return None
    except RayActorError as err:
        if err.actor_id:
            return str(err.actor_id)
        raise


@dataclass
class _Actor:
    source: str
    actor_id: str | None
    ref: Any = None  # resolves to the actor id (when it was not known at watch time)
    ignore: str | None = None
    leaving: bool = False
    failures: int = 0
    offsets: dict[str, int] = field(default_factory=lambda: {"out": 0, "err": 0})
    capped: set[str] = field(default_factory=set)


class ActorOutput:
    """Follows the stdout and stderr files of registered actors; see the module docstring.

    ``fetch`` and ``resolve`` are Ray's (:meth:`for_ray`) or a test's. All reads happen in
    one thread (:meth:`start`), so a slow log API never blocks the job's driver; without it
    (tests), :meth:`poll` runs one pass.
    """

    def __init__(self, sink: Sink, fetch: Fetch, resolve: Resolve | None = None, *,
                 poll_s: float = POLL_S):
        self._sink = sink
        self._fetch = fetch
        self._resolve = resolve
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._actors: dict[str, _Actor] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._unavailable = False

    @classmethod
    def for_ray(cls, sink: Sink, *, poll_s: float = POLL_S) -> ActorOutput:
        import ray

        address = ray.get_runtime_context().gcs_address
        return cls(sink, ray_log_fetch(address), ray_resolve, poll_s=poll_s)

    # --- registration (any thread) -------------------------------------------------------
    def watch(self, source: str, actor: Any, *, ignore: str | None = None) -> None:
        """Follow ``actor``'s output as ``source``: ``actor`` is its id, or a reference that
        resolves to it (``handle.actor_id.remote()``). Lines containing ``ignore`` are
        dropped (a driver's own log lines, which its stderr echoes)."""
        with self._lock:
            if self._closed:
                return
            known = actor if isinstance(actor, str) or actor is None else None
            self._actors[source] = _Actor(source, known, None if known else actor, ignore)

    def watch_self(self, source: str, *, ignore: str | None = None) -> None:
        """Follow the calling actor's own output (nothing outside a Ray actor)."""
        actor_id = own_actor_id()
        if actor_id:
            self.watch(source, actor_id, ignore=ignore)

    def unwatch(self, source: str) -> None:
        """``source`` left: what it wrote until now is read once more, then it is dropped."""
        with self._lock:
            a = self._actors.get(source)
            if a is not None:
                a.leaving = True

    # --- reading ------------------------------------------------------------------------
    def start(self) -> ActorOutput:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="actor-output", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Read every actor a last time (in the reading thread, bounded by ``timeout_s``),
        then stop. Later watch/unwatch calls do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is None:
            self.poll(final=True)
            return
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.poll()
        self.poll(final=True)

    def poll(self, final: bool = False) -> None:
        """One pass: new complete lines of every followed file to the sink; actors that
        left (every actor, when ``final``) are read to their end and dropped."""
        if self._unavailable:
            return
        with self._lock:
            actors = list(self._actors.values())
        for a in actors:
            last = final or a.leaving
            try:
                self._read(a, last)
            except LogApiUnavailable as err:
                self._unavailable = True
                self._sink(a.source, "note", "the job's actors' output is not collected: Ray's "
                           f"log API did not answer ({err}); it needs ray[default] and the "
                           "Ray dashboard on the cluster's head")
                return
            except Exception as err:  # one actor's files; the others go on
                a.failures += 1
                if last or a.failures >= LOST_AFTER:
                    self._sink(a.source, "note", f"its output cannot be read any more "
                               f"({first_line(err)})")
                    last = True
            else:
                a.failures = 0
            if last:
                with self._lock:
                    if self._actors.get(a.source) is a:
                        del self._actors[a.source]

    def _read(self, a: _Actor, last: bool) -> None:
        if a.actor_id is None:
            if a.ref is None or self._resolve is None:
                return
            a.actor_id = self._resolve(a.ref, last)
            if a.actor_id is None:
                return
        for suffix, stream in STREAMS:
            if suffix in a.capped:
                continue
            data = self._fetch(a.actor_id, suffix)
            start = a.offsets[suffix]
            if len(data) < start:  # a new file (Ray rotated it): from its beginning
                start = 0
            new = data[start:]
            if not last:  # a partial last line waits for its end (or the actor's)
                cut = new.rfind(b"\n")
                if cut < 0 and len(new) <= MAX_LINE * 4:
                    continue
                new = new[:cut + 1] if cut >= 0 else new
            a.offsets[suffix] = start + len(new)
            self._hand_on(a, stream, new)
            if a.offsets[suffix] >= MAX_FOLLOWED_BYTES:
                a.capped.add(suffix)
                self._sink(a.source, "note", f"its {stream} is followed up to "
                           f"{MAX_FOLLOWED_BYTES // 2**20} MiB; Ray keeps the rest: "
                           f"`ray logs actor --id {a.actor_id}`")

    def _hand_on(self, a: _Actor, stream: str, chunk: bytes) -> None:
        lines = [line for line in _lines(chunk) if not (a.ignore and a.ignore in line)]
        for line in lines[:MAX_LINES_PER_READ]:
            self._sink(a.source, stream, line)
        if len(lines) > MAX_LINES_PER_READ:
            self._sink(a.source, "note", f"{len(lines) - MAX_LINES_PER_READ} more {stream} "
                       f"lines not shown: `ray logs actor --id {a.actor_id}` has them")


def _lines(chunk: bytes) -> list[str]:
    out = []
    for raw in chunk.split(b"\n"):
        line = raw.decode("utf-8", "replace").rstrip("\r")
        if line.strip() and not _RAY_MARKER.match(line):
            out.append(line[:MAX_LINE])
    return out

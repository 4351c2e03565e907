"""A worker's own output (the user's ``print``s, warnings, library messages) for the job log.

:class:`OutputTee` replaces ``sys.stdout`` and ``sys.stderr`` in the worker process with
writers that pass everything on to the original streams (so Ray's per-worker log files
still get it) and also keep each complete line, tagged ``stdout``/``stderr``, in a bounded
buffer. The worker hands the buffered lines back with each segment's result; the
coordinator appends them to the job log, which ``dynabatch logs``, the REST log endpoint
and the event stream read.

Why not Ray's log API (``ray.util.state.get_log``): it is served by the Ray dashboard, which
needs ``ray[default]``; this service runs on plain ``ray`` with the dashboard off, where
``get_log`` has no server to ask. Capturing in the worker works on every cluster.
"""

from __future__ import annotations

import collections
import sys
import threading
from typing import TextIO

MAX_LINES = 1000  # kept between two segments; older lines are dropped (and counted)
MAX_LINE = 2000  # characters kept of one line


class _Tee:
    def __init__(self, name: str, original: TextIO, sink: OutputTee):
        self._name, self._original, self._sink = name, original, sink
        self._partial = ""

    def write(self, text: str) -> int:
        n = self._original.write(text)
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            self._sink.add(self._name, line)
        if len(self._partial) > MAX_LINE:  # a huge line without a newline: cut it
            self._sink.add(self._name, self._partial)
            self._partial = ""
        return n

    def flush(self) -> None:
        self._original.flush()

    def __getattr__(self, name: str):  # isatty, fileno, encoding...: the original's
        return getattr(self._original, name)


class OutputTee:
    def __init__(self, max_lines: int = MAX_LINES):
        self._lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self._dropped = 0
        self._lock = threading.Lock()
        self._saved: tuple[TextIO, TextIO] | None = None

    def install(self) -> OutputTee:
        if self._saved is None:
            self._saved = (sys.stdout, sys.stderr)
            sys.stdout = _Tee("stdout", sys.stdout, self)  # type: ignore[assignment]
            sys.stderr = _Tee("stderr", sys.stderr, self)  # type: ignore[assignment]
        return self

    def uninstall(self) -> None:
        if self._saved is not None:
            sys.stdout, sys.stderr = self._saved
            self._saved = None

    def add(self, stream: str, line: str) -> None:
        line = line.rstrip("\r")
        if not line.strip():
            return
        with self._lock:
            if len(self._lines) == self._lines.maxlen:
                self._dropped += 1
            self._lines.append(f"{stream}: {line[:MAX_LINE]}")

    def drain(self) -> tuple[str, ...]:
        """The lines since the last drain (oldest first), and a note of any dropped."""
        with self._lock:
            out = list(self._lines)
            if self._dropped:
                out.insert(0, f"stderr: ({self._dropped} earlier output lines dropped)")
            self._lines.clear()
            self._dropped = 0
        return tuple(out)

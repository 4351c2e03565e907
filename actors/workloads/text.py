"""``pysource``: a character-level language-modelling corpus present offline on every machine.

The text is the Python standard library's own source: a fixed, sorted list of modules read
from ``sysconfig.get_paths()["stdlib"]`` and concatenated in that order, so the same Python
gives the same corpus byte for byte. Characters map to a small vocabulary (tab, newline and
printable ASCII; anything else is id 0). The stream is cut in two by position: the first
``1 - test_fraction`` of it trains, the rest (other modules) is held out. Each part is cut
into non-overlapping windows of ``seq_len + 1`` characters; ``x`` is a window without its last
character and ``y`` without its first (the next character at every position).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
from dynabatch.actors.workloads import WorkloadError

# Modules present in every CPython 3.10+; sorted so the order never depends on the file system.
MODULES = (
    "argparse.py", "bisect.py", "calendar.py", "contextlib.py", "csv.py", "dataclasses.py",
    "difflib.py", "fnmatch.py", "fractions.py", "functools.py", "gettext.py", "glob.py",
    "heapq.py", "json/decoder.py", "json/encoder.py", "operator.py", "posixpath.py",
    "pprint.py", "queue.py", "random.py", "sched.py", "selectors.py", "shlex.py", "string.py",
    "textwrap.py", "tokenize.py", "traceback.py", "warnings.py",
)
# id 0: any other character; then tab, newline and the printable ASCII range.
ALPHABET = "\t\n" + "".join(chr(c) for c in range(32, 127))
VOCAB = len(ALPHABET) + 1
_LOOKUP = np.zeros(256, dtype=np.int64)
for _i, _c in enumerate(ALPHABET, start=1):
    _LOOKUP[ord(_c)] = _i


def stdlib_text(max_chars: int) -> str:
    """The first ``max_chars`` characters of the concatenated corpus modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for name in MODULES:
        path = root / name
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as err:
            raise WorkloadError(
                f"dataset.name: pysource cannot read {path} ({err.strerror})"
            ) from err
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def encode(text: str) -> np.ndarray:
    """Character ids (int64); non-ASCII characters are id 0."""
    raw = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)
    return _LOOKUP[raw]


def windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping ``(x, y)`` windows: ``y`` is ``x`` shifted by one character."""
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise WorkloadError(f"dataset.options.seq_len: {seq_len} is longer than the text")
    x = ids[: n * seq_len].reshape(n, seq_len)
    y = ids[1 : n * seq_len + 1].reshape(n, seq_len)
    return np.ascontiguousarray(x), np.ascontiguousarray(y)

"""What every benchmark ends with: its one JSON object on stdout, and in ``--out`` too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], out: str | None, indent: int | None = None) -> None:
    """Print ``result`` as one JSON object (flushed: Ray's own output follows) and, when
    ``out`` is given, write the same text there."""
    text = json.dumps(result, indent=indent)
    print(text, flush=True)
    if out:
        Path(out).write_text(text + "\n")

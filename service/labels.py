"""Short, readable names shown for Ray nodes: the same in the CLI's tables, the REST
answers' display, the job page and the Prometheus labels.

A Ray node id is 56 hex digits; its first :data:`NODE_CHARS` name it everywhere we show it
(as ``git`` names a commit). Metrics need no such label: each has its name in the spec
(``metrics: [{name: f1, fn: pkg.mod:f1}]``, default the function's name), the key of the
epoch records' ``test_metrics`` from the worker on (``dynabatch.actors.spec.MetricSpec``).
"""

from __future__ import annotations

import re

NODE_CHARS = 8
_RAY_NODE_ID = re.compile(r"^[0-9a-f]{40,}$")


def node_label(node: str) -> str:
    """A Ray node id cut to its first 8 hex digits; any other name (an address, a host, a
    simulator's node) as it is."""
    return node[:NODE_CHARS] if _RAY_NODE_ID.match(node) else node

"""One Ray cluster of separate nodes for the whole integration tier.

The head has no CPU, so every worker lands on a worker node; each node carries a custom
resource naming it, and ``dynabatch_worker`` so that job specs can select them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from dynabatch.service.raycluster import fast_health_check

NODES = 3


@pytest.fixture(scope="session")
def cluster() -> Iterator[object]:
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": 150 * 2**20,
            "_system_config": fast_health_check(),
        },
    )
    for i in range(NODES):
        c.add_node(num_cpus=1, resources={f"node{i}": 1, "dynabatch_worker": 1},
                   object_store_memory=100 * 2**20)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="dynabatch", log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("condition not met in time")

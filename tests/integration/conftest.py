"""One Ray cluster of separate nodes for the whole integration tier.

The head has no CPU, so every worker lands on a worker node; each node carries a custom
resource naming it, and ``dynabatch_worker`` so that job specs can select them.

Tests add nodes of their own (tagged with a resource only they use); each node added during a
test is removed when the test ends. An idle node is not free: its raylet and dashboard agent
take about 1.4% of a core between them, and the GCS checks every node five times a second,
so the 30 nodes a run used to accumulate cost the rest of the session (the unit tier after
it included) about a fifth of this 2-core machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from dynabatch.service.raycluster import fast_health_check

from tests.conftest import OWN_RAY_MODULES

NODES = 3


def head_node_args() -> dict[str, object]:
    """The session cluster's head: no CPU, fast health checks, and ports that another Ray on
    the host cannot take from it.

    ``cluster_utils`` gives a head Ray's default dashboard port (8265) as an explicit port,
    which Ray does not retry: with another Ray on the host holding it (a module of
    ``OWN_RAY_MODULES`` beside this tier under ``-n 2``, or another session's), the head
    started without a dashboard, and every actor's output, which the job log reads through
    the dashboard's log API, was lost ("Could not read 'dashboard' from GCS"). ``None`` is
    ``ray.init``'s default: 8265 or the next free port. The head's agent port likewise: 0
    lets it bind a free one, as ``dynabatch.service.raycluster.free_agent_port`` does for the
    embedded cluster.
    """
    return {
        "num_cpus": 0,
        "object_store_memory": 150 * 2**20,
        "_system_config": fast_health_check(),
        "dashboard_port": None,
        "dashboard_agent_listen_port": 0,
    }


@pytest.fixture(scope="session")
def cluster() -> Iterator[object]:
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=head_node_args())
    for i in range(NODES):
        c.add_node(
            num_cpus=1,
            resources={f"node{i}": 1, "dynabatch_worker": 1},
            object_store_memory=100 * 2**20,
        )
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="dynabatch", log_to_driver=False)
    _SESSION.append(c)
    yield c
    _SESSION.clear()
    ray.shutdown()
    c.shutdown()


# The session's cluster once a test has asked for it (empty before, and in tests without it).
_SESSION: list = []


@pytest.fixture(autouse=True)
def _remove_the_tests_own_nodes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Remove the nodes that the test itself added, once it ends.

    Nodes present when the test starts stay: the session's, and those of a module-scoped
    fixture (``test_api_elastic``'s). Set up after the session's cluster (pytest sets up wider
    scopes first), so a test that asks for the cluster finds it in ``_SESSION`` here.

    Also refuses a test that uses the cluster from a module listed as starting its own Ray:
    ``pytest -n 2 --dist loadgroup`` would run it beside the cluster's group, in a worker
    that starts a second cluster.
    """
    if "cluster" in request.fixturenames and request.path.name in OWN_RAY_MODULES:
        pytest.fail(
            f"{request.path.name} uses the session cluster: remove it from "
            "OWN_RAY_MODULES in tests/conftest.py"
        )
    before = set(_SESSION[0].worker_nodes) if _SESSION else None
    yield
    if before is None or not _SESSION:
        return
    c = _SESSION[0]
    added = [n for n in c.worker_nodes if n not in before]
    for node in added:
        # The test is over and its jobs have ended: no need to let the node drain.
        c.remove_node(node, allow_graceful=False)


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("condition not met in time")


def find_scheduler() -> Any | None:
    """The cluster's scheduler actor (detached, named), None when none runs."""
    import ray
    from dynabatch.scheduler.runtime.cluster_scheduler import NAMESPACE, SCHEDULER_NAME

    try:
        return ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None

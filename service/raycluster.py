"""Connecting to Ray: an embedded local cluster by default, or an existing one by address.

The embedded cluster runs the Ray dashboard, on loopback only: it and its per-node agents
serve Ray's log API, through which the job log gets every actor's stdout and stderr
(``dynabatch.actors.output``; ``ray[default]`` brings them). A cluster attached by address needs its
own dashboard for that (``ray start --head`` starts one when ``ray[default]`` is installed).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from dynabatch.actors.data.fs import is_uri
from dynabatch.scheduler.runtime.launch import NAMESPACE

# Fast failure detection. The GCS checks each node every 200 ms and declares it dead after 3
# failed checks in a row: a node whose raylet is gone (refused connections) in about 0.5 s
# instead of about 12 s with Ray's defaults (5 checks 3 s apart). A check that gets no answer
# at all waits Ray's health_check_timeout_ms (10 s), so a node that silently drops off the
# network takes about 30 s; a training step sees it sooner through collective_timeout_s.
# The embedded Ray, the integration tests, docker-compose.yml's and deploy/k8s's Ray heads
# use these values (tests/unit/test_deploy_static.py checks that they agree).
# Read-only: Ray adds its own keys to the _system_config dict it is given, so callers pass
# fast_health_check(), a fresh copy.
FAST_HEALTH_CHECK: Mapping[str, Any] = MappingProxyType({
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 200,
    "health_check_failure_threshold": 3,
})


def fast_health_check() -> dict[str, Any]:
    """A fresh, mutable copy of :data:`FAST_HEALTH_CHECK` for one Ray ``_system_config``."""
    return dict(FAST_HEALTH_CHECK)



@contextlib.contextmanager
def free_agent_port() -> Iterator[None]:
    """Within: a Ray node that ``ray.init`` starts lets its dashboard agent pick a free port.

    Ray gives every node's agent, which serves the log API the job log reads its actors'
    output through, the fixed port 52365, and ``ray.init`` has no argument for it (``ray
    start`` has ``--dashboard-agent-listen-port``). A second Ray on the host (a ``dynabatch
    serve`` beside a ``dynabatch run``) then starts without an agent and the user's prints
    are lost. Port 0 is what Ray's own test clusters give their extra nodes: the agent binds
    a free port and registers it, and the log API finds it there."""
    from ray._private import parameter

    base = parameter.RayParams
    # ray.init builds the head's RayParams without this argument, so the 0 is what it gets.
    parameter.RayParams = functools.partial(base, dashboard_agent_listen_port=0)  # type: ignore[misc]
    try:
        yield
    finally:
        parameter.RayParams = base  # type: ignore[misc]


def connect(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    working_dir: str | None = None,
) -> dict[str, Any]:
    """Connect this process to Ray and return ``ray.init``'s context info.

    ``address`` None (and no RAY_ADDRESS) starts an embedded local cluster with
    ``address="local"``, so a stale cluster from another process is never attached.
    ``working_dir``, a local directory, is shipped with this driver's Ray job (Ray uploads
    it; every actor the job starts inherits it): how ``dynabatch run`` ships code. A URI is
    the coordinator's own runtime_env instead (``dynabatch.scheduler.runtime.launch``).
    """
    import ray

    # Ray's token authentication is left as Ray decides (RAY_AUTH_MODE); whoever runs this
    # (the Makefile, the tests, compose, k8s) sets what it needs.
    if ray.is_initialized():
        return {"address": ray.get_runtime_context().gcs_address}
    address = address or os.environ.get("RAY_ADDRESS") or None
    job_env = {"working_dir": working_dir} if working_dir and not is_uri(working_dir) else None
    if address in (None, "", "local"):
        with free_agent_port():
            ctx = ray.init(
                address="local",
                num_cpus=num_cpus or os.cpu_count() or 1,
                # The log API's server (see the module docstring); loopback only.
                include_dashboard=True,
                dashboard_host="127.0.0.1",
                object_store_memory=256 * 2**20,
                namespace=NAMESPACE,
                log_to_driver=False,
                runtime_env=job_env,
                _system_config=fast_health_check(),
            )
    else:
        ctx = ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                       runtime_env=job_env)
    return {"address": ctx.address_info.get("gcs_address", address)}

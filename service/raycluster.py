"""Connecting to Ray: an embedded local cluster by default, or an existing one by address."""

from __future__ import annotations

import os
from typing import Any

# Fast failure detection: a lost node is seen in about a second instead of ~15 s.
FAST_HEALTH_CHECK: dict[str, Any] = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 200,
    "health_check_failure_threshold": 3,
}

NAMESPACE = "dynabatch"


def connect(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    object_store_mb: int = 256,
    namespace: str = NAMESPACE,
) -> dict[str, Any]:
    """Connect this process to Ray and return ``ray.init``'s context info.

    ``address`` None (and no RAY_ADDRESS) starts an embedded local cluster with
    ``address="local"``, so a stale cluster from another process is never attached.
    """
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return {"address": ray.get_runtime_context().gcs_address}
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address in (None, "", "local"):
        ctx = ray.init(
            address="local",
            num_cpus=num_cpus or os.cpu_count() or 1,
            include_dashboard=False,
            object_store_memory=object_store_mb * 2**20,
            namespace=namespace,
            log_to_driver=False,
            _system_config=FAST_HEALTH_CHECK,
        )
    else:
        ctx = ray.init(address=address, namespace=namespace, log_to_driver=False)
    return {"address": ctx.address_info.get("gcs_address", address)}

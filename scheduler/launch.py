"""Launching and finding a job's coordinator actor (``ray.remote`` is applied here)."""

from __future__ import annotations

from typing import Any

import ray

from actors.spec import JobSpec
from scheduler.coordinator import Coordinator
from scheduler.ps_driver import PSCoordinator

NAMESPACE = "dynabatch"  # every job's named actors live here

# snapshot()/cancel() must be served while run() blocks in another thread.
MAX_CONCURRENCY = 16


def coordinator_name(job_id: str) -> str:
    return f"dynabatch-job-{job_id}"


def shipped_code(working_dir: str) -> dict[str, Any]:
    """A runtime_env whose working_dir is a URI every node can fetch.

    An actor's runtime_env takes only URIs: a local directory is zipped into Ray's GCS
    first, the step ``ray.init(runtime_env=...)`` and Ray job submission take themselves
    (Ray has no public function for it; this is the one they call). A URI (``gcs://``,
    ``https://...zip``) passes through unchanged."""
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    return upload_working_dir_if_needed({"working_dir": working_dir}, include_gitignore=True)


def launch_coordinator(
    job_id: str, spec: JobSpec, *, detached: bool, resume: bool = True, start: bool = True
) -> Any:
    """Start the job's coordinator (on a node with no CPU to spare is fine: it asks 0)."""
    options: dict[str, Any] = {
        "name": coordinator_name(job_id),
        "namespace": NAMESPACE,
        "num_cpus": 0,
        "max_concurrency": MAX_CONCURRENCY,
        "max_restarts": 0,
        # On the head node: in compose and k8s the API container is itself a Ray node, and
        # a coordinator placed there would die with every API restart.
        "resources": {"node:__internal_head__": 0.001},
    }
    if detached:
        options["lifetime"] = "detached"
    if spec.working_dir:
        # The user's code goes to every node with the job; the workers the coordinator
        # starts inherit its runtime_env.
        options["runtime_env"] = shipped_code(spec.working_dir)
    # A parameter-server job has its own driver with the same public interface.
    cls = PSCoordinator if spec.protocol.name == "ps" else Coordinator
    handle = ray.remote(cls).options(**options).remote(job_id, spec, resume=resume)
    if start:
        handle.run.remote()
    return handle


def find_coordinator(job_id: str) -> Any | None:
    try:
        return ray.get_actor(coordinator_name(job_id), namespace=NAMESPACE)
    except ValueError:
        return None

"""Launching and finding a job's coordinator actor (``ray.remote`` is applied here)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray
from dynabatch.actors.data.fs import is_uri
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.ps.driver import PSCoordinator
from dynabatch.scheduler.sync.coordinator import Coordinator

NAMESPACE = "dynabatch"  # every job's named actors live here
# The cluster scheduler (scheduler/runtime/cluster_scheduler.py): one per Ray cluster, by name.
SCHEDULER_NAME = "dynabatch-cluster-scheduler"

# snapshot()/cancel() must be served while run() blocks in another thread.
MAX_CONCURRENCY = 16


def coordinator_name(job_id: str, generation: int = 0) -> str:
    """The actor name of the job's coordinator of ``generation`` (0: the first; each resume
    starts the next). A resumed coordinator never needs the name of the one before it: Ray
    keeps a dead actor's name taken while its owner holds a handle to it, as when its
    process was killed outside Ray (``kill -9``, the OOM killer)."""
    base = f"dynabatch-job-{job_id}"
    return base if generation == 0 else f"{base}-g{generation}"


def shipped_code(working_dir: str) -> dict[str, Any] | None:
    """The coordinator's runtime_env for the job's ``working_dir``; its workers inherit it.

    A URI (``file://`` of the service's uploads, ``gcs://``, ``s3://``...) goes to the actor's
    runtime_env as it is, and Ray fetches it on every node. A local directory Ray uploads
    only for a whole Ray job, in its driver's ``ray.init``: shipped that way (``dynabatch
    run`` does), every actor of the job has it already, and None is the answer."""
    if is_uri(working_dir):
        return {"working_dir": working_dir}
    if not (ray.get_runtime_context().runtime_env or {}).get("working_dir"):
        raise ValueError(
            f"working_dir: {working_dir!r} is a local directory, which only a job's own driver "
            "can ship (dynabatch run does); upload it to the service instead (dynabatch submit "
            "--working-dir) or name a URI Ray can fetch")
    return None


def launch_coordinator(
    job_id: str, spec: JobSpec, *, detached: bool, resume: bool = True, start: bool = True,
    generation: int = 0, assignment: Mapping[str, int] | None = None,
    timeout_s: float = 60.0,
) -> Any:
    """Start the job's coordinator of ``generation`` (it asks no CPU). ``assignment`` (the
    cluster scheduler's grant) is in force before ``run`` starts: waited for, up to
    ``timeout_s``, since the threaded actor may run two calls in either order; a refused one
    kills the actor and raises."""
    options: dict[str, Any] = {
        "name": coordinator_name(job_id, generation),
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
        env = shipped_code(spec.working_dir)
        if env is not None:
            options["runtime_env"] = env
    # A parameter-server job has its own driver with the same public interface.
    cls = PSCoordinator if spec.protocol.name == "ps" else Coordinator
    handle = ray.remote(cls).options(**options).remote(job_id, spec, resume=resume)
    if assignment is not None:
        try:
            ray.get(handle.assign.remote(dict(assignment)), timeout=timeout_s)
        except BaseException:
            ray.kill(handle, no_restart=True)
            raise
    if start:
        handle.run.remote()
    return handle


def find_coordinator(job_id: str, generation: int = 0) -> Any | None:
    """The handle of the job's coordinator of ``generation``; None when Ray has none."""
    try:
        return ray.get_actor(coordinator_name(job_id, generation), namespace=NAMESPACE)
    except ValueError:
        return None

"""Whether a spec may be launched: the checks ``JobService`` makes on a new job and on every
relaunch of a stored one (so settings tightened since the job was stored hold too).

The checks answer with a one-line reason or None, so a caller decides what a refusal is (a
422 at submit, a FAILED job at an automatic resume, a 409 at a requested one). A relaunch
also needs the job's checkpoint (:func:`checkpoint_exists`) and starts with
:func:`launch_spec`.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.cluster.ray_nodes import RayNode, gang_error
from dynabatch.service.cluster_client import NodeStatus
from dynabatch.service.store import JobRecord
from dynabatch.service.submit_policy import SpecNotAllowed, SubmitPolicy, check_submission


def min_workers_problem(spec: JobSpec, nodes: Sequence[NodeStatus]) -> str | None:
    """Why no set of the alive ``nodes`` can ever hold the job's ``min_workers`` together,
    or None when they can (or the spec sets no minimum, or no node is listed). Two limits:
    the cluster scheduler's worker slots (:func:`gang_error`, what it can grant) and what
    each node's resources hold of this job's workers (:meth:`JobSpec.workers_on`, what Ray
    can place: a GPU job on CPU nodes, workers of several CPUs). Such a job would only wait
    in the queue for ever."""
    need = spec.min_workers
    alive = [n for n in nodes if n.alive]
    if need is None or not alive:
        return None
    problem = gang_error(
        [RayNode(n.node_id, n.resources) for n in alive],
        need,
        spec.node_resource,
        worker_cpus=spec.worker_cpus,
        worker_gpus=spec.worker_gpus,
    )
    if problem:
        return problem
    short = capacity_problem(spec, alive, need)
    return f"min_workers {need}: {short}; the job could never start" if short else None


def capacity_problem(spec: JobSpec, nodes: Sequence[NodeStatus], workers: int) -> str | None:
    """Why the alive ``nodes`` could never hold ``workers`` of the job's workers at once
    (what each node's resources hold of them: :meth:`JobSpec.workers_on`), or None when
    they can or no node is listed."""
    alive = [n for n in nodes if n.alive]
    if not alive:
        return None
    held = sum(spec.workers_on(n.resources) for n in alive)
    if held >= workers:
        return None
    each = f"{spec.worker_cpus:g} CPU"
    if spec.worker_gpus == "auto" or spec.worker_gpus > 0:
        each += f", {spec.worker_gpus} GPU"
    if spec.node_resource:
        each += f", node_resource {spec.node_resource!r}"
    return (
        f"the cluster's {len(alive)} alive nodes hold {held} of this job's workers ({each} "
        "each)"
    )


def relaunch_refusal(spec: JobSpec, policy: SubmitPolicy) -> str | None:
    """Why a stored ``spec`` may not be launched again under ``policy`` (stored by an
    earlier, more permissive service, say); None when it may."""
    problems = check_submission(spec, policy)
    if not problems:
        return None
    return f"its spec is not allowed by this service's settings ({SpecNotAllowed(problems)})"


def checkpoint_exists(rec: JobRecord) -> bool:
    """Whether the job's spec names a checkpoint dir and its checkpoint file is there.
    The API reads the file where the coordinator writes it: the same filesystem in
    embedded mode, the shared checkpoint volume in compose and k8s."""
    if not rec.spec.checkpoint.dir:
        return False
    # Imports torch: only when needed.
    from dynabatch.scheduler.checkpoint import checkpoint_exists as found

    # A local path or a URI (s3://...): False when it cannot be looked at.
    return found(rec.spec.checkpoint.dir, rec.id)


def launch_spec(rec: JobRecord) -> JobSpec:
    """The spec a job's coordinator starts with: the job's own, at the size last asked for
    with scale or drain (which a checkpoint does not hold)."""
    n = rec.target_workers
    spec = rec.spec
    if n is None or spec.workers == n:
        return spec
    update: dict[str, object] = {"workers": n, "max_workers": n}
    if spec.min_workers is not None and spec.min_workers > n:
        update["min_workers"] = n
    return spec.model_copy(update=update)

"""Building the service from its settings: the store, the cluster client and the JobService.

``create_app`` and ``dynabatch serve`` both call :func:`build_service`.
"""

from __future__ import annotations

from dynabatch.service.job_service import JobService
from dynabatch.service.ray_client import RayClusterClient
from dynabatch.service.settings import Settings
from dynabatch.service.store import JobStore


def build_service(settings: Settings, cluster: RayClusterClient | None = None) -> JobService:
    """The JobService the settings describe: SQLite store and (by default) Ray."""
    if cluster is None:
        cluster = RayClusterClient(
            settings.ray_address,
            num_cpus=settings.ray_num_cpus,
            call_timeout_s=settings.ray_call_timeout_s,
        )
    scheduling = cluster.scheduling(settings) if settings.cluster_scheduler else None
    return JobService(
        JobStore(settings.db_path),
        cluster,
        sync_interval_s=settings.sync_interval_s,
        metrics_retention_s=settings.metrics_retention_s,
        release_finished=settings.release_finished,
        cancel_wait_s=settings.cancel_wait_s,
        auto_resume_limit=settings.auto_resume_limit,
        submit_policy=settings.submit_policy,
        scheduling=scheduling,
    )

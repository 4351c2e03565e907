"""Suite-wide settings.

Hypothesis' per-example deadline is a timing assertion, and timing belongs to bench/, not
to tests: on a loaded 2-core machine a correct example can take longer than 200 ms. The
``too_slow`` health check is off for the same reason. Everything else (the search, the
shrinking, the example database off) is Hypothesis' default.

One OpenMP thread per process: ``make test`` runs two pytest workers on two cores beside
Ray's processes, and torch's default of a thread per core makes each parallel region wait
for a thread another process holds (docs/testing.md, "One OpenMP thread per test process").
Set before anything imports torch; subprocesses and the tests' Ray inherit it. A worker
still sets its own count from its spec's ``worker_cpus``.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "dynabatch", deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
settings.load_profile("dynabatch")


# Integration modules whose tests start their own Ray (in a child process, or a head of their
# own that this process never connects to) and never use the session's cluster: they may run
# beside the others, off the session cluster's worker. (An integration test that asks for
# the cluster fails in tests/integration/conftest.py if its module is listed here.)
OWN_RAY_MODULES = frozenset(
    {
        "test_auto_resume.py",
        "test_gpu_ray_check_own_ray.py",
        "test_session_cluster.py",
        "test_shadowing.py",
    }
)


def xdist_group_of(nodeid: str) -> str | None:
    """The group a test runs in under ``pytest -n 2 --dist loadgroup``, by its path.

    Every integration test that uses the session's ``cluster`` is in one group, so one worker
    starts that cluster once and runs them one after another, as a serial run does. The
    end-to-end tier is one group too: its modules share processes (the Ray head, the API,
    Prometheus, Chromium) held by module- and session-scoped fixtures, which a split would
    start twice. Everything else (the unit tier, the integration tests of OWN_RAY_MODULES)
    is spread over the workers as they free up.
    """
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/e2e/"):
        return "e2e"
    if path.startswith("tests/integration/") and path.rsplit("/", 1)[-1] not in OWN_RAY_MODULES:
        return "ray-cluster"
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadgroup`` with the groups of :func:`xdist_group_of`.

    xdist's own loadgroup reads ``xdist_group`` marks through a node id suffix that the
    workers add at collection, which pytest 9.2 no longer lets them change: every test went
    to whichever worker was free, and each worker started its own cluster. The scheduler
    runs in the controller, which sees node ids only, so the groups are decided from them.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class TierGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid) or nodeid

    return TierGroups(config, log)

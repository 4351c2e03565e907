"""The one definition of how many workers a job's global batch allows
(scheduler/core/membership.py: ``worker_bounds``, ``scale_error``), checked against the
rule itself over every small case, and used by both the coordinator's membership and the
service's scale command."""

from __future__ import annotations

import itertools

from dynabatch.scheduler.core.membership import Membership, scale_error, worker_bounds


def _fits(workers: int, batch: int, max_batch: int | None) -> bool:
    """The rule: every worker gets at least one sample, and max_batch each hold it all."""
    return workers <= batch and (max_batch is None or max_batch * workers >= batch)


def test_scale_error_is_none_exactly_when_every_batch_of_the_range_fits() -> None:
    for smallest, extra, max_batch, workers in itertools.product(
        range(1, 9), range(0, 5), [None, *range(1, 9)], range(1, 14)
    ):
        largest = smallest + extra
        ok = all(_fits(workers, b, max_batch) for b in range(smallest, largest + 1))
        why = scale_error(workers, smallest, largest, max_batch)
        assert (why is None) == ok, (workers, smallest, largest, max_batch, why)
        lo, hi = worker_bounds(smallest, largest, max_batch)
        assert (lo <= workers <= hi) == ok


def test_scale_error_names_the_limit_it_hits() -> None:
    assert scale_error(65, 64, 64, None) == (
        "workers (65) is above the job's global_batch (64): every worker needs at least "
        "one sample per step"
    )
    assert scale_error(1, 64, 64, 32) == (
        "1 workers with max_batch 32 cannot hold the job's global_batch (64)"
    )


def test_membership_takes_its_size_limits_from_the_same_bounds() -> None:
    for batch, max_batch in itertools.product(range(1, 20), [None, *range(1, 20)]):
        m = Membership(
            workers=None,
            min_workers=None,
            max_workers=None,
            smallest_batch=batch,
            max_batch=max_batch,
        )
        assert (m.min_size, m.max_size) == worker_bounds(batch, batch, max_batch)


def test_a_stage_wise_jobs_driver_and_service_agree_on_its_size_limits() -> None:
    """Issue 50: the driver's floor came from the schedule's smallest batch only, the
    service's from the largest too: a job of stages 64 then 256 with max_batch 64 could
    shrink to one worker in the driver, which the service refuses (it cannot hold 256)."""
    from dynabatch.actors.spec import JobSpec
    from dynabatch.scheduler.sync.coordinator import Coordinator

    from tests.fakes import sim_runtime

    spec = JobSpec.model_validate({
        "workers": 4, "min_workers": 1, "max_batch": 64, "epochs": 2, "global_batch": 64,
        "schedule": {"stages": [{"epochs": 1, "global_batch": 64},
                                {"epochs": 1, "global_batch": 256}]},
    })
    smallest, largest = spec.batch_range
    m = Coordinator("job", spec, runtime=sim_runtime(spec, n_train=512, nodes=4)).membership
    lo, hi = worker_bounds(smallest, largest, spec.max_batch)
    assert (m.min_size, m.max_size) == (lo, min(hi, 4)) == (4, 4)
    for n in range(1, 9):  # every size the driver allows, the service's rule allows
        assert (scale_error(n, smallest, largest, spec.max_batch) is None) == (
            lo <= n <= hi), n
        if m.min_size <= n <= m.max_size:
            assert scale_error(n, smallest, largest, spec.max_batch) is None

"""throughput.prior: a prior speed per node type for jobs that have not run there (issue 52)."""

from dynabatch.scheduler.core.cluster.throughput import ThroughputModel


def test_prior_lets_two_equal_new_jobs_span_both_types():
    """Issue 52 item 5: with nothing measured, a prior per node type (the GPU model's
    class, or a cluster file's speed) rates the types apart, so two equal jobs both span
    both types under goodput, where equal hints left them one type each."""
    from dynabatch.scheduler.core.cluster.decision import decide
    from dynabatch.scheduler.core.cluster.throughput import bootstrap, prior
    from dynabatch.scheduler.core.cluster.values import ClusterJob, ClusterKnobs, ClusterNode

    types = ["gpu-H100x2", "gpu-V100x2"]
    nodes = [ClusterNode("h", types[0], 2), ClusterNode("v", types[1], 2)]
    unmeasured = ThroughputModel.of({}, (), overhead_s=0.5, global_batch=1.0)

    def spans(hints: dict[str, float]) -> list[int]:
        models = bootstrap({"a": unmeasured, "b": unmeasured}, types, hints)
        jobs = [ClusterJob(j, 1, 4, models[j]) for j in ("a", "b")]
        decision = decide(nodes, jobs, 0.0, ClusterKnobs(policy="goodput"))
        return [len(p.by_type) for p in decision.plans]

    assert prior(types) == {"gpu-H100x2": 1.0, "gpu-V100x2": 0.3}
    assert prior(["cpu4", "mystery"], {"mystery": 2.0}) == {"cpu4": 0.02, "mystery": 2.0}
    assert spans({t: 1.0 for t in types}) != [2, 2]  # rated alike: no reason to span
    assert spans(prior(types)) == [2, 2]

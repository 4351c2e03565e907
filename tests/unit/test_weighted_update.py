"""The weighted all-reduce makes one process's update, for every kind of loss.

Three workers with shares 5, 11 and 48 of a 64-sample step, in one gloo group of three
processes, take two steps (so SGD's momentum is exercised too); their weights must then
equal those of one process that took the same two steps on all 64 samples, to 1e-5. Checked
for a classifier's cross-entropy (the flat all-reduce, and small buckets with each worker
accumulating micro-batches under a memory cap), a language model's per-token
``next_token`` loss and a regression's ``mse``. The all-reduce's coverage must show each of
the 64 positions once.

The members are the real :class:`~dynabatch.actors.worker.Worker`, as a Ray actor runs it,
in processes of a fork server (``tests/gloo.py``): one set of members runs every
configuration, each in its own group. A user's loss named by import path, whose prints
Ray's log API must return, is checked on Ray actors (``tests/integration/test_training.py``)
with :func:`one_process_weights` and :data:`CUTS` from here.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import torch
from dynabatch.actors.contracts import SegmentPlan, StepPlan
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.actors.workloads.losses import resolve_loss
from dynabatch.actors.workloads.models import build_model

from tests.gloo import run_members_in_groups

SHARES = (5, 11, 48)  # the three workers' shares of one 64-sample step
CUTS = np.cumsum([0, *SHARES])  # where each share starts: 0, 5, 16 (and the end, 64)
STEP = int(CUTS[-1])
LR, MOMENTUM = 0.5, 0.9
TIMEOUT_S = 10  # the group's collective timeout

LM = {
    "dataset": {"name": "pysource", "options": {"chars": 20000, "seq_len": 16}},
    "model": {"name": "charlm", "hidden": 16, "options": {"heads": 2, "layers": 1}},
    "loss": "next_token",
}
REGRESSION = {
    "dataset": {"name": "tests.unit.workload_plugins:regression_loader",
                "options": {"n": 96, "train": 64}},
    "loss": "mse",
}
# Small buckets launched from backward's hooks, and memory caps that make the workers
# accumulate 2, 3 and 3 micro-batches.
ACCUMULATED = {"allreduce": "bucketed", "bucket_kb": 1, "micro_batch": [3, 4, 16]}

# (name, the job's settings): one gloo group of the three members each.
CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("cross_entropy-flat", {"allreduce": "flat"}),
    ("cross_entropy-bucketed-accumulated", ACCUMULATED),
    ("next_token-bucketed", {**LM, "allreduce": "bucketed"}),
    ("mse-flat", {**REGRESSION, "allreduce": "flat"}),
)


def spec_of(**kw: Any) -> JobSpec:
    base: dict[str, Any] = dict(
        name="t", dataset={"name": "digits"}, model={"name": "mlp", "hidden": 32},
        optimizer={"name": "sgd", "lr": LR, "momentum": MOMENTUM}, workers=len(SHARES),
        global_batch=STEP, epochs=2, seed=3, collective_timeout_s=TIMEOUT_S,
    )
    base.update(kw)
    return JobSpec.model_validate(base)


def step_data(spec: JobSpec) -> tuple[np.ndarray, np.ndarray, tuple[int, ...], int]:
    """The first 64 training samples of the job's dataset, with its input shape and
    number of classes."""
    ds = load_dataset(spec.dataset, seed=spec.seed)
    return ds.x_train[:STEP], ds.y_train[:STEP], tuple(ds.input_shape), ds.num_classes


def segment(epoch: int, rank: int, seed: int) -> SegmentPlan:
    """Worker ``rank``'s share of epoch ``epoch``'s one step."""
    return SegmentPlan(epoch, seed, STEP, (StepPlan(0, 0, STEP, int(CUTS[rank]),
                                                    SHARES[rank]),))


def one_process_weights(spec: JobSpec) -> dict[str, torch.Tensor]:
    """The model after the two steps on all 64 samples, in this process."""
    x, y, shape, classes = step_data(spec)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, shape, classes)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss = resolve_loss(spec.loss or "cross_entropy")
    for _ in range(2):
        opt.zero_grad()
        loss(model(torch.from_numpy(x)), torch.from_numpy(y)).mean().backward()
        opt.step()
    return model.state_dict()


def _member(rank: int, rv: Any, more: tuple, data: tuple, out: mp.Queue) -> None:
    """One worker (a child process): the two steps of its share under every configuration,
    each in its own group, on the configuration's ``data`` (loaded once, by the test);
    reports each step's (error, coverage, start, samples, micro batches) and the final
    weights, or the first exception."""
    from dynabatch.actors.worker import Worker

    got = []
    try:
        for group, (_, kw), (x, y, shape, classes) in zip((rv, *more), CONFIGS, data,
                                                           strict=True):
            spec = spec_of(**kw)
            w = Worker(f"w{rank}", rank, spec, x, y, shape, classes)
            w.join(group, rank)
            steps = []
            for epoch in range(2):
                res = w.run_segment(segment(epoch, rank, spec.seed))
                steps.append((res.error, *[(s.coverage, s.start, s.samples, s.micro_batches)
                                           for s in res.steps]))
            weights = {k: v.detach().numpy().copy() for k, v in w.state()["model"].items()}
            w.leave()
            got.append((steps, weights))
        out.put((rank, got))
    except Exception as err:  # reported, so the parent fails with it instead of waiting
        out.put((rank, f"{type(err).__name__}: {err}"))


def test_three_unequal_shares_make_one_process_update_for_every_loss():
    data = tuple(step_data(spec_of(**kw)) for _, kw in CONFIGS)
    got = run_members_in_groups(_member, len(SHARES), len(CONFIGS), lambda rank: (data,),
                                timeout_s=TIMEOUT_S)
    assert sorted(got) == [0, 1, 2], f"members that answered: {sorted(got)}: {got}"
    reports = {rank: report for rank, (report,) in got.items()}
    failed = {r: rep for r, rep in reports.items() if isinstance(rep, str)}
    assert not failed, failed
    for i, (name, kw) in enumerate(CONFIGS):
        ref = one_process_weights(spec_of(**kw))
        caps = kw.get("micro_batch") or [None] * len(SHARES)
        for rank, per_config in reports.items():
            steps, weights = per_config[i]
            for error, *step in steps:
                assert error is None, f"{name}, rank {rank}: {error}"
                ((coverage, start, samples, micro_batches),) = step
                # The all-reduce itself saw each of the 64 positions exactly once.
                assert coverage == ((1, STEP),) and start == CUTS[rank], (name, rank)
                cap = caps[rank]
                assert micro_batches == (-(-samples // cap) if cap else 1), (name, rank)
            for k, v in ref.items():
                np.testing.assert_allclose(weights[k], v.numpy(), rtol=0, atol=1e-5,
                                           err_msg=f"{name}, rank {rank}, {k}")

"""Evaluation off the critical path: the held-out set split across the holders gives the
scores one worker gives over the whole set (perplexity and a user metric included), and
the bookkeeping of shards in flight (arrivals, losses, deadlines, rounds dropped)."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dynabatch.actors.spec import parse_spec
from dynabatch.actors.worker import Worker
from dynabatch.actors.workloads.objective import objective_for
from dynabatch.scheduler.runtime.seam import ShardResult
from dynabatch.scheduler.sim.timeline import SimClock
from dynabatch.scheduler.sync.evaluation import EvalRound, Evaluations, combine, split
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes import evaluate

P = "tests.unit.workload_plugins"
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ split and combine
@given(n=st.integers(0, 10_000),
       weights=st.lists(st.one_of(st.floats(0.01, 1e4), st.just(0.0), st.just(float("nan"))),
                        min_size=1, max_size=12))
def test_split_covers_the_set_once_in_order_in_proportion(n, weights):
    named = {f"w{i}": w for i, w in enumerate(weights)}
    shards = split(n, named)
    covered = [i for lo, hi in shards.values() for i in range(lo, hi)]
    assert covered == list(range(n))  # contiguous, in worker order, each sample once
    good = [w for w in weights if w > 0]
    fill = sum(good) / len(good) if good else 1.0
    eff = [w if w > 0 else fill for w in weights]  # NaN and 0 count as the mean
    for name, w in zip(named, eff, strict=True):
        lo, hi = shards.get(name, (0, 0))
        assert abs((hi - lo) - n * w / sum(eff)) < 1.0
    assert all(hi > lo for lo, hi in shards.values())  # no empty shard is sent


def test_split_follows_throughput():
    assert split(100, {"fast": 3.0, "slow": 1.0}) == {"fast": (0, 75), "slow": (75, 100)}
    assert split(0, {"a": 1.0}) == {}
    with pytest.raises(ValueError):
        split(-1, {"a": 1.0})


def test_combine_adds_every_key():
    assert combine([{"n": 2, "loss": 1.0}, {"n": 3, "loss": 0.5, "m": 1.0}]) == {
        "n": 5.0, "loss": 1.5, "m": 1.0}


def test_the_bookkeeping_is_pure():
    code = ("import dynabatch.scheduler.sync.evaluation, sys; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch')); "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------ split equals single
def _shards(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    bounds = [0, *sorted(c % (n + 1) for c in cuts), n]
    return list(itertools.pairwise(bounds))


def _split_scores(obj, model, x, y, cuts, batch=3):
    parts = [obj.eval_sums(model, x, y, lo, hi, torch.device("cpu"), batch)
             for lo, hi in _shards(len(y), cuts)]
    return obj.finish(combine(parts))


@settings(deadline=None, max_examples=30)
@given(cuts=st.lists(st.integers(0, 1000), max_size=5), seed=st.integers(0, 2**16))
def test_split_equals_single_for_perplexity_and_token_accuracy(cuts, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(11, 6, 9, generator=g)
    y = torch.randint(0, 9, (11, 6), generator=g).numpy()
    spec = parse_spec({"loss": "next_token", "metrics": ["perplexity", "accuracy"]})
    obj = objective_for(spec, "tokens")
    model = torch.nn.Identity()
    single = evaluate(obj, model, logits.numpy(), y, torch.device("cpu"))
    split_ = _split_scores(obj, model, logits.numpy(), y, cuts)
    assert split_.keys() == single.keys() == {"loss", "perplexity", "accuracy"}
    for k in single:
        assert math.isclose(split_[k], single[k], rel_tol=1e-6), k
    # perplexity is exp of the mean, not the mean of the shards' perplexities
    assert math.isclose(single["perplexity"], math.exp(single["loss"]), rel_tol=1e-6)


@settings(deadline=None, max_examples=30)
@given(cuts=st.lists(st.integers(0, 1000), max_size=5), seed=st.integers(0, 2**16))
def test_split_equals_single_for_a_user_metric(cuts, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(13, 4, generator=g)
    y = torch.randint(0, 4, (13,), generator=g).numpy()
    spec = parse_spec({"metrics": ["accuracy", f"{P}:top2_metric"]})
    obj = objective_for(spec, "classes")
    model = torch.nn.Identity()
    single = evaluate(obj, model, logits.numpy(), y, torch.device("cpu"))
    split_ = _split_scores(obj, model, logits.numpy(), y, cuts)
    assert split_.keys() == single.keys()
    for k in single:
        assert math.isclose(split_[k], single[k], rel_tol=1e-6, abs_tol=1e-12), k


def test_workers_shards_add_up_to_one_workers_whole_set():
    spec = parse_spec({"dataset": {"name": "synthetic"}, "model": {"name": "mlp", "hidden": 8},
                       "workers": 1, "global_batch": 16,
                       "metrics": ["accuracy", f"{P}:top2_metric"]})
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    w = Worker("w0", 0, spec, x, y, (4,), 3)
    xt = rng.normal(size=(37, 4)).astype(np.float32)
    yt = rng.integers(0, 3, size=37)
    whole = evaluate(w.objective, w.model, xt, yt, w.device, batch=8)
    shards = [w.evaluate_shard(xt, yt, lo, hi, batch=8)
              for lo, hi in split(37, {"a": 2.0, "b": 1.0, "c": 0.5}).values()]
    assert all(s["seconds"] >= 0 for s in shards)
    scores = w.objective.finish(combine(s["sums"] for s in shards))
    assert scores.keys() == whole.keys()
    for k in whole:
        assert math.isclose(scores[k], whole[k], rel_tol=1e-6), k


def late_metric(outputs, targets):
    """Passes the load-time check on two samples; raises on a real batch."""
    if len(targets) > 2:
        raise ValueError(f"cannot score {len(targets)} samples at once\nsecond line")
    return torch.zeros(len(targets))


def test_a_metric_that_raises_on_real_batches_is_named_in_the_error():
    from dynabatch.actors.workloads import WorkloadError
    from dynabatch.actors.workloads.objective import check_objective

    spec = parse_spec({"metrics": ["accuracy", "tests.unit.test_evaluation:late_metric"]})
    x = np.eye(4, dtype=np.float32)[[0, 1, 2, 3, 0, 1]]
    y = np.array([0, 1, 2, 3, 0, 1])
    model = torch.nn.Identity()
    obj = check_objective(spec, model, x, y)  # two samples: it passes
    with pytest.raises(WorkloadError) as err:
        obj.eval_sums(model, x, y, 0, 6, torch.device("cpu"), batch=3)
    assert str(err.value) == (
        "metrics.1: 'tests.unit.test_evaluation:late_metric' failed on this dataset and "
        "model (ValueError: cannot score 3 samples at once)")


# ------------------------------------------------------------------ rounds in flight
class _Runtime:
    """Answers what the test says, when it says."""

    def __init__(self):
        self.tickets: list[list[ShardResult]] = []

    def submit_evaluation(self, shards):
        t: list[ShardResult] = []
        self.tickets.append(t)
        return t

    def poll_evaluation(self, ticket, timeout_s):
        out = list(ticket)
        ticket.clear()
        return out

    def finish_evaluation(self, sums):
        return {"loss": sums["loss"] / sums["n"]}


def _ok(w, n, secs=0.1):
    return ShardResult(w, {"n": float(n), "loss": float(n)}, secs)


def test_a_round_is_ready_when_every_shard_answered_and_its_epoch_ended():
    clock, rt = SimClock(), _Runtime()
    ev = Evaluations(rt, clock, timeout_s=10.0)
    r = ev.submit(0, {"a": (0, 6), "b": (6, 10)})
    rt.tickets[0].append(_ok("a", 6, 0.3))
    ev.poll()
    assert not r.done and ev.ready() == []
    rt.tickets[0].append(_ok("b", 4, 0.1))
    ev.poll()
    assert r.done and ev.ready() == []  # not attached to its epoch's record yet
    r.record = "record"
    assert ev.ready() == [r] and not ev.rounds
    assert r.complete and r.sums() == {"n": 10.0, "loss": 10.0}
    assert r.critical_s == pytest.approx(0.3) and r.hidden_s == pytest.approx(0.1)


def test_a_lost_or_late_shard_leaves_the_round_without_scores():
    clock, rt = SimClock(), _Runtime()
    ev = Evaluations(rt, clock, timeout_s=10.0)
    lost = ev.submit(0, {"a": (0, 5), "b": (5, 10)})
    lost.record = "r0"
    rt.tickets[0] += [_ok("a", 5), ShardResult("b", error="died", lost=True)]
    late = ev.submit(1, {"a": (0, 5), "b": (5, 10)})
    late.record = "r1"
    rt.tickets[1].append(_ok("a", 5))
    ev.poll()
    assert lost.done and not lost.complete and lost.sums() is None
    assert set(lost.failures) == {"b"} and lost.failures["b"].lost
    assert ev.ready() == [lost]
    clock.sleep(11.0)
    ev.poll()  # past its deadline: b is counted as failed, not lost
    assert late.done and not late.complete and not late.failures["b"].lost
    assert "timed out" in late.failures["b"].error
    assert ev.ready() == [late]


def test_settle_waits_up_to_the_deadline_and_charges_the_wait():
    clock, rt = SimClock(), _Runtime()
    ev = Evaluations(rt, clock, timeout_s=2.0)
    r = ev.submit(0, {"a": (0, 5)})
    r.record = "r"
    assert ev.settle() == [r]
    assert clock.now() >= 2.0 and r.waited_s >= 2.0 and r.critical_s >= 2.0
    assert not r.complete


def test_a_round_sent_ahead_of_a_failed_segment_is_dropped():
    clock, rt = SimClock(), _Runtime()
    ev = Evaluations(rt, clock, timeout_s=10.0)
    kept = ev.submit(0, {"a": (0, 5)})
    kept.record = "r0"
    ev.submit(1, {"a": (0, 5)})
    assert ev.unattached(1) is not None and ev.unattached(0) is None
    ev.discard(1)
    assert ev.rounds == [kept]
    empty = EvalRound(2, {}, None, 0.0, 1.0)
    assert empty.done and not empty.complete and empty.sums() is None


def test_every_runtime_implements_the_runtime_protocol():
    """The coordinator drives Ray and the simulator through one protocol, with no
    optional part: every runtime sends ahead, takes plan updates, keeps spares and
    evaluates in shards."""
    from dynabatch.scheduler.runtime.ray_runtime import RayRuntime
    from dynabatch.scheduler.runtime.seam import Runtime
    from dynabatch.scheduler.sim.runtime import SimRuntime

    methods = {n for n, v in vars(Runtime).items() if callable(v) and not n.startswith("_")}
    assert {"submit_evaluation", "poll_evaluation", "finish_evaluation", "submit_segment",
            "collect_segment", "update_segment", "start_spare", "stop_spare",
            "lost_spares"} <= methods
    for cls in (RayRuntime, SimRuntime):
        missing = {n for n in methods if not callable(getattr(cls, n, None))}
        assert not missing, (cls.__name__, missing)


def test_a_shard_that_raised_a_user_error_says_so_on_ray(monkeypatch):
    """What a worker's ``evaluate_shard`` raised reaches the driver as a Ray task error: a
    user error in it (a token id beyond the vocabulary) is marked, so the job fails at once
    as it does in training; any other error stays a failure to retry."""
    from dynabatch.actors.workloads.hf import TokenIdError
    from dynabatch.scheduler.runtime import ray_runtime
    from ray.exceptions import RayTaskError

    raised = {"a": TokenIdError("token id 60 is at or above the model's vocab_size 50"),
              "b": ValueError("bad shape")}
    monkeypatch.setattr(ray_runtime.ray, "wait", lambda refs, **_: (list(refs), []))

    def get(ref, **_):
        raise RayTaskError("evaluate_shard", "Traceback ...", raised[ref]).as_instanceof_cause()

    monkeypatch.setattr(ray_runtime.ray, "get", get)
    out = {r.worker: r for r in ray_runtime.RayRuntime.poll_evaluation(
        None, {"a": "w0", "b": "w1"}, 0.0)}
    assert out["w0"].user and not out["w0"].lost and "token id 60" in out["w0"].error
    assert not out["w1"].user and "bad shape" in out["w1"].error

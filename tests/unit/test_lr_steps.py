"""Per-step learning-rate schedules (issue 54 item 3): ``optimizer.lr_scheduler.interval:
step`` steps any torch.optim.lr_scheduler class or a user's ``make(optimizer, **options)``
after each committed optimizer step; the rate at the job's step k is a pure function of k,
the same when a node is lost and its steps are retried."""

from __future__ import annotations

import pytest
from dynabatch.actors.spec import SpecError, parse_spec
from dynabatch.scheduler.sync.coordinator import Coordinator

from tests.fakes import Lineages, sim_runtime

N_TRAIN = 64  # 4 steps of 16 per epoch
LR = 0.1
WARMUP = {"name": "tests.unit.optim_plugins:warmup_then_decay",
          "options": {"warmup": 3, "total": 12}, "interval": "step"}


class _Rates(Lineages):
    """Lineages that keep every attempt's learning rate, by (epoch, step)."""

    def __init__(self) -> None:
        super().__init__()
        self.rates: dict[tuple[int, int], set[float]] = {}

    def step(self, seed, epoch, dataset_size, shares, rule=None, caps=None, *, workers=()):
        for sp in shares:
            self.rates.setdefault((epoch, sp.step), set()).add(sp.lr)
        return super().step(seed, epoch, dataset_size, shares, rule, caps, workers=workers)


def _run(sched: dict, events: list[dict] | None = None) -> tuple[Coordinator, _Rates]:
    spec = parse_spec({"workers": 3, "global_batch": 16, "epochs": 3,
                       "optimizer": {"lr": LR, "lr_scheduler": sched}})
    rates = _Rates()
    rt = sim_runtime(spec, n_train=N_TRAIN, gradients=rates, events=events,
                     speeds={0: 1000, 1: 500, 2: 250})
    coord = Coordinator("job", spec, resume=False, runtime=rt, clock=rt.clock)
    coord.run()
    return coord, rates


def _want(k: int) -> float:
    return LR * (k / 3 if k < 3 else (12 - k) / 9)


def test_a_user_schedule_steps_per_optimizer_step_the_same_with_a_lost_node():
    coord, rates = _run(WARMUP)
    assert coord.snapshot().state.value == "SUCCEEDED"
    assert sorted(rates.rates) == [(e, s) for e in range(3) for s in range(4)]
    for (e, s), seen in rates.rates.items():
        assert len(seen) == 1 and next(iter(seen)) == pytest.approx(_want(e * 4 + s)), (e, s)
    # A node lost mid-epoch: its step is retried on the others at the same rate, and every
    # later step k still trains at the rate after k scheduler steps.
    coord, lost = _run(WARMUP, events=[{"epoch": 1, "step": 2,
                                        "fail": {"class": "node01", "index": 0}}])
    assert coord.snapshot().state.value == "SUCCEEDED"
    assert len(coord.history()[-1].workers) == 2  # the node is gone
    assert lost.rates.keys() == rates.rates.keys()
    for key, seen in lost.rates.items():
        assert len(seen) == 1 and seen == rates.rates[key], key


def test_a_torch_class_steps_per_step_and_per_epoch_as_asked():
    step = {"name": "StepLR", "options": {"step_size": 2, "gamma": 0.5}, "interval": "step"}
    _, rates = _run(step)
    assert {k: next(iter(v)) for k, v in rates.rates.items()} == {
        (e, s): pytest.approx(LR * 0.5 ** ((e * 4 + s) // 2))
        for e in range(3) for s in range(4)}
    _, per_epoch = _run({**step, "interval": "epoch"})
    assert {k: next(iter(v)) for k, v in per_epoch.rates.items()} == {
        (e, s): pytest.approx(LR * 0.5 ** (e // 2)) for e in range(3) for s in range(4)}


def test_bad_schedules_are_one_line_naming_the_field():
    from dynabatch.service.submit_policy import check_builtin_options

    spec = parse_spec({"optimizer": {"lr_scheduler": {"name": "StepLR", "interval": "step"}}})
    assert check_builtin_options(spec) == [
        ("optimizer.lr_scheduler.options", "StepLR needs step_size (no default)")]
    with pytest.raises(SpecError, match=r"^optimizer\.lr_scheduler\.interval: Input should be"):
        parse_spec({"optimizer": {"lr_scheduler": {"name": "StepLR", "interval": "batch"}}})
    with pytest.raises(SpecError, match=r"^optimizer\.lr_scheduler\.interval: step counts "
                       r"optimizer steps over the job: it needs a fixed global batch"):
        parse_spec({"epochs": 2, "optimizer": {"lr_scheduler": {
            "name": "StepLR", "options": {"step_size": 1}, "interval": "step"}},
            "schedule": {"mode": "stages", "stages": [{"epochs": 1, "global_batch": 8},
                                                      {"epochs": 1, "global_batch": 16}]}})


def test_an_import_path_schedule_is_confined_like_other_user_code():
    from dynabatch.service.submit_policy import check_user_code

    spec = parse_spec({"optimizer": {"lr_scheduler": {"name": "evil.mod:make"}}})
    assert [f for f, _ in check_user_code(spec, ())] == ["optimizer.lr_scheduler.name"]
    assert check_user_code(spec, ("evil",)) == []

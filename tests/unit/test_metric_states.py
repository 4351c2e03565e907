"""Whole-evaluation metrics (torchmetrics): each worker accumulates its shard's states, the
driver merges them and computes once, which equals one process's value on the whole set
for any split over 1-8 workers of any shares."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from dynabatch.actors.spec import SpecError, parse_spec
from dynabatch.actors.workloads import WorkloadError
from dynabatch.actors.workloads.metric_states import split_scores
from dynabatch.actors.workloads.objective import check_objective, objective_for
from dynabatch.scheduler.sync.evaluation import combine, split
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import confusion_matrix, f1_score, roc_auc_score

from tests.fakes import evaluate

P = "tests.unit.workload_plugins"
CPU = torch.device("cpu")
CLASSIFY = ["f1", {"name": "f1_micro", "fn": "f1", "average": "micro"},
            {"name": "f1_weighted", "fn": "f1", "average": "weighted"}, "precision", "recall",
            "auroc", "confusion_matrix", "accuracy", f"{P}:MisclassifiedCount"]
shares = st.lists(st.floats(0.01, 100.0), min_size=1, max_size=8)


def _merged(obj, model, x, y, weights, batch):
    """The driver's scores from the workers' shards (in proportion to ``weights``), each
    shard's sums pickled as they travel from a worker."""
    shards = split(len(y), {f"w{i}": w for i, w in enumerate(weights)})
    parts = [pickle.loads(pickle.dumps(obj.eval_sums(model, x, y, lo, hi, CPU, batch)))
             for lo, hi in shards.values()]
    return obj.finish(combine(parts))


def _close(a, b) -> bool:
    if isinstance(a, list):
        return np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


@settings(deadline=None, max_examples=10)
@given(weights=shares, seed=st.integers(0, 2**16), n=st.integers(8, 60),
       classes=st.integers(2, 6), batch=st.integers(2, 16))
def test_classification_merged_over_any_split_equals_one_process(weights, seed, n, classes,
                                                                  batch):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, classes, generator=g).numpy()
    y = torch.randint(0, classes, (n,), generator=g).numpy()
    y[:classes] = np.arange(classes)  # every class present (AUROC per class is defined)
    obj = objective_for(parse_spec({"metrics": CLASSIFY}), "classes")
    model = torch.nn.Identity()
    single = evaluate(obj, model, logits, y, CPU, batch=n)
    merged = _merged(obj, model, logits, y, weights, batch)
    assert merged.keys() == single.keys()
    for k in single:
        assert _close(merged[k], single[k]), k
    # ... and one process's value is the textbook one.
    pred = logits.argmax(-1)
    assert _close(single["f1"], f1_score(y, pred, average="macro", zero_division=0))
    assert _close(single["f1_micro"], f1_score(y, pred, average="micro", zero_division=0))
    assert _close(single["f1_weighted"],
                  f1_score(y, pred, average="weighted", zero_division=0))
    assert single["confusion_matrix"] == confusion_matrix(y, pred,
                                                          labels=range(classes)).tolist()
    probs = torch.softmax(torch.from_numpy(logits), -1).numpy()
    want = (roc_auc_score(y, probs[:, 1]) if classes == 2
            else roc_auc_score(y, probs, multi_class="ovr", average="macro"))
    assert _close(single["auroc"], want)
    assert single["MisclassifiedCount"] == float((pred != y).sum())


@settings(deadline=None, max_examples=8)
@given(weights=shares, seed=st.integers(0, 2**16), n=st.integers(4, 40),
       batch=st.integers(2, 16))
def test_tokens_and_a_binary_logit_merge_too(weights, seed, n, batch):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 5, 4, generator=g).numpy()
    y = torch.randint(0, 4, (n, 5), generator=g).numpy()
    obj = objective_for(parse_spec({"loss": "next_token", "metrics": ["f1", "perplexity"]}),
                        "tokens")
    model = torch.nn.Identity()
    single, merged = (evaluate(obj, model, logits, y, CPU, batch=n),
                      _merged(obj, model, logits, y, weights, batch))
    assert all(_close(merged[k], single[k]) for k in single)
    assert _close(single["f1"], f1_score(y.ravel(), logits.argmax(-1).ravel(),
                                         average="macro", zero_division=0))
    # One logit per sample: a binary classifier.
    z = torch.randn(n, 1, generator=g).numpy()
    b = (torch.rand(n, generator=g) > 0.5).long().numpy()
    b[:2] = [0, 1]
    obj = objective_for(parse_spec({"loss": f"{P}:bce_loss", "metrics": ["f1", "auroc"]}),
                        "classes")
    single, merged = (evaluate(obj, model, z, b, CPU, batch=n),
                      _merged(obj, model, z, b, weights, batch))
    assert all(_close(merged[k], single[k]) for k in single)
    assert _close(single["auroc"], roc_auc_score(b, z[:, 0]))


@settings(deadline=None, max_examples=10)
@given(weights=shares, seed=st.integers(0, 2**16), n=st.integers(4, 60),
       batch=st.integers(2, 16))
def test_regression_merged_over_any_split_equals_one_process(weights, seed, n, batch):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(n, 1, generator=g).numpy()
    y = (torch.randn(n, generator=g) * 3).numpy().astype(np.float32)
    obj = objective_for(parse_spec({"loss": "mse", "metrics": ["mae", "rmse", "r2", "mse"]}),
                        "values")
    model = torch.nn.Identity()
    single = evaluate(obj, model, out, y, CPU, batch=n)
    merged = _merged(obj, model, out, y, weights, batch)
    for k in single:
        assert _close(merged[k], single[k]), k
    err = out[:, 0] - y
    assert _close(single["mae"], float(np.abs(err).mean()))
    assert _close(single["rmse"], float(np.sqrt((err ** 2).mean())))
    assert _close(single["r2"], 1 - float((err ** 2).sum() / ((y - y.mean()) ** 2).sum()))


def test_states_travel_as_numpy_and_matrices_are_kept_apart():
    obj = objective_for(parse_spec({"metrics": ["f1", "confusion_matrix"]}), "classes")
    x = np.eye(3, dtype=np.float32)[[0, 1, 2, 1]]
    sums = obj.eval_sums(torch.nn.Identity(), x, np.array([0, 1, 1, 1]), 0, 4, CPU)
    for payloads in sums["states"].values():
        for p in payloads:
            assert all(isinstance(v, np.ndarray | list) for v in p["state"].values())
    scalars, matrices = split_scores(obj.finish(sums))
    assert matrices == {"confusion_matrix": [[1, 0, 0], [0, 2, 1], [0, 0, 0]]}
    assert set(scalars) == {"loss", "f1"}


def test_a_metric_that_does_not_fit_names_its_field():
    spec = parse_spec({"metrics": ["accuracy", f"{P}:NeedsArguments"]})
    x, y = np.zeros((2, 3), np.float32), np.array([0, 1])
    with pytest.raises(WorkloadError, match=r"^metrics\.1: .*NeedsArguments.* without"):
        check_objective(spec, torch.nn.Identity(), x, y)
    spec = parse_spec({"loss": "mse", "metrics": ["auroc"]})
    with pytest.raises(WorkloadError, match=r"^metrics\.0: 'auroc' failed"):
        check_objective(spec, torch.nn.Identity(), np.zeros((2, 2), np.float32),
                        np.zeros((2, 2), np.float32))


@pytest.mark.parametrize(("metrics", "error"), [
    (["accuracy", "fscore"], "metrics.1: unknown metric 'fscore': use accuracy, "),
    ([{"fn": "f1", "average": "binary"}],
     "metrics.0.average: 'binary' is not an average of f1: use macro, micro, weighted"),
    ([{"fn": "auroc", "average": "micro"}],
     "metrics.0.average: 'micro' is not an average of auroc: use macro, weighted"),
    ([{"fn": "mae", "average": "macro"}], "metrics.0.average: 'mae' takes no average"),
])
def test_bad_metric_options_are_one_line_naming_the_field(metrics, error):
    with pytest.raises(SpecError) as info:
        parse_spec({"metrics": metrics})
    assert str(info.value).startswith(error) and "\n" not in str(info.value)


def test_a_confusion_matrix_cannot_judge_the_best_epoch():
    with pytest.raises(SpecError, match=r"^early_stopping\.metric: 'confusion_matrix' is not "
                       "a metric this job computes: use one of loss, f1$"):
        parse_spec({"metrics": ["f1", "confusion_matrix"],
                    "early_stopping": {"metric": "confusion_matrix", "mode": "max"}})


def test_the_driver_keeps_the_confusion_matrix_in_history_report_and_tensorboard(tmp_path):
    """A whole job on the simulator with real gradients: the holders' shards of the held-out
    set merge into one confusion matrix, kept in the record (so the history and the run's
    report), written to TensorBoard as an image; f1 is a number beside it."""
    from dynabatch.api.cli.run import write_report
    from dynabatch.scheduler.sim.gradients import GradientEngine
    from dynabatch.scheduler.sync.coordinator import Coordinator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.fakes import sim_runtime

    spec = parse_spec({"name": "cm", "dataset": {"name": "digits", "limit": 200},
                       "model": {"name": "mlp", "hidden": 8}, "workers": 3,
                       "global_batch": 32, "epochs": 2,
                       "metrics": ["accuracy", "f1", "confusion_matrix"],
                       "tracking": {"tensorboard": str(tmp_path / "tb")}})
    eng = GradientEngine(spec)
    rt = sim_runtime(spec, n_train=eng.n_train, gradients=eng, speeds={0: 500.0, 2: 2000.0})
    coord = Coordinator("job1", spec, resume=False, runtime=rt, clock=rt.clock)
    coord.run()
    history = coord.history()
    assert len(history) == 2
    for r in history:
        cm = np.asarray(r.test_matrices["confusion_matrix"])
        assert cm.shape == (10, 10) and cm.sum() == 100  # sim_runtime scores 100 samples
        assert math.isclose(np.trace(cm) / cm.sum(), r.test_metrics["accuracy"], rel_tol=1e-6)
        assert set(r.test_metrics) == {"accuracy", "f1"}
    write_report(tmp_path / "report.json", spec, coord.snapshot(), history)
    import json
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["history"][-1]["test_matrices"]["confusion_matrix"] == \
        history[-1].test_matrices["confusion_matrix"]
    acc = EventAccumulator(str(tmp_path / "tb" / "job1"), size_guidance={"images": 0})
    acc.Reload()
    images = acc.Images("epoch/test_confusion_matrix")
    assert [i.step for i in images] == [0, 1] and images[0].width == 160


def test_states_that_arrive_read_only_merge_without_a_warning_in_the_jobs_log():
    """Ray's object store hands the driver the workers' states as read-only arrays; a tensor
    over one made torch warn, once a process (so in a fresh one here), of "undefined
    behavior" in the job's log."""
    script = (
        "import warnings, numpy as np\n"
        "from dynabatch.actors.spec import parse_spec\n"
        "from dynabatch.actors.workloads.objective import objective_for\n"
        "import torch\n"
        "obj = objective_for(parse_spec({'metrics': ['f1', 'auroc']}), 'classes')\n"
        "x = np.eye(3, dtype=np.float32)[[0, 1, 2, 1]]\n"
        "sums = obj.eval_sums(torch.nn.Identity(), x, np.array([0, 1, 1, 1]), 0, 4,\n"
        "                     torch.device('cpu'))\n"
        "def frozen(a):\n"
        "    if isinstance(a, np.ndarray):\n"
        "        a = a.copy(); a.flags.writeable = False\n"
        "    return a\n"
        "from torch.utils._pytree import tree_map\n"
        "sums['states'] = tree_map(frozen, sums['states'])\n"
        "warnings.filterwarnings('error', message='.*not writable')\n"
        "print(obj.finish(sums)['f1'])\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout) == pytest.approx(f1_score([0, 1, 1, 1], [0, 1, 2, 1],
                                                       average="macro"))


def test_a_worker_whose_metrics_are_built_in_sums_never_imports_torchmetrics():
    """torchmetrics' import (its text metrics pull in transformers, its audio ones scipy)
    took 3.5 s of every worker's and spare's start on this machine: a job whose metrics
    are plain sums (the defaults) starts without it; one that names a stateful metric
    loads it then."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from dynabatch.actors.spec import JobSpec\n"
        "from dynabatch.actors.workloads.objective import objective_for\n"
        "objective_for(JobSpec(), 'classes')\n"
        "print('torchmetrics' in sys.modules)\n"
        "objective_for(JobSpec(metrics=[{'fn': 'f1'}]), 'classes')\n"
        "print('torchmetrics' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]

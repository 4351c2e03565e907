"""JobSpec validation: one-line, field-named errors; combinations; warnings."""

from __future__ import annotations

import typing
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dynabatch.actors.spec import JobSpec, SpecError, load_spec, parse_spec
from dynabatch.service.submit_policy import (
    SubmitPolicy,
    check_paths,
    check_submission,
    check_user_code,
    module_allowed,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]


def error_of(data) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    text = str(info.value)
    assert "\n" not in text and "\r" not in text, text  # ONE line
    assert text == "; ".join(info.value.problems)
    return text


def test_defaults_are_valid():
    spec = parse_spec({})
    assert spec == JobSpec()
    assert spec.workers == 2 and spec.initial_workers == 2
    assert not spec.emulated


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"bogus_field": 1}, "bogus_field: unknown field"),
        ({"optimizer": {"lr": -1}}, "optimizer.lr: "),
        ({"optimizer": {"lr": "fast"}}, "optimizer.lr: "),
        ({"optimizer": {"name": "lbfgs"}}, "optimizer.name: "),
        ({"optimizer": {"betas": [0.9, 0.99]}}, "optimizer.betas: unknown field"),
        ({"model": {"hiden": 3}}, "model.hiden: unknown field"),
        ({"model": {"name": "transformer"}}, "model.name: unknown model 'transformer'"),
        ({"dataset": {"name": "imagenet"}}, "dataset.name: unknown dataset 'imagenet'"),
        ({"dataset": {"test_fraction": 1.5}}, "dataset.test_fraction: "),
        ({"global_batch": 0}, "global_batch: "),
        ({"global_batch": 12.5}, "global_batch: "),
        ({"epochs": "many"}, "epochs: "),
        ({"policy": "fifo"}, "policy: "),
        ({"rebalance": {"mode": "always"}}, "rebalance.mode: "),
        ({"rebalance": {"threshold": 1.0}}, "rebalance.threshold: "),
        ({"name": "has space"}, "name: "),
        ({"device": "tpu"}, "device: "),
        ({"emulation": {"slowdowns": [1, 0.5]}}, "emulation.slowdowns.1: "),
        ({"emulation": {"disturbances": [{"worker": 0}]}}, "emulation.disturbances.0.factor: "),
        # Fault injection is no part of a job spec (tests inject a worker's errors themselves).
        ({"emulation": {"errors": [{"worker": 1, "epoch": 0, "step": 3}]}},
         "emulation.errors: unknown field"),
        ({"checkpoint": {"every_epochs": 0}}, "checkpoint.every_epochs: "),
    ],
)
def test_wrong_field_gives_one_line_naming_it(data, expected):
    text = error_of(data)
    assert text.startswith(expected), text
    assert text.count(";") == 0, text  # exactly one problem


@pytest.mark.parametrize(
    "workers", [0, 4097, -1, "many", "", True, False, 2.5, None, [2], "4", "7", 3.0, 7.0]
)
def test_bad_worker_count_is_one_clear_error(workers):
    # One message for the int | 'auto' union, not one per member.
    assert error_of({"workers": workers}) == (
        "workers: must be an integer between 1 and 4096, or 'auto'"
    )


@pytest.mark.parametrize(("workers", "expected"), [("auto", "auto"), (3, 3), (64, 64)])
def test_good_worker_counts(workers, expected):
    spec = parse_spec({"workers": workers, "emulation": {}})
    assert spec.workers == expected
    assert spec.initial_workers == (None if expected == "auto" else expected)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"workers": 2, "min_workers": 3, "max_workers": 2}, "min_workers: "),
        ({"workers": 1, "min_workers": 2}, "workers: workers (1) is below min_workers (2)"),
        ({"workers": 5, "max_workers": 4}, "workers: workers (5) is above max_workers (4)"),
        ({"workers": 8, "global_batch": 4}, "global_batch: global_batch (4) is smaller than"),
        ({"workers": 4, "global_batch": 64, "max_batch": 15}, "max_batch: max_batch (15)"),
        ({"workers": 4, "emulation": {"slowdowns": [1, 2]}}, "emulation.slowdowns: "),
        (
            {"workers": 2, "emulation": {"disturbances": [{"worker": 2, "factor": 3}]}},
            "emulation.disturbances.0.worker: worker 2 does not exist",
        ),
        ({"device": "cuda"}, "worker_gpus: device 'cuda' needs worker_gpus > 0"),
    ],
)
def test_invalid_combinations_name_the_field(data, field):
    text = error_of(data)
    assert text.startswith(field), text
    assert not text.startswith("spec:"), text


def test_every_combination_problem_is_reported_on_one_line():
    text = error_of(
        {"workers": 4, "min_workers": 5, "max_workers": 3, "emulation": {"slowdowns": [1]}}
    )
    assert text.split("; ") == [
        "min_workers: min_workers (5) is greater than max_workers (3)",
        "workers: workers (4) is below min_workers (5)",
        "workers: workers (4) is above max_workers (3)",
        "emulation.slowdowns: emulation.slowdowns has 1 entries but workers is 4",
    ]


def test_several_field_errors_one_line_each_named():
    text = error_of({"bogus": 1, "optimizer": {"lr": 0}, "epochs": 0})
    problems = text.split("; ")
    assert len(problems) == 3
    assert {p.split(":")[0] for p in problems} == {"bogus", "optimizer.lr", "epochs"}


def test_combinations_skipped_for_auto_workers():
    spec = parse_spec({"workers": "auto", "global_batch": 1, "emulation": {"slowdowns": [1, 2, 3]}})
    assert spec.initial_workers is None and spec.emulated


def test_valid_combinations_accepted():
    spec = parse_spec(
        {
            "workers": 4,
            "min_workers": 2,
            "max_workers": 8,
            "global_batch": 64,
            "max_batch": 16,
            "emulation": {"slowdowns": [1, 1, 2, 4], "disturbances": [{"worker": 3, "factor": 2}]},
            "device": "cuda",
            "worker_gpus": 1,
        }
    )
    assert spec.emulated and spec.max_batch == 16


def test_not_a_mapping():
    assert error_of(["workers", 2]) == "spec: expected a mapping of fields, got list"
    assert error_of(None) == "spec: expected a mapping of fields, got NoneType"


def test_multiline_messages_are_flattened():
    err = SpecError(["a: first\nsecond", "b: third"])
    assert str(err) == "a: first second; b: third"


# --------------------------------------------------------------------------------------
# warnings for accepted values that have no effect


def test_adam_momentum_is_ignored_with_a_warning():
    with pytest.warns(UserWarning, match=r"optimizer\.momentum is ignored by adam"):
        spec = parse_spec({"optimizer": {"name": "adam", "momentum": 0.9}})
    assert spec.optimizer.name == "adam"


def test_no_warning_when_nothing_is_ignored():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_spec({"optimizer": {"name": "adam"}})
        parse_spec({"optimizer": {"name": "sgd", "momentum": 0.9}})


def test_disturbance_after_last_epoch_warns():
    with pytest.warns(UserWarning, match="epoch 5 is ignored"):
        parse_spec(
            {"epochs": 3, "emulation": {"disturbances": [{"worker": 0, "factor": 2, "epoch": 5}]}}
        )


@pytest.mark.parametrize("extra, why", [
    ({"rebalance": {"mode": "epoch", "threshold": 0.1}}, "rebalance mode epoch re-plans"),
    ({"policy": "static", "rebalance": {"mode": "adaptive", "threshold": 0.1}},
     "policy static never re-sizes"),
])
def test_rebalance_threshold_ignored_warns(extra, why):
    with pytest.warns(UserWarning, match=f"rebalance.threshold is ignored: {why}"):
        parse_spec(extra)


def test_rebalance_threshold_in_force_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for policy in ("dbs", "affine"):
            parse_spec({"policy": policy, "rebalance": {"mode": "adaptive", "threshold": 0.1}})
        # A stored spec read back (every field set, the threshold at its default).
        parse_spec(parse_spec({"rebalance": {"mode": "epoch"}}).model_dump(mode="json"))


# --------------------------------------------------------------------------------------
# files


def test_load_spec_yaml(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("name: t\nworkers: 2\nglobal_batch: 8\noptimizer:\n  lr: 0.5\n")
    spec = load_spec(p)
    assert spec.name == "t" and spec.optimizer.lr == 0.5


def test_load_spec_errors_are_one_line(tmp_path):
    bad_field = tmp_path / "bad.yaml"
    bad_field.write_text("optimizer:\n  lr: -3\n")
    with pytest.raises(SpecError, match=r"^optimizer\.lr: ") as info:
        load_spec(bad_field)
    assert "\n" not in str(info.value)

    bad_yaml = tmp_path / "broken.yaml"
    bad_yaml.write_text("workers: [1,\n  2\nname: x: y\n")
    with pytest.raises(SpecError, match="not valid YAML") as info:
        load_spec(bad_yaml)
    assert "\n" not in str(info.value)

    with pytest.raises(SpecError, match="cannot read config") as info:
        load_spec(tmp_path / "missing.yaml")
    assert "\n" not in str(info.value)


# Job specs only; examples/clusters/ holds simulator cluster descriptions.
@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_spec(path)


@settings(max_examples=100, deadline=None)
@given(
    data=st.dictionaries(
        st.sampled_from(
            [
                "workers",
                "global_batch",
                "min_workers",
                "max_workers",
                "max_batch",
                "epochs",
                "policy",
                "device",
                "bogus",
                "optimizer",
                "emulation",
            ]
        ),
        st.one_of(
            st.integers(-5, 5000),
            st.text(max_size=8),
            st.none(),
            st.booleans(),
            st.floats(allow_nan=True),
            st.lists(st.integers(0, 5), max_size=5),
            st.dictionaries(
                st.sampled_from(["lr", "name", "slowdowns", "x"]),
                st.integers(-1, 3) | st.text(max_size=3),
                max_size=2,
            ),
        ),
        max_size=5,
    )
)
def test_any_input_is_a_spec_or_one_line_field_named_error(data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            spec = parse_spec(data)
        except SpecError as err:
            text = str(err)
            assert "\n" not in text
            assert err.problems
            for problem in err.problems:
                field, sep, _ = problem.partition(": ")
                assert sep and field, problem
        else:
            assert isinstance(spec, JobSpec)


def test_extra_slowdowns_are_for_later_joiners_and_warn_past_max_workers():
    spec = parse_spec({"workers": 2, "max_workers": 3, "emulation": {"slowdowns": [1, 1, 2]}})
    assert spec.emulation.slowdowns == [1, 1, 2]
    # Past the declared size they are not ignored: a scale request may add workers beyond
    # it (an explicit size, as the parameter-server test's scale from 2 to 3 does), and
    # those take the entries. The warning says so rather than "ignored".
    with pytest.warns(UserWarning) as caught:
        parse_spec({"workers": 3, "emulation": {"slowdowns": [1, 1, 1, 1]}})
    (w,) = caught
    assert str(w.message) == (
        "emulation.slowdowns has 4 entries; entries past 3 apply only to workers that a "
        "scale request adds beyond workers (3)")
    with pytest.warns(UserWarning, match=r"beyond max_workers \(3\)$"):
        parse_spec({"workers": 2, "max_workers": 3, "emulation": {"slowdowns": [1] * 5}})


def test_spec_warnings_caught_keeps_the_specs_and_passes_the_rest_on_even_when_it_raises():
    from dynabatch.actors.spec import SpecWarning, spec_warnings_caught

    with (pytest.warns(DeprecationWarning, match="other") as rest, pytest.raises(SpecError),
          spec_warnings_caught() as messages):
        warnings.warn("other", DeprecationWarning, stacklevel=1)
        parse_spec({"workers": 2, "emulation": {"slowdowns": [1, 1, 1]}})
        parse_spec({"epochs": 0})
    assert [w.category for w in rest] == [DeprecationWarning]  # not the spec's
    assert messages == ["emulation.slowdowns has 3 entries; entries past 2 apply only to "
                        "workers that a scale request adds beyond workers (2)"]
    assert issubclass(SpecWarning, UserWarning)


# Strict integers -------------------------------------------------------------------------
# Every integer field of the spec, with how to put a value there. A field added to the
# schema without a line here fails test_every_integer_field_is_listed.
INT_FIELDS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "workers": lambda v: {"workers": v},
    "min_workers": lambda v: {"min_workers": v},
    "max_workers": lambda v: {"max_workers": v},
    "priority": lambda v: {"priority": v},
    "global_batch": lambda v: {"global_batch": v},
    "max_batch": lambda v: {"max_batch": v},
    "micro_batch": lambda v: {"micro_batch": v},
    "bucket_kb": lambda v: {"bucket_kb": v},
    "epochs": lambda v: {"epochs": v},
    "seed": lambda v: {"seed": v},
    "max_retries": lambda v: {"max_retries": v},
    "spares": lambda v: {"spares": v},
    "dataset.limit": lambda v: {"dataset": {"limit": v}},
    "dataset.num_classes": lambda v: {"dataset": {"num_classes": v}},
    "dataset.prefetch": lambda v: {"dataset": {"prefetch": v}},
    "dataset.loader_threads": lambda v: {"dataset": {"loader_threads": v}},
    "model.hidden": lambda v: {"model": {"hidden": v}},
    "rebalance.every_steps": lambda v: {"rebalance": {"every_steps": v}},
    "rebalance.check_steps": lambda v: {"rebalance": {"check_steps": v}},
    "checkpoint.every_epochs": lambda v: {"checkpoint": {"every_epochs": v}},
    "early_stopping.patience": lambda v: {"early_stopping": {"metric": "loss", "mode": "min",
                                                              "patience": v}},
    "emulation.disturbances.0.worker": lambda v: {
        "emulation": {"disturbances": [{"worker": v, "factor": 2}]}
    },
    "emulation.disturbances.0.epoch": lambda v: {
        "emulation": {"disturbances": [{"worker": 0, "factor": 2, "epoch": v}]}
    },
    "emulation.disturbances.0.step": lambda v: {
        "emulation": {"disturbances": [{"worker": 0, "factor": 2, "step": v}]}
    },
    "protocol.n": lambda v: {"protocol": {"name": "ps", "mode": "softsync", "n": v}},
    "protocol.max_staleness": lambda v: {"protocol": {"name": "ps", "max_staleness": v}},
    "protocol.replan_pushes": lambda v: {
        "protocol": {"name": "ps", "batch": "perf_aware", "replan_pushes": v}
    },
    "protocol.shards": lambda v: {"protocol": {"name": "ps", "shards": v}},
    "schedule.stages.0.epochs": lambda v: {
        "epochs": 1, "schedule": {"stages": [{"epochs": v, "global_batch": 1}]}},
    "schedule.stages.0.global_batch": lambda v: {
        "epochs": 1, "schedule": {"stages": [{"epochs": 1, "global_batch": v}]}},
    "schedule.max_global_batch": lambda v: {
        "schedule": {"mode": "goodput", "max_global_batch": v}},
    "schedule.min_global_batch": lambda v: {
        "schedule": {"mode": "goodput", "max_global_batch": 64, "min_global_batch": v}},
    "isgd.max_extra": lambda v: {"isgd": {"max_extra": v}},
    # A window of 1 is refused (a standard deviation needs two losses): 1 becomes 2.
    "isgd.window": lambda v: {"isgd": {"window": v + 1 if type(v) is int else v}},
    "optimizer.schedule.milestones": lambda v: {
        "epochs": 3, "optimizer": {"schedule": {"name": "multistep", "milestones": [v]}}},
}


def _types(annotation: Any) -> Iterator[Any]:
    """The classes an annotation admits (through unions, Annotated, lists; not Literals)."""
    if typing.get_origin(annotation) is typing.Literal:
        return
    args = typing.get_args(annotation)
    if not args:
        yield annotation
    for arg in args:
        yield from _types(arg)


def _int_fields(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, info in model.model_fields.items():
        many = typing.get_origin(info.annotation) is list
        for t in _types(info.annotation):
            if t is int:
                yield prefix + name
            elif isinstance(t, type) and issubclass(t, BaseModel):
                yield from _int_fields(t, f"{prefix}{name}.{'0.' if many else ''}")


def test_every_integer_field_is_listed() -> None:
    assert set(_int_fields(JobSpec)) == set(INT_FIELDS)


@pytest.mark.parametrize("value", ["7", True, False], ids=["str", "true", "false"])
@pytest.mark.parametrize("field", sorted(INT_FIELDS))
def test_every_integer_field_is_strict(field: str, value: Any) -> None:
    text = error_of(INT_FIELDS[field](value))
    assert text.startswith((f"{field}: ", f"{field}.0: ")), text  # .0: a list's item


@pytest.mark.parametrize("field", sorted(INT_FIELDS))
def test_integer_fields_take_integers(field: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # A base in which 1 fits every field's combinations.
        parse_spec({"workers": 1, "global_batch": 1, "max_workers": 4, **INT_FIELDS[field](1)})


def test_float_fields_take_integers_and_numeric_strings() -> None:
    # PyYAML reads `lr: 1e-3` as a string; float fields keep accepting it.
    spec = parse_spec({"optimizer": {"lr": 1}, "worker_cpus": 2, "collective_timeout_s": "1e-3"})
    assert spec.optimizer.lr == 1.0 and spec.worker_cpus == 2.0
    assert spec.collective_timeout_s == 0.001


# What a submitted spec may name ------------------------------------------------------------
PLUGINS = "tests.unit.workload_plugins"
USER_CODE = {
    "dataset": {"name": f"{PLUGINS}:arrays_loader"},
    "model": {"name": f"{PLUGINS}:tiny_net"},
}


@pytest.mark.parametrize(
    ("module", "allowed", "expected"),
    [
        ("pkg", ["pkg"], True),
        ("pkg.sub", ["pkg"], True),
        ("pkg.sub.deep", ["pkg.sub"], True),
        ("pkgx", ["pkg"], False),
        ("pkgx.sub", ["pkg"], False),
        ("pkg", ["pkg.sub"], False),
        ("pkg.subx", ["pkg.sub"], False),
        ("anything.at.all", ["*"], True),
        ("pkg", [], False),
        ("b.c", ["a", "b"], True),
    ],
)
def test_module_prefixes(module: str, allowed: list[str], expected: bool) -> None:
    assert module_allowed(module, allowed) is expected


def test_user_code_is_refused_unless_its_module_is_allowed() -> None:
    spec = parse_spec(USER_CODE)
    problems = check_user_code(spec, ())
    assert [field for field, _ in problems] == ["dataset.name", "model.name"]
    assert "runs no user code" in problems[1][1] and f"{PLUGINS}:tiny_net" in problems[1][1]
    assert check_user_code(spec, ["tests"]) == []
    assert check_user_code(spec, [PLUGINS]) == []
    assert check_user_code(spec, ["*"]) == []
    (only,) = check_user_code(parse_spec({"model": USER_CODE["model"]}), ["tests.unitx"])
    assert only[0] == "model.name" and "only from the modules tests.unitx" in only[1]
    assert check_user_code(parse_spec({"dataset": {"name": "mnist"}}), ()) == []


def test_import_paths_follow_the_resolver_grammar() -> None:
    for bad in ("pkg..mod:f", "pkg.:f", ".pkg:f", "pkg:f.g"):
        assert error_of({"model": {"name": bad}}).startswith("model.name: unknown model")


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    (tmp_path / "data" / "mnist").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    (tmp_path / "data" / "escape").symlink_to(tmp_path / "secret")
    return tmp_path


def _path_problems(dataset_path: str, root: Path) -> list[tuple[str, str]]:
    return check_paths(parse_spec({"dataset": {"path": dataset_path}}), [str(root)], None)


def test_dataset_path_must_resolve_under_a_data_root(roots: Path) -> None:
    data = roots / "data"
    assert _path_problems(str(data / "mnist"), data) == []
    assert _path_problems(str(data), data) == []  # the root itself
    assert _path_problems(str(data / "not-yet-there"), data) == []
    for bad in (
        str(data / ".." / "secret"),  # `..`
        str(data / "escape"),  # a symlink out of the root
        str(data / "escape" / "deeper"),
        str(roots / "database"),  # a sibling whose name starts like the root
        "/",
    ):
        (problem,) = _path_problems(bad, data)
        assert problem[0] == "dataset.path" and "outside the allowed directories" in problem[1]
    (problem,) = _path_problems("data/mnist", data)
    assert problem == ("dataset.path", "'data/mnist' must be an absolute path")
    (problem,) = check_paths(parse_spec({"dataset": {"path": str(data)}}), [], None)
    assert problem == ("dataset.path", "not allowed: this service accepts no dataset paths")


def test_checkpoint_dir_must_resolve_under_the_checkpoint_root(roots: Path) -> None:
    def problems(directory: str, root: str | None) -> list[tuple[str, str]]:
        return check_paths(parse_spec({"checkpoint": {"dir": directory}}), [], root)

    ckpt = roots / "data"
    assert problems(str(ckpt / "job-a"), str(ckpt)) == []
    assert problems("", None) == []  # "" means no checkpoints
    (problem,) = problems(str(ckpt / "escape"), str(ckpt))
    assert problem[0] == "checkpoint.dir" and "outside" in problem[1]
    (problem,) = problems(str(ckpt / ".." / ".." / "etc"), str(ckpt))
    assert problem[0] == "checkpoint.dir" and "outside" in problem[1]
    (problem,) = problems(str(ckpt), None)
    assert problem == (
        "checkpoint.dir",
        "not allowed: this service accepts no checkpoint directories",
    )


def test_submission_check_reports_every_field(roots: Path) -> None:
    spec = parse_spec(
        {
            **USER_CODE,
            "dataset": {**USER_CODE["dataset"], "path": "/elsewhere"},
            "checkpoint": {"dir": "/elsewhere"},
        }
    )
    default = check_submission(spec, SubmitPolicy())
    fields = ["dataset.name", "model.name", "dataset.path", "checkpoint.dir"]
    assert [f for f, _ in default] == fields
    policy = SubmitPolicy(
        user_code_modules=("tests",), data_roots=("/elsewhere",), checkpoint_root="/elsewhere"
    )
    assert check_submission(spec, policy) == []
    assert check_submission(parse_spec({}), SubmitPolicy()) == []  # built-ins, no paths


@pytest.mark.parametrize(("data", "field"), [
    ({"workers": 4, "protocol": {"name": "ps", "mode": "softsync", "n": 5}}, "protocol.n"),
    ({"protocol": {"name": "ps", "max_staleness": -1}}, "protocol.max_staleness"),
    ({"protocol": {"mode": "softsync"}}, "protocol.mode"),
    ({"protocol": {"name": "ps"}, "checkpoint": {"dir": "/tmp/c"}}, "checkpoint.dir"),
    ({"protocol": {"name": "ps"}, "policy": "affine"}, "policy"),
    ({"protocol": {"name": "ps"}, "workers": "auto"}, "workers"),
    ({"protocol": {"name": "ps", "scale_lr": False}}, "protocol.batch"),
    ({"protocol": {"name": "ps", "mode": "async", "n": 2}}, "protocol.n"),
    ({"protocol": {"name": "ps"}, "loss": "mse"}, "loss"),
    ({"protocol": {"name": "ps"}, "epochs": 2,
      "schedule": {"stages": [{"epochs": 1, "global_batch": 32},
                              {"epochs": 1, "global_batch": 64}]}}, "schedule"),
    ({"protocol": {"name": "ps"}, "isgd": {"enabled": True}}, "isgd.enabled"),
    ({"protocol": {"name": "ps"}, "optimizer": {"schedule": {"name": "cosine"}}},
     "optimizer.schedule"),
])
def test_ps_options_it_cannot_honour_name_the_field(data, field):
    text = error_of(data)
    assert text.startswith(f"{field}: ") and "\n" not in text, text


def test_ps_spec_defaults_to_sync():
    assert parse_spec({}).protocol.name == "sync"
    p = parse_spec({"workers": 4, "protocol": {"name": "ps", "mode": "softsync", "n": 4,
                                                "lr_staleness": "per_gradient"}}).protocol
    assert (p.mode, p.n, p.lr_staleness) == ("softsync", 4, "per_gradient")


# Metric names ---------------------------------------------------------------------------
def test_metrics_are_named_by_their_function_or_by_the_spec():
    spec = parse_spec({"metrics": ["accuracy", "my_pkg.metrics:f1",
                                   {"name": "top5", "fn": "my_pkg.metrics:topk"},
                                   {"fn": "my_pkg.other:recall"}]})
    assert [(m.name, m.fn) for m in spec.metrics] == [
        ("accuracy", "accuracy"), ("f1", "my_pkg.metrics:f1"), ("top5", "my_pkg.metrics:topk"),
        ("recall", "my_pkg.other:recall")]
    # A name that is the default is written back in the short form: old specs read the same.
    dumped = spec.model_dump(mode="json")["metrics"]
    assert dumped == ["accuracy", "my_pkg.metrics:f1",
                      {"fn": "my_pkg.metrics:topk", "name": "top5"}, "my_pkg.other:recall"]
    assert parse_spec(spec.model_dump(mode="json")) == spec
    assert parse_spec({"metrics": ["perplexity"], "loss": "next_token"}).model_dump(
        mode="json")["metrics"] == ["perplexity"]


@pytest.mark.parametrize(("metrics", "expected"), [
    (["a.b:f1", "c.d:f1"],
     "metrics.1.name: 'f1' is already the name of metrics.0 (a.b:f1): give one of them another"
     " name"),
    (["accuracy", {"name": "accuracy", "fn": "a:f"}],
     "metrics.1.name: 'accuracy' is already the name of metrics.0"),
    (["accuracy", "accuracy"], "metrics.1.name: 'accuracy' is already the name of metrics.0"),
    (["accuracy", {"name": "f-1", "fn": "a:f1"}], "metrics.1.name: 'f-1' is not a metric name"),
    ([{"name": "1st", "fn": "a:f1"}], "metrics.0.name: '1st' is not a metric name"),
    ([{"name": "", "fn": "a:f1"}], "metrics.0.name: '' is not a metric name"),
    ([{"name": "x" * 65, "fn": "a:f1"}], "metrics.0.name: 'xxxx"),
    ([{"name": 'a"b', "fn": "a:f1"}], "metrics.0.name: "),
    (["mse", "pkg.mod:loss"], "metrics.1.name: 'loss' is reserved"),
    ([{"name": "n", "fn": "accuracy"}], "metrics.0.name: 'n' is reserved"),
    (["accuracy", "f2"], "metrics.1: unknown metric 'f2'"),
    ([{"name": "f1", "fn": "f2"}], "metrics.0.fn: unknown metric 'f2'"),
    ([{"name": "f1"}], "metrics.0.fn: Field required"),
    ([{"fn": "a:f1", "label": "x"}], "metrics.0.label: unknown field"),
    ([7], "metrics.0: must be a metric"),
])
def test_bad_metric_names_are_one_error_naming_the_entry(metrics, expected):
    text = error_of({"metrics": metrics})
    assert text.startswith(expected) and ";" not in text, text


def test_ps_accepts_only_plain_accuracy():
    assert parse_spec({"protocol": {"name": "ps"}, "metrics": ["accuracy"]}).metrics
    text = error_of({"protocol": {"name": "ps"}, "metrics": [{"name": "acc", "fn": "accuracy"}]})
    assert text == "metrics: protocol ps reports accuracy only"


def test_metric_import_paths_are_checked_over_rest_by_position():
    spec = parse_spec({"metrics": ["accuracy", {"name": "f1", "fn": "evil.mod:f1"}]})
    problems = check_user_code(spec, ())
    assert [f for f, _ in problems] == ["metrics.1"] and "'evil.mod:f1'" in problems[0][1]

"""Service settings come from DYNABATCH_* (and Ray's own RAY_ADDRESS)."""

from __future__ import annotations

import pytest
from dynabatch.service.settings import Settings
from pydantic import ValidationError


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    s = Settings()
    assert s.db_path == "dynabatch.db" and s.ray_address is None and s.token is None
    assert not s.auth_health and not s.auth_metrics


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNABATCH_PORT", "9001")
    monkeypatch.setenv("DYNABATCH_DB_PATH", "/tmp/x.db")
    monkeypatch.setenv("DYNABATCH_API_TOKEN", "t0k")
    monkeypatch.setenv("DYNABATCH_AUTH_METRICS", "true")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    s = Settings()
    assert (s.port, s.db_path, s.token, s.auth_metrics) == (9001, "/tmp/x.db", "t0k", True)
    assert s.ray_address == "10.0.0.1:6379"
    assert "t0k" not in repr(s)  # the token is a secret
    monkeypatch.setenv("DYNABATCH_RAY_ADDRESS", "local")
    assert Settings().ray_address == "local"  # ours wins over Ray's
    assert Settings(ray_address="10.0.0.2:6379").ray_address == "10.0.0.2:6379"  # --address


def test_bad_values_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNABATCH_MAX_BODY_BYTES", "0")
    with pytest.raises(ValidationError, match="max_body_bytes"):
        Settings()


def test_submit_policy_allows_nothing_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("USER_CODE_MODULES", "DATA_ROOTS", "CHECKPOINT_ROOT"):
        monkeypatch.delenv(f"DYNABATCH_{var}", raising=False)
    policy = Settings().submit_policy
    assert policy.user_code_modules == () and policy.data_roots == ()
    assert policy.checkpoint_root is None


def test_submit_policy_from_comma_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNABATCH_USER_CODE_MODULES", " my_pkg.nets, other ,,")
    monkeypatch.setenv("DYNABATCH_DATA_ROOTS", "/data/a,/data/b")
    monkeypatch.setenv("DYNABATCH_CHECKPOINT_ROOT", "/data/checkpoints")
    policy = Settings().submit_policy
    assert policy.user_code_modules == ("my_pkg.nets", "other")
    assert policy.data_roots == ("/data/a", "/data/b")
    assert policy.checkpoint_root == "/data/checkpoints"
    monkeypatch.setenv("DYNABATCH_USER_CODE_MODULES", "*")
    monkeypatch.setenv("DYNABATCH_DATA_ROOTS", "/data")  # one entry, no comma: not JSON
    monkeypatch.setenv("DYNABATCH_CHECKPOINT_ROOT", "")  # empty: unset
    policy = Settings().submit_policy
    assert policy.user_code_modules == ("*",) and policy.data_roots == ("/data",)
    assert policy.checkpoint_root is None


@pytest.mark.parametrize(
    ("var", "value", "field"),
    [
        ("DYNABATCH_USER_CODE_MODULES", "pkg, bad-name", "user_code_modules"),
        ("DYNABATCH_USER_CODE_MODULES", "pkg.mod:func", "user_code_modules"),
        ("DYNABATCH_DATA_ROOTS", "/data,relative/dir", "data_roots"),
        ("DYNABATCH_CHECKPOINT_ROOT", "checkpoints", "checkpoint_root"),
    ],
)
def test_bad_submit_settings_name_the_setting(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, field: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError, match=field):
        Settings()


def test_every_bad_setting_is_reported_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynabatch.service.settings import settings_problems

    monkeypatch.setenv("DYNABATCH_USER_CODE_MODULES", "bad-name")
    monkeypatch.setenv("DYNABATCH_CODE_ROOT", "relative/code")
    monkeypatch.setenv("DYNABATCH_DATA_ROOTS", "also/relative")
    with pytest.raises(ValidationError) as err:
        Settings()
    problems = settings_problems(err.value)
    assert len(problems) == 3
    assert [p.split(":")[0] for p in problems] == [
        "user_code_modules (DYNABATCH_USER_CODE_MODULES)",
        "data_roots (DYNABATCH_DATA_ROOTS)",
        "code_root (DYNABATCH_CODE_ROOT)",
    ]


def test_shipping_code_names_every_missing_setting_at_once() -> None:
    from dynabatch.service.submit_policy import shipping_refusal

    refusal = shipping_refusal(Settings(user_code_modules="", code_root=None).submit_policy)
    assert refusal is not None and refusal.startswith("shipping code is not allowed")
    first, second = refusal.split("; and ")
    assert "DYNABATCH_USER_CODE_MODULES='*'" in first and "DYNABATCH_CODE_ROOT" in second
    allowed = Settings(user_code_modules="*", code_root="/srv/code").submit_policy
    assert shipping_refusal(allowed) is None

"""Service settings come from DYNABATCH_* (and Ray's own RAY_ADDRESS)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.settings import Settings


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    s = Settings()
    assert s.db_path == "dynabatch.db" and s.embedded and s.token is None
    assert not s.auth_health and not s.auth_metrics


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNABATCH_PORT", "9001")
    monkeypatch.setenv("DYNABATCH_DB_PATH", "/tmp/x.db")
    monkeypatch.setenv("DYNABATCH_API_TOKEN", "t0k")
    monkeypatch.setenv("DYNABATCH_AUTH_METRICS", "true")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    s = Settings()
    assert (s.port, s.db_path, s.token, s.auth_metrics) == (9001, "/tmp/x.db", "t0k", True)
    assert s.ray_address == "10.0.0.1:6379" and not s.embedded
    assert "t0k" not in repr(s)  # the token is a secret
    monkeypatch.setenv("DYNABATCH_RAY_ADDRESS", "local")
    assert Settings().embedded  # ours wins over Ray's
    assert Settings(ray_address="10.0.0.2:6379").ray_address == "10.0.0.2:6379"  # --address


def test_bad_values_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNABATCH_MAX_BODY_BYTES", "0")
    with pytest.raises(ValidationError, match="max_body_bytes"):
        Settings()

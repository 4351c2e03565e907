"""How RayClusterClient reads Ray's errors (no cluster needed)."""

from __future__ import annotations

import os
import socket
import sys

import pytest
import ray.exceptions as rex
from dynabatch.scheduler.core.lifecycle import InvalidTransition
from dynabatch.service.ray_client import RayClusterClient, _probe, _translate
from dynabatch.service.service_errors import ClusterUnavailable, CoordinatorGone, RayCallError


def test_timeouts_and_unavailable_actors_are_transient() -> None:
    assert isinstance(_translate(rex.GetTimeoutError("slow"), "j"), ClusterUnavailable)
    assert isinstance(
        _translate(rex.ActorUnavailableError("restarting", None), "j"), ClusterUnavailable
    )


def test_a_dead_actor_is_gone() -> None:
    assert isinstance(_translate(rex.ActorDiedError(), "j"), CoordinatorGone)


def test_invalid_transition_survives_even_unpickled() -> None:
    # Ray raises UnserializableException when the actor's InvalidTransition cannot be
    # unpickled; its text still says what happened.
    err = RuntimeError(
        "dynabatch.scheduler.core.lifecycle.InvalidTransition: "
        "job is SUCCEEDED; it cannot become CANCELLED"
    )
    assert isinstance(_translate(err, "j"), InvalidTransition)


def test_anything_else_is_a_cluster_error_with_one_line() -> None:
    out = _translate(ValueError("line one\nline two"), "j")
    assert type(out) is RayCallError and str(out) == "line two"


def test_embedded_is_the_default() -> None:
    assert RayClusterClient().embedded
    assert RayClusterClient("local").embedded
    assert not RayClusterClient("10.0.0.1:6379").embedded
    assert not RayClusterClient().ping()  # not connected: not ready


def test_an_unreachable_address_fails_fast() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ClusterUnavailable, match=f"cannot reach Ray at 127.0.0.1:{port}"):
        _probe(f"127.0.0.1:{port}", 1.0)
    _probe("ray://head:10001", 1.0)  # not host:port: left to Ray
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        _probe(f"127.0.0.1:{listener.getsockname()[1]}", 1.0)


def test_membership_errors_of_the_coordinator_are_the_callers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dynabatch.scheduler.core.lifecycle import JobState
    from dynabatch.service.service_errors import JobConflict, WorkerNotFound

    client = RayClusterClient("10.0.0.1:6379")

    def raising(cause: BaseException):
        def call(job_id: str, method: str, *args: object) -> object:
            err = rex.RayTaskError(method, "traceback", cause).as_instanceof_cause()
            raise _translate(err, job_id) from err

        return call

    monkeypatch.setattr(client, "_call", raising(KeyError("worker 'w9' is not a member of j")))
    with pytest.raises(WorkerNotFound, match=r"^worker 'w9' is not a member of j$"):
        client.drain("j", "w9")
    monkeypatch.setattr(client, "_call", raising(ValueError("cannot drain the last worker")))
    with pytest.raises(JobConflict, match="cannot drain the last worker"):
        client.drain("j", "w0")
    monkeypatch.setattr(
        client, "_call", raising(InvalidTransition(JobState.SUCCEEDED, JobState.RUNNING))
    )
    with pytest.raises(InvalidTransition):
        client.scale("j", 2)
    monkeypatch.setattr(client, "_call", raising(RuntimeError("boom")))
    with pytest.raises(RayCallError):
        client.scale("j", 2)


class _FakeRay:
    """Just enough of the ray module for dynabatch.service.raycluster.connect."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs: object) -> object:
        self.calls.append(kwargs)
        return type("Ctx", (), {"address_info": {"gcs_address": "127.0.0.1:1"}})()


def test_embedded_ray_gets_fast_health_checks_and_ray_decides_auth(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dynabatch.service import raycluster

    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert raycluster.connect(num_cpus=1) == {"address": "127.0.0.1:1"}
    (call,) = fake.calls
    assert call["address"] == "local"
    assert call["_system_config"] == raycluster.FAST_HEALTH_CHECK
    # Ray's token authentication is not switched off behind the caller's back.
    assert "RAY_AUTH_MODE" not in os.environ

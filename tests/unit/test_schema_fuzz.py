"""Schemathesis over the OpenAPI schema, against the app with a fake cluster.

Every generated request (valid and invalid) must get an answer the schema documents, and
never a 5xx. The service is built here (not by the app) so the app's lifespan, which the
ASGI transport runs per call, never closes its store.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from dynabatch.api.app import create_app
from dynabatch.service.job_service import JobService
from dynabatch.service.settings import Settings
from dynabatch.service.store import JobStore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.fakes import FakeCluster


@pytest.fixture(scope="module")
def api_schema() -> Iterator[schemathesis.BaseSchema]:
    store = JobStore(":memory:")
    cluster = FakeCluster()
    service = JobService(store, cluster, Settings(sync_interval_s=0))
    app = create_app(Settings(db_path=":memory:", max_body_bytes=64 * 1024), service=service)
    service.cluster.connect()
    # Some jobs in every state, so list and detail routes return real data.
    from dynabatch.actors.spec import JobSpec

    for epochs in (1, 3, 5):
        service.submit(JobSpec(name=f"seed{epochs}", epochs=epochs))
    for _ in range(6):
        service.reconciler.sync_once()
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    store.close()


OPERATIONS = [
    "POST /v1/jobs",
    "GET /v1/jobs",
    "GET /v1/jobs/{job_id}",
    "GET /v1/jobs/{job_id}/history",
    "GET /v1/jobs/{job_id}/logs",
    "POST /v1/jobs/{job_id}/cancel",
    "POST /v1/jobs/{job_id}/scale",
    "DELETE /v1/jobs/{job_id}/workers/{worker}",
    "POST /v1/jobs/{job_id}/resume",
    "GET /v1/jobs/{job_id}/model",
    "POST /v1/code",
    "GET /v1/nodes",
    "GET /v1/cluster",
    "GET /healthz",
    "GET /readyz",
    "GET /metrics",
]
# Code uploads are zips: raw bytes (this service allows no shipped code, so each is a 403).
schemathesis.openapi.media_type("application/zip", st.binary(max_size=512))
# The event stream of a live job never ends, so a fuzzer's request could hang; its 404,
# 401 and resumption are tested in test_client_cli.py and test_pages.py.
NOT_FUZZED = {"GET /v1/jobs/{job_id}/events"}
CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
]


def test_every_operation_is_fuzzed(api_schema: schemathesis.BaseSchema) -> None:
    labels = {r.ok().label for r in api_schema.get_all_operations()}
    assert labels == set(OPERATIONS) | NOT_FUZZED


# schemathesis' own pytest integration does not run under pytest 9, so the strategies
# are drawn through hypothesis directly.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("label", OPERATIONS)
def test_api_conforms_and_never_5xx(
    api_schema: schemathesis.BaseSchema, label: str, mode: GenerationMode
) -> None:
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None
    strategy = operation.as_strategy(generation_mode=mode)

    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        case = data.draw(strategy)
        response = case.call()
        assert response.status_code < 500, (case.method, case.formatted_path, response.text)
        case.validate_response(response, checks=CHECKS)

    check()

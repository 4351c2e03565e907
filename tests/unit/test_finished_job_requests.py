"""A request a finished job cannot take (scale, drain, cancel, resume) is refused with 409
in the user's words: the job, that it has finished and how, and what cannot be done, never
the lifecycle's ``job is SUCCEEDED; it cannot become RUNNING``."""

from __future__ import annotations

from tests.unit import test_api
from tests.unit.test_api import MakeApp, _submit, _sync

make_app = test_api.make_app  # the fixture: the app with a fake cluster


def test_a_finished_job_says_it_has_finished_for_every_request(make_app: MakeApp) -> None:
    client, service, _ = make_app()
    job = _submit(client, epochs=1)
    _sync(service, 2)
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "SUCCEEDED"
    answers = {
        "scaled": client.post(f"/v1/jobs/{job}/scale", json={"workers": 1}),
        "drained": client.delete(f"/v1/jobs/{job}/workers/w0"),
        "resumed": client.post(f"/v1/jobs/{job}/resume"),
    }
    for verb, r in answers.items():
        assert r.status_code == 409, (verb, r.text)
        detail = r.json()["detail"]
        assert detail.startswith(f"job {job} has finished (SUCCEEDED); "), detail
        assert f"cannot be {verb}" in detail and "cannot become" not in detail
    cancelled = client.post(f"/v1/jobs/{job}/cancel")
    assert cancelled.status_code == 409
    assert cancelled.json()["detail"] == (
        f"job {job} already finished (SUCCEEDED): there is nothing to cancel")

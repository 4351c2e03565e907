"""A synchronous httpx transport to the app under test, on httpx's own ``ASGITransport``.

The clients (``DynabatchClient``, ``dynabatch.Client``) speak httpx. Starlette's
``TestClient`` speaks whichever HTTP library it finds first (``httpx2`` when installed), so a
test that handed the clients a ``TestClient`` depended on that choice: a new transitive
package once broke eight tests without a line of ours changing. Here the clients get a plain
``httpx`` transport; the ``TestClient`` only serves the app (its lifespan, its event loop).
"""

from __future__ import annotations

import httpx
from starlette.testclient import TestClient


class AppTransport(httpx.BaseTransport):
    """Requests to the app that an entered ``TestClient`` serves, run on that client's event
    loop (where the app's lifespan tasks run) through ``httpx.ASGITransport``."""

    def __init__(self, served: TestClient):
        portal = getattr(served, "portal", None)
        if portal is None:
            raise RuntimeError("enter the TestClient (its lifespan) before sending through it")
        self._portal = portal
        self._app = httpx.ASGITransport(app=served.app)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()

        async def send() -> httpx.Response:
            forwarded = httpx.Request(request.method, request.url, headers=request.headers,
                                      content=body)
            answer = await self._app.handle_async_request(forwarded)
            raw = b"".join([part async for part in answer.aiter_raw()])
            return httpx.Response(answer.status_code, headers=answer.headers, content=raw)

        return self._portal.call(send)

"""413 as the API's JSON error, naming the limit.

FastAPI's body limit (``FastAPI(max_body_size=...)``, and a route's own ``max_body_size``)
is Starlette's ``RequestBodyLimitMiddleware``: a body over the limit is answered from inside
that middleware, in plain text ("Content Too Large"), outside every exception handler, and
a declared ``Content-Length`` over it replaces whatever the app answered. So the only place
to give that answer the API's ``{"detail": ...}`` shape is around the whole middleware
stack: :class:`JsonTooLarge` rewrites any 413 on its way out. The limit is the one the
request met: Starlette keeps it in the request's scope.
"""

from __future__ import annotations

import json

from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def too_large_detail(limit: int | None) -> str:
    if limit is None:
        return "request body too large"
    return f"request body too large: this endpoint takes at most {limit} bytes"


class JsonTooLarge:
    def __init__(self, app: ASGIApp, default_limit: int | None):
        self.app = app
        self.default_limit = default_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        replaced = False

        async def send_json(message: Message) -> None:
            nonlocal replaced
            if replaced:
                return  # the plain-text body that went with the replaced start
            if message["type"] == "http.response.start" and message["status"] == 413:
                replaced = True
                limit = scope.get(MAX_BODY_SIZE_SCOPE_KEY, self.default_limit)
                body = json.dumps({"detail": too_large_detail(limit)}).encode()
                await send({"type": "http.response.start", "status": 413, "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ]})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, send_json)

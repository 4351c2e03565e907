"""Request body size limit (413), as pure ASGI middleware.

A declared ``Content-Length`` over the limit is refused before the body is read; a chunked
body is counted as it arrives and refused once it passes the limit.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, status
from fastapi.responses import JSONResponse


def too_large(limit: int) -> str:
    return f"request body is larger than {limit} bytes"


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_body_bytes: int):
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.limit:
                    response = JSONResponse(
                        {"detail": too_large(self.limit)},
                        status_code=status.HTTP_413_CONTENT_TOO_LARGE,
                    )
                    await response(scope, receive, send)
                    return
        received = 0

        async def counted() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(
                        status.HTTP_413_CONTENT_TOO_LARGE, detail=too_large(self.limit)
                    )
            return message

        await self.app(scope, counted, send)

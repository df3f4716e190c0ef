"""A size cap on every request body but the upload's (which streams to disk with its own cap): bodies over
``max_bytes`` (``LORAPLEX_MAX_REQUEST_BYTES``) are answered 413 ``request_too_large`` before any route parses
them, whether they declare a Content-Length or stream chunked. The body is read here (at most ``max_bytes``) and
replayed to the route, so routes never see more than the cap."""
from __future__ import annotations

from typing import Callable

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.api.errors import error_response
from loraplex.platform.api.request_id import request_id_of


def is_upload(scope: Scope) -> bool:
    return scope.get("method") == "POST" and scope.get("path", "").rstrip("/") == "/v1/adapters"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_bytes: int, exempt: Callable[[Scope], bool] = is_upload) -> None:
        self.app, self.max_bytes, self.exempt = app, max_bytes, exempt

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(request_id_of(HTTPConnection(scope)), 413,
                                  f"the request body is larger than {self.max_bytes} bytes "
                                  "(LORAPLEX_MAX_REQUEST_BYTES); send a smaller request", code="request_too_large",
                                  headers={"Connection": "close"})
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.exempt(scope):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if value.isdigit() and (len(value) > 18 or int(value) > self.max_bytes):
                    await self._too_large(scope, receive, send)
                    return
        buffered: list[Message] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                buffered.append(message)          # the client left: let the route see it
                break
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            buffered.append(message)
            if not message.get("more_body", False):
                break
        if len(buffered) > 1 and all(m["type"] == "http.request" for m in buffered):
            buffered = [{"type": "http.request", "body": b"".join(m.get("body", b"") for m in buffered),
                         "more_body": False}]

        async def replay() -> Message:
            if buffered:
                return buffered.pop(0)
            return await receive()

        await self.app(scope, replay, send)

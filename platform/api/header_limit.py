"""A size cap on a request's headers: past ``MAX_HEADER_BYTES`` (names and values together) a request is answered
431 ``request_header_fields_too_large`` in OpenAI's error shape before any route or authentication reads them.

The HTTP server must let such requests through to say so: ``SERVER_LIMITS`` are the uvicorn settings every launch
of the platform uses (``loraplex serve``, ``loraplex demo``); h11's own cap (16 KiB by default) would otherwise
answer a plain-text 400 first. Past ``SERVER_LIMITS``' cap the server still closes the connection with its plain
400; nothing reaches the app then."""
from __future__ import annotations

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.platform.api.errors import error_response
from loraplex.platform.api.request_id import request_id_of

MAX_HEADER_BYTES = 32 * 1024
SERVER_LIMITS = {"h11_max_incomplete_event_size": 1024 * 1024}


class HeaderLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_bytes: int = MAX_HEADER_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) for name, value in scope.get("headers", ()))
            if size > self.max_bytes:
                response = error_response(
                    request_id_of(HTTPConnection(scope)), 431,
                    f"the request's headers take {size} bytes, more than the {self.max_bytes} this server reads; "
                    "send a shorter Authorization header (an API key is under 100 bytes) or fewer headers",
                    code="request_header_fields_too_large", headers={"Connection": "close"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

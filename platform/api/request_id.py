"""``x-request-id`` on every answer, errors included, and one access-log line per request that carries it.

The id is made here (``req-<32 hex>``) and kept in the request's state; a route that makes its own (inference uses
the completion id, which the engine and the usage record know it by) sets the header itself and that one is
kept and logged. Clients' own ``x-request-id`` headers are not trusted (they would collide or forge log lines).
The log line has the method, the path without its query string (query strings may hold secrets), the status and
the duration; never a body.
"""
from __future__ import annotations

import logging
import time
import uuid

from starlette.datastructures import MutableHeaders
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("loraplex.access")
HEADER = "x-request-id"


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def request_id_of(request: HTTPConnection) -> str:
    """The id of the request being answered (one is made if the middleware did not run, e.g. in a unit test)."""
    state = request.scope.setdefault("state", {})
    if "request_id" not in state:
        state["request_id"] = new_request_id()
    return state["request_id"]


class RequestIdMiddleware:
    """Pure ASGI (no buffering; streaming answers pass through untouched)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        started, seen = time.perf_counter(), {"status": 500, "id": rid, "logged": False}

        def log_once() -> None:
            if not seen["logged"]:
                seen["logged"] = True
                access_logger.info("%s %s %s %d %.1fms", seen["id"], scope.get("method", "-"),
                                   scope.get("path", "-"), seen["status"], (time.perf_counter() - started) * 1000)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if HEADER in headers:
                    seen["id"] = headers[HEADER]
                else:
                    headers[HEADER] = rid
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                log_once()              # before the last bytes leave: a client that has the answer finds the line
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log_once()                  # an answer that never finished (client gone, error) is logged too

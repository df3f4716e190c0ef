"""UploadMetricsMiddleware (pure ASGI): watches ``POST /v1/adapters`` so uploads are counted and their progress
shown without touching the upload route.

    receive: every body chunk -> UploadTracker.received (bytes of Content-Length); the last -> stage "validating"
    send:    response status (+ the error body's "code", read from at most 16 KiB) -> observe_upload(outcome, reason,
             tenant); the route names the upload (``note_upload``: tenant, adapter, version) through the upload id
             this middleware leaves in the request's state

    201 / 200            outcome "ready"        reason "ok"     (200 with Idempotent-Replayed: "replayed", with
                                                                 Loraplex-Deduplicated: "deduplicated")
    4xx                  outcome "rejected"     reason = the error's code ("too_large", "invalid_adapter", ...)
    5xx or an exception  outcome "failed"       reason = the error's code, or "internal_error"
    client went away     outcome "aborted"      reason "client_disconnected"
"""
from __future__ import annotations

import json
import uuid
from typing import Any

MAX_ERROR_BODY = 16 * 1024


UPLOAD_ID = "loraplex_upload_id"    # key in the ASGI scope's "state" (request.state) naming the tracked upload


def note_upload(request: Any, **names) -> None:
    """From the upload route: name the upload this request is (``tenant``, ``adapter``, ``version``) for the
    dashboard and the metrics' tenant label. A no-op without the middleware."""
    upload_id = getattr(request.state, UPLOAD_ID, None)
    metrics = getattr(request.app.state, "metrics", None)
    if upload_id is not None and metrics is not None:
        metrics.uploads.note(upload_id, **names)


def _outcome(status: int, replayed: str | None, body: bytes) -> tuple[str, str]:
    if status < 400:
        return (replayed or "ready"), "ok"
    code = None
    try:
        data = json.loads(body.decode("utf-8")) if body else None
        if isinstance(data, dict) and isinstance(data.get("code"), str):
            code = data["code"]
        elif isinstance(data, dict) and isinstance(data.get("error"), dict):
            code = data["error"].get("code") or data["error"].get("type")
    except (UnicodeDecodeError, ValueError):
        pass
    code = code if isinstance(code, str) and code else f"http_{status}"
    return ("rejected" if status < 500 else "failed"), code[:64]


class UploadMetricsMiddleware:
    """Counts and tracks uploads to ``path`` (``POST`` only); other requests pass through untouched."""

    def __init__(self, app: Any, metrics: Any, path: str = "/v1/adapters") -> None:
        self.app, self.metrics, self.path = app, metrics, path.rstrip("/")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path", "").rstrip("/") != self.path:
            await self.app(scope, receive, send)
            return
        tracker = self.metrics.uploads
        upload_id = uuid.uuid4().hex[:12]
        headers = dict(scope.get("headers") or [])
        try:
            total = int(headers.get(b"content-length", b""))
        except ValueError:
            total = None
        tracker.start(upload_id, total)
        scope.setdefault("state", {})[UPLOAD_ID] = upload_id
        state = {"status": None, "replayed": None, "body": b"", "done": False}

        def finish(status: int | None, outcome: str, reason: str) -> None:
            if not state["done"]:
                state["done"] = True
                tenant = tracker.tenant_of(upload_id)
                tracker.finish(upload_id, status=status, outcome=outcome, reason=reason)
                self.metrics.observe_upload(outcome, reason, tenant)

        async def receive_counted():
            message = await receive()
            if message["type"] == "http.request":
                tracker.received(upload_id, len(message.get("body", b"")))
                if not message.get("more_body", False):
                    tracker.body_done(upload_id)
            return message

        async def send_watched(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                for k, v in message.get("headers", []):
                    if v.lower() == b"true" and k.lower() in (b"idempotent-replayed", b"loraplex-deduplicated"):
                        state["replayed"] = "replayed" if k.lower() == b"idempotent-replayed" else "deduplicated"
            elif message["type"] == "http.response.body":
                if state["status"] is not None and state["status"] >= 400 and len(state["body"]) < MAX_ERROR_BODY:
                    state["body"] += message.get("body", b"")[:MAX_ERROR_BODY - len(state["body"])]
                if not message.get("more_body", False):
                    status = state["status"] or 500
                    finish(status, *_outcome(status, state["replayed"], state["body"]))
            await send(message)

        try:
            await self.app(scope, receive_counted, send_watched)
        except BaseException:
            finish(500, "failed", "internal_error")
            raise
        finally:
            finish(state["status"], "aborted", "client_disconnected")

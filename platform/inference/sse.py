"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` per chunk, then ``data: [DONE]\\n\\n``."""
from __future__ import annotations

import json

from pydantic import BaseModel

SSE_DONE = b"data: [DONE]\n\n"
SSE_MEDIA_TYPE = "text/event-stream"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream


def sse_event(payload: BaseModel | dict) -> bytes:
    """One event. Pydantic models drop None fields except those OpenAI's clients expect (``exclude_none`` is not
    used: ``finish_reason: null`` and ``usage: null`` are part of the wire format)."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


def parse_sse(raw: bytes) -> list[dict | str]:
    """Decode a whole SSE body (tests and clients of the benchmark): each event's JSON, or the string "[DONE]"."""
    events: list[dict | str] = []
    text = raw.decode().replace("\r\n", "\n").replace("\r", "\n")
    for block in text.split("\n\n"):
        # SSE lines end only at CR/LF: str.splitlines() would also split inside JSON strings at U+2028 / U+0085
        lines = [line[5:].lstrip() for line in block.split("\n") if line.startswith("data:")]
        if not lines:
            continue
        data = "\n".join(lines)
        events.append(data if data == "[DONE]" else json.loads(data))
    return events

"""One line per request, shared by the Locust users, the streaming client, the reports and the invariants.

    rec = Record(scenario="zipf", tenant=tid, model="z0001", status=200, kind="ok", latency_ms=12.5, ...)
    kind: "ok" | an API error code ("rate_limit_exceeded", "model_not_found", ...) | "transport:<Exception>"
          | "client_disconnect" (the client left on purpose) | "unclear:<status>" (an error without a message)
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass
class Record:
    scenario: str
    tenant: str
    model: str
    status: int                  # HTTP status; 0 when no answer came back
    kind: str
    latency_ms: float
    started_s: float             # seconds since the run began
    request_id: str | None = None
    completion_tokens: int = 0
    ttft_ms: float | None = None          # streaming: time to the first token
    itl_ms: list[float] | None = None     # streaming: gaps between tokens
    expected: bool = True                 # False: the scenario did not allow this outcome


def error_kind(status: int, body: bytes | str | None) -> str:
    """The ``kind`` of an answer: ``ok`` for 2xx, else its error code; an error without code and message is
    ``unclear:<status>`` (a defect: every failure must say what went wrong)."""
    if 200 <= status < 300:
        return "ok"
    try:
        data = json.loads(body or b"")
    except (ValueError, TypeError):
        return f"unclear:{status}"
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err.get("code") or err.get("type") or f"http_{status}")
    if isinstance(data, dict) and data.get("detail"):
        return str(data.get("code") or f"http_{status}")
    return f"unclear:{status}"


def write_records(path: str, records: list[Record]) -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")


def read_records(path: str) -> list[Record]:
    with open(path) as f:
        return [Record(**json.loads(line)) for line in f if line.strip()]

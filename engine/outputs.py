"""What the engine reports per request and step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """One request's state after a step. ``new_token_ids``/``new_text`` are this step's delta (for streaming);
    ``output_token_ids``/``text`` are cumulative. ``finish_reason``: "stop", "length", "abort" or "error"."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    adapter: object | None = field(default=None, repr=False)
    error: str | None = None  # why the request failed (finish_reason "error"), e.g. its adapter did not load

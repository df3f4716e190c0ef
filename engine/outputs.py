"""What the engine reports per request and step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraplex.engine.logprobs import TokenLogprob


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions (``index`` 0..n-1), cumulative plus this step's delta.

    ``cumulative_logprob``: summed logprobs of its tokens (raw model distribution; beams: the beam score's sum);
    ``beam_score``: the length-normalised score beams are ranked by (None unless beam search);
    ``logprobs``: one entry per output token when the request asked for ``logprobs``; ``stop_reason``: the stop
    string that ended it, if any."""

    index: int
    output_token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    beam_score: float | None = None
    logprobs: list["TokenLogprob"] | None = None
    stop_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's state after a step. ``new_token_ids``/``new_text`` are this step's delta (for streaming);
    ``output_token_ids``/``text`` are cumulative. ``finish_reason``: "stop", "length", "abort" or "error".

    The single-sequence fields describe the first completion; ``outputs`` holds all ``n`` (best first for
    ``best_of`` and beam search). ``prompt_logprobs``: one entry per prompt token (None for the first) when
    asked for, on the final output."""

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
    error_retryable: bool = False  # the failure was transient (blob store down): the same request may succeed later
    # what failed: "adapter_load_error", "invalid_request" (e.g. a grammar that does not compile: the client's to
    # fix), "engine_error"; None unless finish_reason is "error"
    error_type: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list["TokenLogprob | None"] | None = None

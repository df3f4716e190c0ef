"""NullEngineService: the engine API with no model: every request streams ``max_tokens`` fixed tokens (default
``num_tokens``), ``token_delay_s`` apart. For measuring the gateway's own overhead.

``n`` / ``best_of`` give that many identical completions; ``logprobs`` / ``prompt_logprobs`` report every token
as certain (logprob 0, rank 1), so the gateway's shapes can be exercised without a model."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from loraplex.engine.server.errors import InvalidRequestError
from loraplex.engine.server.protocol import AdapterSpec, GenerateRequest, chunk_dict, logprob_dict, output_dict

NULL_TOKEN_ID = 7
NULL_TOKEN_TEXT = " tok"


class NullEngineService:
    """Same methods as ``EngineService``; adapters are only bookkeeping (instant loads)."""

    def __init__(self, *, model_name: str = "null", num_tokens: int = 8, token_delay_s: float = 0.0,
                 limits: dict | None = None) -> None:
        if num_tokens < 1 or token_delay_s < 0:
            raise ValueError(f"need num_tokens >= 1 and token_delay_s >= 0, got {num_tokens}, {token_delay_s}")
        self.model_name = model_name
        self.num_tokens = num_tokens
        self.token_delay_s = token_delay_s
        self.lora_enabled = True
        self._resident: dict[str, AdapterSpec] = {}
        self._pinned: set[str] = set()
        self._active: set[str] = set()
        self.num_requests = 0
        self.limits = limits     # what /health reports as the engine's serving limits (None: none reported)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        max_tokens = request.sampling.get("max_tokens", self.num_tokens)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens!r}")
        if not request.prompt:
            raise InvalidRequestError("prompt is empty")
        if request.adapter is not None:
            self._resident[request.adapter.adapter_id] = request.adapter
        n_prompt = len(request.prompt) if isinstance(request.prompt, list) else max(1, len(request.prompt) // 4)
        seqs, logprobs, prompt_lp = _extras(request.sampling)
        detailed = seqs > 1 or logprobs is not None
        self.num_requests += 1
        self._active.add(request.request_id)
        try:
            for i in range(max_tokens):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if request.request_id not in self._active:  # aborted
                    yield chunk_dict(request.request_id, [], "", finished=True, finish_reason="abort",
                                     prompt_tokens=n_prompt, completion_tokens=i * seqs)
                    return
                last = i == max_tokens - 1
                reason = "length" if last else None
                outputs = None
                if detailed:
                    entries = None if logprobs is None else [_certain(NULL_TOKEN_ID, NULL_TOKEN_TEXT, logprobs)]
                    outputs = [output_dict(k, [NULL_TOKEN_ID], NULL_TOKEN_TEXT, finish_reason=reason, logprobs=entries)
                               for k in range(seqs)]
                prompt_entries = None
                if last and prompt_lp is not None and isinstance(request.prompt, list):
                    prompt_entries = [None] + [_certain(t, "", prompt_lp) for t in request.prompt[1:]]
                yield chunk_dict(request.request_id, [NULL_TOKEN_ID], NULL_TOKEN_TEXT, finished=last,
                                 finish_reason=reason, prompt_tokens=n_prompt, completion_tokens=(i + 1) * seqs,
                                 outputs=outputs, prompt_logprobs=prompt_entries)
        finally:
            self._active.discard(request.request_id)

    def abort(self, request_id: str) -> None:
        self._active.discard(request_id)

    @property
    def in_flight(self) -> int:
        return len(self._active)

    async def load_adapter(self, spec: AdapterSpec, *, wait: bool = False, timeout_s: float | None = None) -> dict:
        self._resident[spec.adapter_id] = spec
        return {"adapter_id": spec.adapter_id, "state": "ready", "error": None}

    async def evict_adapter(self, adapter_id: str) -> bool:
        self._pinned.discard(adapter_id)
        return self._resident.pop(adapter_id, None) is not None

    async def pin_adapter(self, adapter_id: str, pinned: bool, spec: AdapterSpec | None = None) -> dict:
        if spec is not None:
            self._resident[adapter_id] = spec
        if adapter_id not in self._resident:
            raise InvalidRequestError(f"adapter {adapter_id!r} is unknown to this engine; send its full reference "
                                      "{adapter_id, uri, sha256}")
        (self._pinned.add if pinned else self._pinned.discard)(adapter_id)
        return {"adapter_id": adapter_id, "pinned": pinned, "state": "ready"}

    def residency(self) -> dict:
        return {"enabled": True, "gpu": {}, "cpu": sorted(self._resident), "loading": [], "failed": {},
                "pinned": sorted(self._pinned)}

    async def stats(self) -> dict:
        """``empty_stats()`` (no KV cache, no adapter tiers) with the requests in flight as running."""
        from loraplex.engine.stats import empty_stats

        return {**empty_stats(), "requests_running": self.in_flight}

    def health(self) -> dict:
        return {"ready": True, "model": self.model_name, "lora": True, "in_flight": self.in_flight, "null": True,
                **({"limits": self.limits} if self.limits is not None else {})}

    async def close(self) -> None:
        return None


def _extras(sampling: dict) -> tuple[int, int | None, int | None]:
    """(sequences to run, logprobs, prompt_logprobs) of a request's sampling dict, checked like SamplingParams."""
    n, best_of = sampling.get("n"), sampling.get("best_of")
    n = 1 if n is None else n
    logprobs, prompt_lp = sampling.get("logprobs"), sampling.get("prompt_logprobs")
    for name, value, low in (("n", n, 1), ("best_of", best_of, n), ("logprobs", logprobs, 0),
                             ("prompt_logprobs", prompt_lp, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise InvalidRequestError(f"{name} must be an integer >= {low}, got {value!r}")
    return max(n, best_of or 1), logprobs, prompt_lp


def _certain(token_id: int, text: str, top: int) -> dict:
    return logprob_dict(token_id, text, 0.0, 1, [(token_id, text, 0.0)] if top else [])

"""NullEngineService: the engine API with no model: every request streams ``max_tokens`` fixed tokens (default
``num_tokens``), ``token_delay_s`` apart. For measuring the gateway's own overhead."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from loraplex.engine.server.errors import InvalidRequestError
from loraplex.engine.server.protocol import AdapterSpec, GenerateRequest, chunk_dict

NULL_TOKEN_ID = 7
NULL_TOKEN_TEXT = " tok"


class NullEngineService:
    """Same methods as ``EngineService``; adapters are only bookkeeping (instant loads)."""

    def __init__(self, *, model_name: str = "null", num_tokens: int = 8, token_delay_s: float = 0.0) -> None:
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

    async def generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        max_tokens = request.sampling.get("max_tokens", self.num_tokens)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens!r}")
        if not request.prompt:
            raise InvalidRequestError("prompt is empty")
        if request.adapter is not None:
            self._resident[request.adapter.adapter_id] = request.adapter
        n_prompt = len(request.prompt) if isinstance(request.prompt, list) else max(1, len(request.prompt) // 4)
        self.num_requests += 1
        self._active.add(request.request_id)
        try:
            for i in range(max_tokens):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if request.request_id not in self._active:  # aborted
                    yield chunk_dict(request.request_id, [], "", finished=True, finish_reason="abort",
                                     prompt_tokens=n_prompt, completion_tokens=i)
                    return
                last = i == max_tokens - 1
                yield chunk_dict(request.request_id, [NULL_TOKEN_ID], NULL_TOKEN_TEXT, finished=last,
                                 finish_reason="length" if last else None, prompt_tokens=n_prompt,
                                 completion_tokens=i + 1)
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
        return {"ready": True, "model": self.model_name, "lora": True, "in_flight": self.in_flight, "null": True}

    async def close(self) -> None:
        return None

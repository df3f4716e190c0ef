"""EngineService: an ``AsyncEngine`` behind plain async methods taking and giving wire dicts. The HTTP app and
the platform's in-process client both call it, so both behave the same.

Adapter operations: loads and pins are thread-safe in the engine; an eviction touches the GPU slots, which belong
to the thread that steps the engine, so it runs there between two steps (``AsyncEngine.call``).
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from loraplex.engine.server.errors import (AdapterFetchUnavailableError, AdapterInUseError, AdapterUnavailableError,
                                           EngineServiceError, EngineUnavailableError, InvalidRequestError)
from loraplex.engine.server.chunks import ChunkEncoder, TokenTexts
from loraplex.engine.server.protocol import AdapterSpec, GenerateRequest


class EngineService:
    """The engine's API in-process. ``engine`` is a ``loraplex.engine.AsyncEngine``."""

    def __init__(self, engine: Any, *, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._refs: dict[str, Any] = {}      # adapter_id -> AdapterRef seen in loads/requests
        self._texts = TokenTexts(getattr(engine.engine, "tokenizer", None))  # logprob entries' token texts

    @property
    def lora_enabled(self) -> bool:
        return getattr(self.engine.engine, "adapters", None) is not None

    def _ref(self, spec: AdapterSpec):
        from loraplex.engine.lora.ref import AdapterRef

        try:
            ref = AdapterRef(spec.adapter_id, spec.uri, spec.sha256)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        self._refs[spec.adapter_id] = ref
        return ref

    def _check_alive(self) -> None:
        if not self.engine.is_alive():
            raise EngineUnavailableError("the engine loop has stopped; restart the engine process")

    # ---- generation ---------------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        """Chunk dicts (``protocol.chunk_dict``); raises ``EngineServiceError`` subclasses."""
        from loraplex.engine.async_engine import EngineDeadError, RequestFailedError
        from loraplex.engine.lora.manager import AdapterLoadError
        from loraplex.engine.sampling_params import SamplingParams

        self._check_alive()
        try:
            params = SamplingParams.from_dict(request.sampling)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(str(e)) from None
        ref = None
        if request.adapter is not None:
            if not self.lora_enabled:
                raise InvalidRequestError("this engine serves the base model only (started without LoRA); "
                                          "send no adapter or start it with --enable-lora")
            ref = self._ref(request.adapter)
        encoder = ChunkEncoder(params, self._texts)
        stream = self.engine.generate(request.request_id, request.prompt, params, ref, tenant=request.tenant_id,
                                      weight=request.tenant_weight)
        try:
            async for out in stream:
                yield encoder.encode(out)
        except AdapterLoadError as e:
            raise (AdapterFetchUnavailableError if e.retryable else AdapterUnavailableError)(str(e)) from None
        except EngineDeadError as e:
            raise EngineUnavailableError(str(e)) from None
        except RequestFailedError as e:
            raise EngineServiceError(str(e)) from None
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(str(e)) from None
        finally:
            await stream.aclose()  # a consumer that left early aborts the request (frees its KV blocks)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    # ---- adapters -----------------------------------------------------------------------------------------
    def _require_lora(self) -> None:
        if not self.lora_enabled:
            raise InvalidRequestError("LoRA is disabled on this engine; start it with --enable-lora")

    def _known(self, adapter_id: str, spec: AdapterSpec | None):
        if spec is not None:
            return self._ref(spec)
        ref = self._refs.get(adapter_id)
        if ref is None:
            raise InvalidRequestError(f"adapter {adapter_id!r} is unknown to this engine; send its full reference "
                                      "{adapter_id, uri, sha256}")
        return ref

    async def load_adapter(self, spec: AdapterSpec, *, wait: bool = False, timeout_s: float | None = None) -> dict:
        """Start (or with ``wait``, finish) loading into the CPU tier. ``{"adapter_id", "state", "error"}``."""
        self._require_lora()
        ref = self._ref(spec)
        llm = self.engine.engine
        state = await asyncio.to_thread(llm.load_adapter, ref, wait=wait, timeout=timeout_s)
        error = llm.adapters.error(ref) if state == "failed" else None
        return {"adapter_id": spec.adapter_id, "state": state, "error": str(error) if error else None}

    async def evict_adapter(self, adapter_id: str) -> bool:
        """Drop from GPU and CPU; False if it was not there. ``AdapterInUseError`` while requests run with it."""
        self._require_lora()
        ref = self._refs.get(adapter_id)
        if ref is None:
            return False

        try:
            return await self.engine.call(lambda llm: llm.evict_adapter(ref))
        except ValueError as e:
            raise AdapterInUseError(str(e)) from None

    async def pin_adapter(self, adapter_id: str, pinned: bool, spec: AdapterSpec | None = None) -> dict:
        self._require_lora()
        ref = self._known(adapter_id, spec)
        try:
            self.engine.engine.pin_adapter(ref, pinned)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        return {"adapter_id": adapter_id, "pinned": pinned, "state": self.engine.engine.adapters.state(ref)}

    def residency(self) -> dict:
        """``{"enabled", "gpu": {slot: id}, "cpu": [ids], "loading", "failed", "pinned", counters...}``."""
        if not self.lora_enabled:
            return {"enabled": False, "gpu": {}, "cpu": [], "loading": [], "failed": {}, "pinned": []}
        return {"enabled": True, **self.engine.engine.list_adapters()}

    async def stats(self) -> dict:
        """``loraplex.engine.stats.engine_stats`` of the engine: load, KV cache, adapter tiers and counters.

        Read in a worker thread, not between two steps: every field is a length, a counter or the adapter
        manager's locked snapshot (safe from another thread), and a stats read must not wait behind a long step
        (a busy engine would look unreachable to the platform's poller)."""
        from loraplex.engine.stats import engine_stats

        return await asyncio.to_thread(engine_stats, self.engine.engine)

    def limits(self) -> dict:
        """What this engine can serve (``protocol.limits_dict``): the platform validates uploads against it."""
        from loraplex.engine.server.protocol import limits_dict

        llm = self.engine.engine
        cfg = llm.config
        slots = getattr(llm.adapters, "slots", None) if self.lora_enabled else None
        return limits_dict(llm.model_config, lora=self.lora_enabled, max_lora_rank=cfg.max_lora_rank,
                           max_loras=cfg.max_loras, max_model_len=llm.max_model_len, quantization=cfg.quantization,
                           targets=getattr(slots, "targets", None))

    def health(self) -> dict:
        alive = self.engine.is_alive()
        return {"ready": alive, "model": self.model_name, "lora": self.lora_enabled,
                "in_flight": self.engine.engine.num_unfinished_requests, "limits": self.limits(),
                **({} if alive else {"detail": "the engine loop has stopped"})}

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)

"""The engine's internal HTTP API with a real tiny engine, through the platform's HTTP and in-process clients:
streaming, bad input, disconnect → abort, adapter load / pin / evict / residency, readiness."""
from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time

import httpx
import pytest

from loraplex.platform.engines.errors import AdapterLoadFailedError, EngineRequestError
from loraplex.platform.engines.http_client import HttpEngineClient
from loraplex.platform.engines.inprocess import InProcessEngineClient
from loraplex.platform.engines.messages import AdapterReference, EngineRequest

PROMPT = [5, 17, 42, 99, 7, 13]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _ref(folder: str, adapter_id: str = "tenant-a/bot/1", sha256: str | None = None) -> AdapterReference:
    if sha256 is None:
        with open(os.path.join(folder, "adapter_model.safetensors"), "rb") as f:
            sha256 = hashlib.sha256(f.read()).hexdigest()
    return AdapterReference(adapter_id, f"file://{folder}", sha256, rank=4, targets=("q_proj",))


async def _collect(client, request):
    return [c async for c in client.generate(request)]


def _wait_idle(service, timeout=5.0):
    deadline = time.monotonic() + timeout
    while service.health()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.02)
    return service.health()["in_flight"]


def test_stream_over_http_equals_in_process(engine_server):
    service, server = engine_server

    async def main():
        http = HttpEngineClient(server.url)
        try:
            health = await http.health()
            over_http = await _collect(http, EngineRequest("r-http", "tenant-a", PROMPT, GREEDY))
            in_proc = await _collect(InProcessEngineClient(service),
                                     EngineRequest("r-inproc", "tenant-a", PROMPT, GREEDY))
            text = await _collect(http, EngineRequest("r-text", None, "Hello world",
                                                      {"max_tokens": 4, "temperature": 0.0}))
            return health, over_http, in_proc, text
        finally:
            await http.close()

    health, over_http, in_proc, text = asyncio.run(main())
    assert health.ready and health.model == "tiny-llama"
    ids = [t for c in over_http for t in c.token_ids]
    assert len(ids) == 8 and ids == [t for c in in_proc for t in c.token_ids]
    last = over_http[-1]
    assert last.finished and last.finish_reason == "length" and all(not c.finished for c in over_http[:-1])
    assert (last.prompt_tokens, last.completion_tokens) == (6, 8)
    assert text[-1].finished and 1 <= text[-1].completion_tokens <= 4 and text[-1].prompt_tokens > 0


def test_bad_input_is_a_400_naming_the_problem(engine_server):
    service, server = engine_server
    raw = httpx.post(f"{server.url}/v1/generate", json={"request_id": "bad", "prompt": PROMPT,
                                                        "sampling": {"temperature": -1}})
    assert raw.status_code == 400
    assert raw.json()["error"]["type"] == "invalid_request"
    assert "temperature must be in [0, inf)" in raw.json()["error"]["message"]
    raw = httpx.post(f"{server.url}/v1/generate", json={"request_id": "bad2", "prompt": {"x": 1}})
    assert raw.status_code == 400 and "'prompt' must be a string or a list of token ids" in raw.text

    async def main():
        http = HttpEngineClient(server.url)
        try:
            with pytest.raises(EngineRequestError, match="unknown sampling parameter"):
                await _collect(http, EngineRequest("bad3", None, PROMPT, {"bogus": 1}))
            with pytest.raises(EngineRequestError, match="prompt token ids must be integers in"):
                await _collect(InProcessEngineClient(service), EngineRequest("bad4", None, [10**6], {}))
        finally:
            await http.close()

    asyncio.run(main())
    assert _wait_idle(service) == 0


def test_client_disconnect_aborts_the_engine_request(engine_server, monkeypatch):
    service, server = engine_server
    aborted = []
    real_abort = service.engine.abort
    monkeypatch.setattr(service.engine, "abort", lambda rid: (aborted.append(rid), real_abort(rid))[1])

    async def main():
        http = HttpEngineClient(server.url)
        try:
            stream = http.generate(EngineRequest("r-leave", None, PROMPT, {"max_tokens": 200, "ignore_eos": True,
                                                                           "temperature": 0.0}))
            got = [await stream.__anext__(), await stream.__anext__()]
            await stream.aclose()
            return got
        finally:
            await http.close()

    got = asyncio.run(main())
    assert len(got) == 2 and not got[1].finished
    assert _wait_idle(service) == 0  # the engine holds nothing for it any more
    assert aborted == ["r-leave"]    # ... because the server saw the disconnect and aborted it (not finished)


def test_adapter_load_pin_evict_and_residency(engine_server, llama_adapter):
    service, server = engine_server
    ref = _ref(llama_adapter)

    async def main():
        http = HttpEngineClient(server.url)
        try:
            state = await http.load_adapter(ref, wait=True)
            after_load = await http.residency()
            chunks = await _collect(http, EngineRequest("r-lora", "tenant-a", PROMPT, GREEDY, ref))
            after_use = await http.residency()
            await http.pin_adapter(ref.adapter_id, True)
            pinned = await http.residency()
            await http.pin_adapter(ref.adapter_id, False)
            evicted = await http.evict_adapter(ref.adapter_id)
            evicted_again = await http.evict_adapter(ref.adapter_id)
            after_evict = await http.residency()
            with pytest.raises(EngineRequestError, match="unknown to this engine"):
                await http.pin_adapter("nobody/none/1", True)
            return state, after_load, chunks, after_use, pinned, evicted, evicted_again, after_evict
        finally:
            await http.close()

    state, after_load, chunks, after_use, pinned, evicted, evicted_again, after_evict = asyncio.run(main())
    assert state == "ready" and ref.adapter_id in after_load.cpu
    assert chunks[-1].completion_tokens == 8
    assert ref.adapter_id in after_use.gpu.values() and ref.adapter_id in after_use.resident_ids
    assert pinned.pinned == [ref.adapter_id]
    assert evicted is True and evicted_again is False
    assert ref.adapter_id not in after_evict.resident_ids and after_evict.pinned == []


def test_adapter_that_fails_to_load(engine_server, llama_adapter):
    service, server = engine_server
    bad = _ref(llama_adapter, "tenant-a/bot/2", sha256="0" * 64)

    async def main():
        http = HttpEngineClient(server.url)
        try:
            with pytest.raises(AdapterLoadFailedError, match="sha256 mismatch"):
                await _collect(http, EngineRequest("r-badsha", "tenant-a", PROMPT, GREEDY, bad))
            state = await http.load_adapter(bad, wait=True)
            residency = await http.residency()
            return state, residency
        finally:
            await http.close()

    state, residency = asyncio.run(main())
    assert state == "failed" and "sha256 mismatch" in residency.failed["tenant-a/bot/2"]
    raw = httpx.post(f"{server.url}/v1/generate", json={"request_id": "r-badsha2", "prompt": PROMPT,
                                                        "sampling": GREEDY, "adapter": bad.to_wire()})
    assert raw.status_code == 422 and raw.json()["error"]["type"] == "adapter_load_error"


def test_health_is_503_until_the_model_is_loaded():
    from loraplex.engine.server.app import ServiceHolder, create_app
    from loraplex.engine.server.serve import null_service, start_loading
    from tests.engine.server.conftest import ThreadServer

    release = threading.Event()
    holder = ServiceHolder()
    server = ThreadServer(create_app(holder))
    try:
        start_loading(holder, lambda: (release.wait(10), null_service())[1])
        loading = httpx.get(f"{server.url}/health")
        refused = httpx.post(f"{server.url}/v1/generate", json={"request_id": "x", "prompt": [1]})
        release.set()
        deadline = time.monotonic() + 5
        while holder.service is None and time.monotonic() < deadline:
            time.sleep(0.01)
        ready = httpx.get(f"{server.url}/health")
    finally:
        server.stop()
    assert loading.status_code == 503 and loading.json() == {"ready": False, "detail": "the model is still loading"}
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "engine_unavailable"
    assert ready.status_code == 200 and ready.json()["ready"] is True


def test_base_only_engine_refuses_adapters(llama_path, llama_adapter):
    from loraplex.engine.server.serve import real_service

    service = real_service(llama_path, device="cpu", dtype="float32", progress=False, max_num_seqs=2)
    client = InProcessEngineClient(service)

    async def main():
        try:
            with pytest.raises(EngineRequestError, match="started without LoRA"):
                await _collect(client, EngineRequest("r", None, PROMPT, GREEDY, _ref(llama_adapter)))
            return await client.residency()
        finally:
            await client.close()

    residency = asyncio.run(main())
    assert residency.enabled is False and residency.resident_ids == frozenset()

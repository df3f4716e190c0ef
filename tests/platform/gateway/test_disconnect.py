"""A client that disconnects mid-stream aborts its engine request (KV blocks freed on the real engine), and its
lease and unused token reservation are given back; usage records what was generated."""
from __future__ import annotations

import time

import httpx

from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.routing import Replica
from tests.platform.gateway.conftest import settings_for


def wait_until(cond, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def stream_then_drop(server, key, model, *, max_tokens, events=3) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": max_tokens,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= events:
                        break
    # leaving both blocks closed the connection mid-stream


def test_disconnect_aborts_and_frees_lease_and_reservation(serve, tmp_path, tiny_base):
    engine = NullEngineClient(num_tokens=8, token_delay_s=0.02)
    server = serve(settings_for(tmp_path, tiny_base), replicas=[Replica("null", engine)])
    _, key = server.new_tenant({"max_concurrency": 1, "tokens_per_minute": 300})
    model = server.gateway.model_name
    stream_then_drop(server, key, model, max_tokens=200)
    wait_until(lambda: engine.service.in_flight == 0, what="the engine request to be aborted")
    # the lease is free (max_concurrency=1) and ~190 reserved tokens came back: prompt + 200 fits again in 300
    client = server.openai(key)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "tell me a story"}],
                                       max_tokens=200)
    assert r.usage.completion_tokens == 200
    usage = server.http.get("/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    assert usage["totals"]["requests"] == 2
    assert 200 < usage["totals"]["completion_tokens"] < 200 + 20  # the dropped stream counted only what it got


def test_disconnect_frees_kv_blocks_of_the_real_engine(serve, tmp_path, tiny_base):
    server = serve(settings_for(tmp_path, tiny_base, engine_mode="embedded", engine_device="cpu",
                                engine_dtype="float32"))
    _, key = server.new_tenant({"max_concurrency": 1})
    llm = server.gateway.router.replicas["embedded"].client.service.engine.engine
    total = llm.kv_cache.num_free_blocks
    stream_then_drop(server, key, server.gateway.model_name, max_tokens=200, events=4)
    wait_until(lambda: llm.num_unfinished_requests == 0, what="the engine to drop the request")
    assert llm.kv_cache.num_free_blocks == total
    r = server.openai(key).completions.create(model=server.gateway.model_name, prompt="hello", max_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"

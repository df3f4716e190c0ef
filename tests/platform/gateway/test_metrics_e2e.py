"""Metrics of the real app end to end: a known workload through the official ``openai`` client against a live
server, then ``GET /metrics`` must hold exactly the counts per tenant, adapter and status (every sample of the
request, token and quota counters compared as a whole, so nothing extra and nothing double-counted), the engine
gauges of each replica kind (null in-process, embedded real engine, ``loraplex engine serve --null`` over HTTP),
and the dashboard's data."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from loraplex.platform.engines.errors import EngineError, EngineRequestError
from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.routing import Replica
from tests.platform.gateway.conftest import ADMIN_KEY, settings_for
from tests.platform.gateway.test_disconnect import stream_then_drop, wait_until
from tests.platform.metrics.conftest import parse_scrape, sample
from tests.utils.services import free_port, wait_for_port

N, M, K = 4, 3, 3          # T1 adapter requests, T1 base requests, T2 quota rejections
T2_ALLOWED = 2             # T2's requests_per_minute: its first two base requests pass
MAX_TOKENS = 3


def named_tenant(server, name: str, quotas: dict | None = None) -> str:
    """Create tenant ``name`` (the metrics' tenant label); returns an API key."""
    r = server.http.post("/admin/tenants", json={"name": name, **({"quotas": quotas} if quotas else {})},
                         headers=server.admin())
    assert r.status_code == 201, r.text
    r = server.http.post(f"/admin/tenants/{r.json()['id']}/keys", json={"name": "k"}, headers=server.admin())
    assert r.status_code == 201, r.text
    return r.json()["key"]


def ask(client, model: str, i: int) -> tuple[int, int]:
    """One request (chat or completion, streamed or not, by ``i``); returns its (prompt, completion) tokens."""
    if i % 2 == 0:
        messages = [{"role": "user", "content": f"hello number {i}"}]
        if i % 4 == 0:
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS)
            return r.usage.prompt_tokens, r.usage.completion_tokens
        chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                     stream=True, stream_options={"include_usage": True}))
        return chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens
    r = client.completions.create(model=model, prompt="once upon a time " * (i + 1), max_tokens=MAX_TOKENS)
    return r.usage.prompt_tokens, r.usage.completion_tokens


def samples_of(values: dict, name: str) -> dict[tuple, float]:
    """{sorted label items: value} of every sample called ``name``."""
    return {tuple(sorted(labels)): v for (n, labels), v in values.items() if n == name}


def by(**labels) -> tuple:
    """A series' sorted labels; ``version`` is the served version's number for an adapter, "" otherwise."""
    if "adapter" in labels:
        labels.setdefault("version", "1" if labels["adapter"] not in ("_base", "_unresolved") else "")
    return tuple(sorted(labels.items()))


def scrape(server) -> dict:
    r = server.http.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse_scrape(r.text)


def test_known_workload_gives_exact_counts_per_tenant_and_adapter(serve, tmp_path, tiny_base, adapters):
    server = serve(settings_for(tmp_path, tiny_base))          # null engine in-process, tiny llama's tokenizer
    k1 = named_tenant(server, "acme")
    k2 = named_tenant(server, "globex", {"requests_per_minute": T2_ALLOWED})
    server.upload(k1, "support-bot", adapters["a"])
    base = server.gateway.model_name
    c1, c2 = server.openai(k1), server.openai(k2)

    tokens = {"support-bot": [0, 0], "base": [0, 0], "globex": [0, 0]}
    for i in range(N):
        p, c = ask(c1, "support-bot", i)
        tokens["support-bot"][0] += p
        tokens["support-bot"][1] += c
    for i in range(M):
        p, c = ask(c1, base, i)
        tokens["base"][0] += p
        tokens["base"][1] += c
    for i in range(T2_ALLOWED):
        p, c = ask(c2, base, i)
        tokens["globex"][0] += p
        tokens["globex"][1] += c
    for i in range(K):
        with pytest.raises(openai.RateLimitError) as e:
            ask(c2, base, i)
        assert e.value.status_code == 429 and "requests per minute" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        c1.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError) as e:
        server.openai("lpx_bad_key").chat.completions.create(model=base, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert tokens["support-bot"][1] == N * MAX_TOKENS and tokens["base"][1] == M * MAX_TOKENS

    v = scrape(server)
    assert samples_of(v, "loraplex_requests_total") == {
        by(tenant="acme", adapter="support-bot", status="200"): N,
        by(tenant="acme", adapter="_base", status="200"): M,
        by(tenant="acme", adapter="_unresolved", status="404"): 1,
        by(tenant="globex", adapter="_base", status="200"): T2_ALLOWED,
        by(tenant="globex", adapter="_base", status="429"): K,
        by(tenant="_unknown", adapter="_unresolved", status="401"): 1,
    }
    assert samples_of(v, "loraplex_request_errors_total") == {
        by(tenant="acme", adapter="_unresolved", status="404"): 1,
        by(tenant="globex", adapter="_base", status="429"): K,
        by(tenant="_unknown", adapter="_unresolved", status="401"): 1,
    }
    assert samples_of(v, "loraplex_quota_rejections_total") == {by(tenant="globex", kind="requests"): K}
    assert samples_of(v, "loraplex_prompt_tokens_total") == {
        by(tenant="acme", adapter="support-bot"): tokens["support-bot"][0],
        by(tenant="acme", adapter="_base"): tokens["base"][0],
        by(tenant="globex", adapter="_base"): tokens["globex"][0],
    }
    assert samples_of(v, "loraplex_completion_tokens_total") == {
        by(tenant="acme", adapter="support-bot"): N * MAX_TOKENS,
        by(tenant="acme", adapter="_base"): M * MAX_TOKENS,
        by(tenant="globex", adapter="_base"): T2_ALLOWED * MAX_TOKENS,
    }
    served = {by(tenant="acme", adapter="support-bot"): N, by(tenant="acme", adapter="_base"): M,
              by(tenant="globex", adapter="_base"): T2_ALLOWED}
    for hist in ("loraplex_time_to_first_token_seconds", "loraplex_time_per_output_token_seconds",
                 "loraplex_e2e_request_latency_seconds"):
        assert samples_of(v, f"{hist}_count") == served, hist   # served requests only, each once
        assert all(s >= 0 for s in samples_of(v, f"{hist}_sum").values())
    assert sample(v, "loraplex_engine_up", replica="null") == 1
    assert sample(v, "loraplex_engine_requests_running", replica="null") == 0

    # the dashboard reads the same metrics (admin bearer works as well as the cookie)
    assert server.http.get("/admin/dashboard/data").status_code == 401
    data = server.http.get("/admin/dashboard/data", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert data["totals"]["requests"] == N + M + T2_ALLOWED + K + 2
    assert data["totals"]["errors"] == K + 2
    rows = {row["tenant"]: row for row in data["tenants"]}
    assert rows["globex"]["quota_rejections"] == K and rows["globex"]["requests_per_minute"] == T2_ALLOWED
    assert rows["acme"]["requests_last_min"] == N + M + 1
    assert [e["replica"] for e in data["engines"]] == ["null"] and data["engines"][0]["up"] is True
    assert {e["status"] for e in data["errors"]} == {401, 404, 429}
    page = server.http.post("/admin/dashboard/login", data={"key": ADMIN_KEY}, follow_redirects=False)
    assert page.status_code == 303 and "loraplex_dashboard=" in page.headers["set-cookie"]


class PickyEngine(NullEngineClient):
    """The null engine (20 ms a token), but max_tokens=13 is refused before the first token and max_tokens=14
    breaks after it."""

    async def generate(self, request):
        if request.sampling.get("max_tokens") == 13:
            raise EngineRequestError("this engine refuses max_tokens=13")
        n = 0
        async for chunk in super().generate(request):
            yield chunk
            n += 1
            if request.sampling.get("max_tokens") == 14 and n == 1:
                raise EngineError("the engine failed mid-stream")


def test_disconnect_and_engine_errors_are_counted_with_their_status(serve, tmp_path, tiny_base):
    engine = PickyEngine(num_tokens=8, token_delay_s=0.02)
    server = serve(settings_for(tmp_path, tiny_base), replicas=[Replica("null", engine)])
    key = named_tenant(server, "acme")
    base = server.gateway.model_name
    stream_then_drop(server, key, base, max_tokens=200)
    wait_until(lambda: sample(scrape(server), "loraplex_requests_total", tenant="acme", adapter="_base",
                              status="499") == 1, what="the dropped stream to be counted as 499")
    with pytest.raises(openai.BadRequestError) as e:
        server.openai(key).chat.completions.create(model=base, messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=13)
    assert e.value.status_code == 400 and "refuses max_tokens=13" in e.value.message
    body = {"model": base, "messages": [{"role": "user", "content": "x"}], "max_tokens": 14, "stream": True}
    r = server.http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200 and "The engine failed to serve this request" in r.text \
        and "the engine failed mid-stream" not in r.text and r.text.endswith("data: [DONE]\n\n")  # detail: log only
    v = scrape(server)
    requests = samples_of(v, "loraplex_requests_total")
    assert requests == {by(tenant="acme", adapter="_base", status="499"): 1,
                        by(tenant="acme", adapter="_base", status="400"): 1,
                        by(tenant="acme", adapter="_base", status="500"): 1}   # the broken stream: its error's status
    assert samples_of(v, "loraplex_request_errors_total") == requests
    # the dropped stream's tokens are counted (what it got); latencies only of requests that had a token / were served
    assert 1 < sample(v, "loraplex_completion_tokens_total", tenant="acme", adapter="_base") < 200
    assert samples_of(v, "loraplex_e2e_request_latency_seconds_count") == {}
    assert samples_of(v, "loraplex_time_to_first_token_seconds_count") == {by(tenant="acme", adapter="_base"): 2}
    errors = server.http.get("/admin/dashboard/data", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["errors"]
    assert sorted((e["status"], e["error"]) for e in errors) == [(400, "invalid_request"), (499, "client_closed"),
                                                                 (500, "engine_error")]


def test_embedded_engine_gauges_come_from_the_real_engine(serve, tmp_path, tiny_base, adapters):
    server = serve(settings_for(tmp_path, tiny_base, engine_mode="embedded", engine_device="cpu",
                                engine_dtype="float32"))
    key = named_tenant(server, "acme")
    server.upload(key, "support-bot", adapters["a"])
    r = server.openai(key).completions.create(model="support-bot", prompt="hello there", max_tokens=MAX_TOKENS)
    assert r.usage.completion_tokens == MAX_TOKENS
    llm = server.gateway.router.replicas["embedded"].client.service.engine.engine
    e = "embedded"
    expected = {"loraplex_engine_up": 1, "loraplex_engine_kv_blocks_used": 0,
                "loraplex_engine_kv_blocks_free": llm.kv_cache.num_blocks, "loraplex_engine_requests_running": 0,
                "loraplex_engine_adapter_cold_starts_total": 1}
    tiers = {"gpu": 1, "cpu": 1, "disk": 1}   # in a slot, its CPU copy, and the disk cache entry

    def observed():
        v = scrape(server)
        return ({name: sample(v, name, replica=e) for name in expected},
                {t: sample(v, "loraplex_engine_adapters_resident", replica=e, tier=t) for t in tiers}, v)

    # gauges are as old as the last poll (at most 0.5 s on a scrape): wait for one after the request finished
    deadline = time.monotonic() + 5
    while (got := observed())[:2] != (expected, tiers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert got[:2] == (expected, tiers)
    v = got[2]
    assert llm.kv_cache.num_blocks > 0
    assert sample(v, "loraplex_engine_prefix_cache_queries_total", replica=e) > 0
    assert sample(v, "loraplex_engine_gpu_slot_hit_rate", replica=e) == 0   # one activation, no slot hit yet
    assert sample(v, "loraplex_requests_total", tenant="acme", adapter="support-bot", status="200") == 1


@pytest.fixture
def null_engine_process():
    """``loraplex engine serve --null`` as a child process: (url, Popen); killed after the test."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "engine", "serve", "--null", "--null-tokens", "4",
                             "--port", str(port), "--log-level", "warning"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for_port(port, timeout=30, proc=proc)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_http_engine_replica_stats_and_its_own_metrics(serve, tmp_path, tiny_base, null_engine_process):
    from loraplex.engine.stats import empty_stats

    url, proc = null_engine_process
    stats = httpx.get(f"{url}/v1/stats", timeout=10)
    assert stats.status_code == 200 and stats.json() == empty_stats()
    engine_scrape = httpx.get(f"{url}/metrics", timeout=10)
    assert engine_scrape.status_code == 200 and engine_scrape.headers["content-type"].startswith("text/plain")
    ev = parse_scrape(engine_scrape.text)
    assert sample(ev, "loraplex_engine_server_info", model="null") == 1
    assert sample(ev, "loraplex_engine_server_requests_running") == 0
    assert sample(ev, "loraplex_engine_server_kv_blocks_total") == 0
    assert sample(ev, "loraplex_engine_server_adapters_resident", tier="gpu") == 0
    assert not any(name.startswith("loraplex_engine_") and not name.startswith("loraplex_engine_server_")
                   for name, _ in ev)      # never the platform's per-replica names (no double counting)

    server = serve(settings_for(tmp_path, tiny_base, engine_urls=[url]))
    key = named_tenant(server, "acme")
    for i in range(2):
        ask(server.openai(key), server.gateway.model_name, i)
    v = scrape(server)
    assert sample(v, "loraplex_engine_up", replica=url) == 1
    assert sample(v, "loraplex_requests_total", tenant="acme", adapter="_base", status="200") == 2
    proc.kill()
    proc.wait(10)
    time.sleep(0.6)   # past the poller's max age: the next scrape polls again (and finds the replica gone)
    deadline = time.monotonic() + 10
    while (up := sample(scrape(server), "loraplex_engine_up", replica=url)) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert up == 0

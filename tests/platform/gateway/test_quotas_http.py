"""Quotas at the HTTP level (in-process store here; Redis in tests/e2e): 429 with Retry-After and x-ratelimit-*
headers, other tenants unaffected, the Redis-down setting both ways, and 200s carrying the headers too."""
from __future__ import annotations

import dataclasses

import openai
import pytest

from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.routing import Replica
from tests.platform.gateway.conftest import settings_for


def ask(client, model, **kw):
    return client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=kw.pop("max_tokens", 2), **kw)


def test_requests_per_minute_429_with_headers_and_other_tenant_unaffected(serve, tmp_path, tiny_base):
    server = serve(settings_for(tmp_path, tiny_base))
    _, key = server.new_tenant({"requests_per_minute": 3})
    _, other = server.new_tenant({"requests_per_minute": 3})
    model = server.gateway.model_name
    client = server.openai(key)
    remaining = []
    for _ in range(3):
        raw = ask(client, model)
        assert raw.http_response.status_code == 200
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
    assert remaining == [2, 1, 0]
    with pytest.raises(openai.RateLimitError) as e:
        ask(client, model)
    h = e.value.response.headers
    assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
    assert "requests per minute" in e.value.message
    assert int(h["retry-after"]) >= 19 and int(h["retry-after-ms"]) > 19_000  # one request per 20 s
    assert h["x-ratelimit-limit-requests"] == "3" and h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"].endswith("s")
    assert ask(server.openai(other), model).http_response.status_code == 200


class StopsAfterTwo(NullEngineClient):
    """The null engine, but every answer ends after two tokens (as if the model emitted EOS)."""

    async def generate(self, request):
        n = 0
        async for chunk in super().generate(request):
            n += 1
            if n == 2 and not chunk.finished:
                yield dataclasses.replace(chunk, finished=True, finish_reason="stop")
                return
            yield chunk


def test_token_reservation_refunds_and_request_too_large(serve, tmp_path, tiny_base):
    server = serve(settings_for(tmp_path, tiny_base), replicas=[Replica("stop2", StopsAfterTwo())])
    _, key = server.new_tenant({"tokens_per_minute": 200})
    client = server.openai(key)
    model = server.gateway.model_name
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, model, max_tokens=220)
    assert e.value.code == "request_too_large" and "lower max_tokens" in e.value.message
    # 200 tokens/min, each request reserves R = prompt + max_tokens and uses u = prompt + 2. With refunds the k-th
    # request passes while (k - 1) * u + R <= 200: three pass, the fourth is refused; without refunds only one.
    u = ask(client, model, max_tokens=2).parse().usage.total_tokens
    assert u < 45
    server.gateway.quotas._tenants.clear()  # start from a full bucket (the in-process store's state)
    reserve = 200 - 2 * u - 5
    statuses = []
    for _ in range(4):
        try:
            statuses.append(ask(client, model, max_tokens=reserve - (u - 2)).http_response.status_code)
        except openai.RateLimitError as e:
            statuses.append(e.status_code)
            assert "tokens per minute" in e.message and e.response.headers["x-ratelimit-limit-tokens"] == "200"
    assert statuses == [200, 200, 200, 429]


@pytest.mark.parametrize("fail_open", [False, True])
def test_redis_unreachable_fails_closed_or_open(serve, tmp_path, tiny_base, fail_open):
    server = serve(settings_for(tmp_path, tiny_base, redis_url="redis://127.0.0.1:1/0", quota_fail_open=fail_open,
                                quota_timeout_s=0.2))
    _, key = server.new_tenant({"requests_per_minute": 10})
    client = server.openai(key)
    if fail_open:
        assert ask(client, server.gateway.model_name).http_response.status_code == 200
        return
    with pytest.raises(openai.InternalServerError) as e:
        ask(client, server.gateway.model_name)
    assert e.value.status_code == 503 and e.value.code == "quota_store_unavailable"
    assert "quota store is unavailable" in e.value.message and e.value.response.headers["retry-after"] == "1"

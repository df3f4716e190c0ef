"""A request without ``max_tokens`` reserves ``min(DEFAULT_MAX_TOKENS_RESERVATION, context left)`` against
tokens/minute on the real Redis store, not the whole context: under a tokens/minute quota smaller than the context
it is served, the unused part comes back at the end, and tokens used past the reservation are charged."""
from __future__ import annotations

import math
import time
import uuid

import openai
import pytest

from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.routing import Replica
from tests.platform.gateway.conftest import settings_for
from tests.platform.gateway.test_quotas_http import StopsAfterTwo

REDIS_URL = "redis://127.0.0.1:6379/0"
CONTEXT = 1024          # the context the gateway validates against: far above the tenant's 200 tokens/minute
RESERVE = 40


@pytest.fixture
def redis_prefix():
    import redis

    prefix = f"loraplex-test:{uuid.uuid4().hex[:12]}"
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.exceptions.ConnectionError as e:
        pytest.fail(f"this test needs Redis at {REDIS_URL}: {e}")
    yield prefix
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def _settings(tmp_path, base, prefix):
    return settings_for(tmp_path, base, redis_url=REDIS_URL, quota_key_prefix=prefix, quota_timeout_s=5.0,
                        max_model_len=CONTEXT, default_max_tokens_reservation=RESERVE)


def _chat(client, **kw):
    return client.chat.completions.with_raw_response.create(
        model=kw.pop("model"), messages=[{"role": "user", "content": "hello"}], **kw)


def test_default_client_is_served_under_a_small_tpm_quota(serve, tmp_path, tiny_base, redis_prefix):
    server = serve(_settings(tmp_path, tiny_base, redis_prefix), replicas=[Replica("stop2", StopsAfterTwo())])
    _, key = server.new_tenant({"tokens_per_minute": 200})
    client, model = server.openai(key), server.gateway.model_name
    first = _chat(client, model=model)                       # no max_tokens: the context would be ~1000 tokens
    assert first.http_response.status_code == 200
    prompt = first.parse().usage.prompt_tokens
    assert first.parse().usage.completion_tokens == 2
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 200 - (prompt + RESERVE)
    # the second request sees the first one's unused reservation given back: only prompt + 2 stayed charged
    second = _chat(client, model=model)
    assert 200 - (prompt + 2) - (prompt + RESERVE) - 1 <= int(second.headers["x-ratelimit-remaining-tokens"]) \
        <= 200 - (prompt + 2) - (prompt + RESERVE) + 1
    # an explicit max_tokens is reserved as asked: past the burst it is refused, as before
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, model=model, max_tokens=300)
    assert e.value.code == "request_too_large"


def test_tokens_past_the_reservation_are_charged(serve, tmp_path, tiny_base, redis_prefix):
    """The null engine generates the whole context left when no max_tokens is set: far past the reservation."""
    server = serve(_settings(tmp_path, tiny_base, redis_prefix), replicas=[Replica("null", NullEngineClient())])
    _, key = server.new_tenant({"tokens_per_minute": 5000})
    client, model = server.openai(key), server.gateway.model_name
    start = time.monotonic()
    done = _chat(client, model=model)                        # chat: no max_tokens (completions default to 16)
    usage = done.parse().usage
    assert usage.prompt_tokens + usage.completion_tokens == CONTEXT
    assert int(done.headers["x-ratelimit-remaining-tokens"]) == 5000 - (usage.prompt_tokens + RESERVE)
    after = client.completions.with_raw_response.create(model=model, prompt=[1], max_tokens=1)
    charged = 5000 - int(after.headers["x-ratelimit-remaining-tokens"]) - 2       # minus this request's reservation
    # every token of the first one, less what refilled meanwhile (5000 a minute, over at most the time both requests
    # took); without the charge it would be ~50
    refilled = math.ceil((time.monotonic() - start) * 5000 / 60) + 1
    assert refilled < CONTEXT - 100, f"the two requests took {time.monotonic() - start:.1f} s"
    assert CONTEXT - refilled <= charged <= CONTEXT, (charged, refilled)

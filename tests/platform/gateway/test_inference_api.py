"""The OpenAI-compatible API through the official ``openai`` client against a live server with the null engine
(fixed tokens " tok"): chat and completions, streaming and not, /v1/models, tenant scoping and errors."""
from __future__ import annotations

import os

import openai
import pytest
from sqlalchemy import text

from tests.platform.gateway.conftest import settings_for

TOK = " tok"


@pytest.fixture
def server(serve, tmp_path, tiny_base):
    return serve(settings_for(tmp_path, tiny_base))


def test_chat_and_completions_stream_and_not(server):
    _, key = server.new_tenant()
    client = server.openai(key)
    base = os.path.basename(tiny_base_name(server))
    chat = client.chat.completions.create(model=base, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=5)
    assert chat.choices[0].message.content == TOK * 5
    assert chat.choices[0].finish_reason == "length"
    ids = server.gateway.tokenizer.encode(
        server.gateway.tokenizer.chat_template.render([{"role": "user", "content": "Hi there"}]),
        add_special_tokens=False)
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 5
    assert chat.usage.total_tokens == len(ids) + 5

    stream = client.chat.completions.create(model=base, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, stream=True, stream_options={"include_usage": True})
    events = list(stream)
    assert events[0].choices[0].delta.role == "assistant"
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == TOK * 4
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 4

    done = client.completions.create(model=base, prompt="Once upon a time", max_tokens=3)
    assert done.choices[0].text == TOK * 3 and done.usage.completion_tokens == 3
    parts = list(client.completions.create(model=base, prompt=[5, 6, 7], max_tokens=6, stream=True))
    assert "".join(p.choices[0].text for p in parts) == TOK * 6
    assert parts[-1].choices[0].finish_reason == "length"


def tiny_base_name(server) -> str:
    return server.gateway.model_name


def test_models_lists_base_and_own_adapters_only(server, adapters):
    _, key = server.new_tenant()
    _, other_key = server.new_tenant()
    server.upload(key, "support-bot", adapters["a"])
    server.upload(key, "support-bot", adapters["b"])
    server.upload(other_key, "secret-bot", adapters["a"])
    ids = [m.id for m in server.openai(key).models.list()]
    assert ids[0] == server.gateway.model_name
    assert set(ids[1:]) == {"support-bot", "support-bot:latest", "support-bot:1", "support-bot:2"}
    assert not any("secret" in i for i in ids)


def test_adapter_requests_and_tenant_scoping(server, adapters):
    tid, key = server.new_tenant()
    _, other_key = server.new_tenant()
    v = server.upload(key, "bot", adapters["a"])
    client = server.openai(key)
    for model in ("bot", "bot:1", "bot:latest"):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert r.choices[0].message.content == TOK * 2 and r.model == model
    # the engine got the tenant-scoped reference, and has the adapter resident
    residency = server.call(server.gateway.router.replicas["null"].client.residency())
    with server.gateway.sessions() as s:
        version_id = s.execute(text("SELECT id FROM adapter_versions WHERE number = :n"), {"n": v["number"]}).scalar()
    assert residency.cpu == [f"{tid}/bot/{version_id}"]
    # another tenant's adapter is 404 model_not_found, never 403
    with pytest.raises(openai.NotFoundError) as e:
        server.openai(other_key).chat.completions.create(model="bot", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert "`bot` does not exist" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="bot:7", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="Not A Model!", prompt="x")


def test_errors_are_openai_shaped(server):
    _, key = server.new_tenant()
    client = server.openai(key)
    base = server.gateway.model_name
    with pytest.raises(openai.AuthenticationError) as e:
        server.openai("lpx_0123456789_nope").chat.completions.create(
            model=base, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 401 and "API key" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=base, messages=[{"role": "user", "content": "x"}], n=300)
    assert e.value.param == "n" and "less than or equal to 128" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=base, messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    assert e.value.code == "context_length_exceeded" and "maximum context length is 256" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=base, messages=[], max_tokens=2)
    assert e.value.param == "messages"
    # disabled tenant: 403
    tid, key2 = server.new_tenant()
    r = server.http.post(f"/admin/tenants/{tid}/disable", headers=server.admin())
    assert r.status_code == 200, r.text
    server.gateway.auth.invalidate()
    with pytest.raises(openai.PermissionDeniedError) as e:
        server.openai(key2).completions.create(model=base, prompt="x", max_tokens=1)
    assert e.value.code == "tenant_disabled"

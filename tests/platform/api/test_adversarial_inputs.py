"""Bad and adversarial input to the OpenAI-compatible inference API: each gets a 400 in OpenAI's error shape naming
the field to fix, and none stalls the event loop. A live server with the null engine (fixed tokens " tok") and the
tiny llama checkpoint's tokenizer, through the official ``openai`` client (raw httpx only for bodies it cannot
send)."""
from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from tests.platform.gateway.conftest import serve, settings_for, tiny_base  # noqa: F401  (fixtures)

ASK = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


@pytest.fixture(scope="module")
def tools_base(tmp_path_factory) -> str:
    """The tiny llama with room for a tool's description in its context (2048 tokens)."""
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("models") / "tiny-llama-2k"),
                                max_position_embeddings=2048)


@pytest.fixture
def server(serve, tmp_path, tiny_base):  # noqa: F811
    return serve(settings_for(tmp_path, tiny_base))


@pytest.fixture
def tenant(server):
    """(openai client, base model name) of a tenant allowed one request at a time (a leaked lease shows at once)."""
    _, key = server.new_tenant({"max_concurrency": 1})
    return server.openai(key), server.gateway.model_name


def assert_still_serves(client, model) -> None:
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=2)
    assert r.choices[0].message.content == " tok" * 2


@pytest.mark.parametrize("stop, param, message", [
    ([1, 2], "stop.0", "Input should be a valid string"),
    ("", "stop", "at least 1 character"),
    ("x" * 1025, "stop", "at most 1024 characters"),
    (7, "stop", "Input should be a valid string"),
])
def test_bad_stop_names_the_field_not_a_validator_tag(tenant, stop, param, message):
    client, model = tenant
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=2, stop=stop)
    assert e.value.status_code == 400 and e.value.code == "invalid_value"
    assert e.value.param == param and message in e.value.message and "constrained" not in e.value.message
    assert e.value.body["type"] == "invalid_request_error"
    assert_still_serves(client, model)


def test_content_part_of_the_wrong_type_names_the_part(tenant):
    client, model = tenant
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, max_tokens=2,
                                       messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}])
    assert e.value.param == "messages.0.content.0.text"
    assert e.value.body["message"] == "Invalid value for 'messages.0.content.0.text': Input should be a valid string"
    with pytest.raises(openai.BadRequestError) as e:   # token-id lists with a string among them: that entry
        client.completions.create(model=model, prompt=[[5, 6], "x"], max_tokens=2)
    assert e.value.param == "prompt.1" and "valid list" in e.value.message


def test_lone_surrogate_in_a_key_is_escaped_in_the_error(server):
    _, key = server.new_tenant()
    raw = ('{"model": "%s", "messages": [{"role": "user", "content": "x", "\\udc00k": 1}], "\\ud800": 1}'
           % server.gateway.model_name).encode()
    r = server.http.post("/v1/chat/completions", content=raw,
                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = json.loads(r.content)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_text"
    # the key is named by its escape: the answer holds no lone surrogate, so strict UTF-8 JSON parsers read it
    assert error["param"] in ("\\ud800", "messages[0].\\udc00k")
    assert f"'{error['param']}' holds a lone surrogate" in error["message"]
    json.dumps(error, ensure_ascii=False).encode("utf-8")


def test_forced_tool_call_with_a_guided_field_names_both(serve, tmp_path, tools_base):  # noqa: F811
    server = serve(settings_for(tmp_path, tools_base))
    _, key = server.new_tenant({"max_concurrency": 1})
    client, model = server.openai(key), server.gateway.model_name
    named = {"type": "function", "function": {"name": "lookup"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=2, tools=[TOOL], tool_choice=named,
                                       extra_body={"guided_regex": "a+"})
    assert e.value.param == "tool_choice" and e.value.code == "invalid_value"
    assert e.value.body["message"].startswith("'tool_choice' " + json.dumps(named) + " makes the output tool calls, "
                                              "which 'guided_regex' cannot constrain")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=2, tools=[TOOL], tool_choice="required",
                                       response_format={"type": "json_object"})
    assert "'tool_choice' \"required\" makes" in e.value.message and "'response_format'" in e.value.message
    assert_still_serves(client, model)


def test_prompts_are_tokenized_off_the_event_loop(server, tenant):
    client, model = tenant
    tokenizer = server.gateway.tokenizer
    threads: list[int] = []
    encode = tokenizer.encode

    def recording(text, **kw):
        threads.append(threading.get_ident())
        return encode(text, **kw)

    tokenizer.encode = recording
    client.chat.completions.create(model=model, messages=ASK, max_tokens=2)
    client.completions.create(model=model, prompt=["one", "two"], max_tokens=2)
    assert len(threads) == 3 and server.thread.ident not in threads


def test_long_texts_tokenize_to_the_same_ids(server):
    from loraplex.platform.gateway.tokenizer import GIL_FREE_CHARS

    tokenizer = server.gateway.tokenizer
    text = "Once upon a time, <s> a </s> tale. " * (2 * GIL_FREE_CHARS // 30)
    assert len(text) > GIL_FREE_CHARS
    assert tokenizer.encode(text, add_special_tokens=True) == \
        tokenizer._fast.encode(text, add_special_tokens=True).ids
    assert tokenizer.encode_plain(text) == tokenizer._plain.encode(text, add_special_tokens=False).ids


def test_a_huge_prompt_does_not_stall_the_event_loop(server, tenant):
    """A prompt of a few MB takes seconds to tokenize; other requests are answered meanwhile, and it ends in a 400
    naming max_tokens."""
    client, model = tenant
    text = "hello world, this is a long prompt. " * 60000   # 2.2 MB: ~1.4M tokens, seconds of tokenizer time
    errors: list = []

    def ask():
        try:
            client.with_options(timeout=120).completions.create(model=model, prompt=text, max_tokens=2)
        except openai.BadRequestError as e:
            errors.append(e)

    asker = threading.Thread(target=ask)
    asker.start()
    worst = 0.0
    pings = 0
    while asker.is_alive():
        t0 = time.monotonic()
        assert server.http.get("/healthz").status_code == 200
        worst = max(worst, time.monotonic() - t0)
        pings += 1
        time.sleep(0.02)
    asker.join()
    assert len(errors) == 1 and errors[0].code == "context_length_exceeded" and errors[0].param == "max_tokens"
    assert pings > 5 and worst < 2.0, f"the event loop stalled {worst:.1f}s"
    assert_still_serves(client, model)


def test_a_flag_where_a_number_goes_is_a_400_not_a_coercion(tenant):
    """``temperature: true`` would otherwise sample at 1.0 and ``max_tokens: true`` generate one token."""
    client, model = tenant
    for field in ("temperature", "max_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=ASK, **{"max_tokens": 2, field: True})
        assert e.value.param == field and e.value.code == "invalid_value"
        assert e.value.body["message"].startswith(f"Invalid value for '{field}': Input should be a valid")
    assert_still_serves(client, model)


def test_oversized_headers_are_a_431_in_openai_shape(server, tenant):
    """A 100 KB Authorization header (or many headers) is answered by the app, not by the HTTP parser's plain 400;
    the connection is closed, and the next request on a new one is served."""
    from loraplex.platform.api.header_limit import MAX_HEADER_BYTES

    client, model = tenant
    body = {"model": model, "messages": ASK, "max_tokens": 2}
    for headers in ({"Authorization": "Bearer " + "k" * 100_000},
                    {f"x-pad-{i}": "v" * 1000 for i in range(MAX_HEADER_BYTES // 1000 + 1)}):
        r = server.http.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 431, r.text
        error = r.json()["error"]
        assert error["code"] == "request_header_fields_too_large" and error["type"] == "invalid_request_error"
        assert "send a shorter Authorization header" in error["message"] and r.headers["x-request-id"]
    assert_still_serves(client, model)

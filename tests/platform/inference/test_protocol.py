"""The OpenAI models: requests parse as the ``openai`` client sends them, responses validate as the ``openai``
client's own types, the SSE stream and error bodies work through the real ``openai`` client."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types import Completion as OACompletion
from openai.types import Model as OAModel
from openai.types.chat import ChatCompletion as OAChatCompletion
from openai.types.chat import ChatCompletionChunk as OAChatCompletionChunk

from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.inference import SSE_DONE, InferenceError, model_not_found, parse_sse, sse_event
from loraplex.platform.inference.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                                  ChatCompletionChunk, ChatCompletionRequest, ChatDelta,
                                                  Completion, CompletionChoice, CompletionRequest, ModelCard,
                                                  ModelList, Usage, new_id, now_s, openai_finish_reason,
                                                  parse_request, resolve_max_tokens)


def test_chat_request_to_engine_sampling():
    req = parse_request(ChatCompletionRequest, {
        "model": "bot:2", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 20,
        "temperature": 0.2, "top_p": 0.9, "stop": "END", "seed": 3, "stream": True,
        "stream_options": {"include_usage": True}, "top_k": 5, "user": "u-1"})
    assert req.requested_max_tokens == 20 and req.include_usage
    params = req.sampling_params(20)
    assert params == {"max_tokens": 20, "stop": ["END"], "temperature": 0.2, "top_p": 0.9, "seed": 3, "top_k": 5}
    assert SamplingParams.from_dict(params).max_tokens == 20  # the engine takes it as is


def test_completion_request_prompts():
    assert parse_request(CompletionRequest, {"model": "m", "prompt": "hello"}).prompts() == ["hello"]
    assert parse_request(CompletionRequest, {"model": "m", "prompt": [1, 2, 3]}).prompts() == [[1, 2, 3]]
    assert parse_request(CompletionRequest, {"model": "m", "prompt": ["one"]}).prompts() == ["one"]
    req = parse_request(CompletionRequest, {"model": "m", "prompt": ["a", "b"]})
    assert req.prompts() == ["a", "b"]
    assert parse_request(CompletionRequest, {"model": "m", "prompt": [[1, 2], [3]]}).prompts() == [[1, 2], [3]]
    assert req.sampling_params(16)["max_tokens"] == 16
    for empty in ([[]], [""]):   # one empty prompt is still a prompt (the gateway refuses it when tokenized)
        assert parse_request(CompletionRequest, {"model": "m", "prompt": empty}).prompts() == empty
    with pytest.raises(InferenceError, match="at most 128") as e:
        parse_request(CompletionRequest, {"model": "m", "prompt": ["x"] * 129})
    assert e.value.param == "prompt"


@pytest.mark.parametrize("body, param, message", [
    ({"model": "m", "messages": []}, "messages", "at least 1 item"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature",
     "less than or equal to 2"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "Input should be"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools.0.function", "Field required"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"},
     "reasoning_effort", "'low', 'medium' or 'high'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model", "Field required"),
])
def test_bad_requests_name_the_parameter(body, param, message):
    with pytest.raises(InferenceError, match=message) as e:
        parse_request(ChatCompletionRequest, body)
    assert e.value.status_code == 400 and e.value.param == param
    assert e.value.body().model_dump()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value, message", [
    ("temperature", True, "valid number"),
    ("presence_penalty", False, "valid number"),
    ("top_p", "0.5", "valid number"),
    ("max_tokens", True, "valid integer"),
    ("max_tokens", 5.0, "valid integer"),
    ("n", "2", "valid integer"),
    ("seed", 1.5, "valid integer"),
    ("stream", "true", "valid boolean"),
    ("logprobs", 1, "valid boolean"),
    ("logit_bias", {"5": "1"}, "valid number"),
    ("messages", [{"role": "user", "content": 5}], "valid string"),
])
def test_values_of_the_wrong_type_are_refused_not_coerced(field, value, message):
    """A flag where a number goes (``"temperature": true`` would run at 1.0), a number as a string, a fraction where
    an integer goes: each a 400 naming the field, as OpenAI answers them."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}
    with pytest.raises(InferenceError, match=message) as e:
        parse_request(ChatCompletionRequest, body)
    assert e.value.status_code == 400 and e.value.code == "invalid_value"
    assert e.value.param.split(".")[0] == field
    # the right types still parse: an integer where a number goes, JSON's true for a flag
    ok = parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                               "temperature": 1, "max_tokens": 5, "stream": True, "logprobs": False})
    assert ok.temperature == 1.0 and ok.max_tokens == 5 and ok.stream is True


def test_unsupported_parameters_are_400():
    with pytest.raises(InferenceError, match="'suffix' is not supported: insertion") as e:
        parse_request(CompletionRequest, {"model": "m", "prompt": "x", "suffix": "end"})
    assert e.value.code == "unsupported_parameter" and e.value.param == "suffix"
    with pytest.raises(InferenceError, match="Unrecognized request argument supplied: max_token;") as e:
        parse_request(CompletionRequest, {"model": "m", "prompt": "x", "max_token": 5})
    assert e.value.code == "unsupported_parameter" and e.value.param == "max_token"


@pytest.mark.parametrize("cls, extra, param, message", [
    ("chat", {"top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("completion", {"logprobs": 6}, "logprobs", "less than or equal to 5"),
    ("completion", {"n": 3, "best_of": 2}, "best_of", "greater than or equal to 'n'"),
    ("completion", {"best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
    ("completion", {"n": 129}, "n", "less than or equal to 128"),
])
def test_choice_parameters_out_of_range_are_400(cls, extra, param, message):
    base = ({"model": "m", "messages": [{"role": "user", "content": "x"}]} if cls == "chat"
            else {"model": "m", "prompt": "x"})
    with pytest.raises(InferenceError, match=message) as e:
        req = parse_request(ChatCompletionRequest if cls == "chat" else CompletionRequest, {**base, **extra})
        req.sampling_params(5)
    assert e.value.status_code == 400 and e.value.param == param


def test_choice_plans_to_engine_sampling():
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], n=2, logprobs=True,
                                 top_logprobs=4, temperature=0.5)
    assert chat.sampling_params(5) == {"max_tokens": 5, "temperature": 0.5, "n": 2, "logprobs": 4}
    # best_of > n: the engine runs best_of sequences with logprobs (their cumulative logprob ranks them)
    best = CompletionRequest(model="m", prompt="x", n=2, best_of=5)
    assert best.sampling_params(5) == {"max_tokens": 5, "n": 5, "logprobs": 0}
    plan = best.choice_plan()
    assert (plan.n, plan.candidates, plan.pick_best, plan.bill_factor) == (2, 5, True, 1)
    # greedy n > 1: one engine sequence, copied; billed for every choice
    greedy = CompletionRequest(model="m", prompt="x", n=3, temperature=0, echo=True, logprobs=2)
    assert greedy.sampling_params(5) == {"max_tokens": 5, "temperature": 0, "logprobs": 2, "prompt_logprobs": 2}
    plan = greedy.choice_plan()
    assert (plan.engine_n, plan.fanout, plan.bill_factor, plan.echo, plan.prompt_logprobs) == (1, 3, 3, True, True)
    for req in (chat, best, greedy):
        SamplingParams.from_dict(req.sampling_params(5))  # the engine takes them as they are


def test_max_tokens_resolution():
    assert resolve_max_tokens(None, 100, 256) == 156
    assert resolve_max_tokens(10, 100, 256) == 10
    with pytest.raises(InferenceError, match="maximum context length is 256 tokens. However, you requested 300") as e:
        resolve_max_tokens(200, 100, 256)
    assert e.value.code == "context_length_exceeded"


def test_responses_validate_as_openai_types():
    usage = Usage.of(7, 3, cached_tokens=4)
    chat = ChatCompletion(id=new_id("chatcmpl"), created=now_s(), model="bot:1", usage=usage, choices=[
        ChatChoice(message=AssistantMessage(content="hi"), finish_reason="stop")])
    parsed = OAChatCompletion.model_validate(chat.model_dump())
    assert parsed.choices[0].message.content == "hi" and parsed.usage.total_tokens == 10
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4
    chunk = ChatCompletionChunk(id="c1", created=1, model="m", choices=[
        ChatChunkChoice(delta=ChatDelta(role="assistant", content="x"))])
    assert OAChatCompletionChunk.model_validate(chunk.model_dump()).choices[0].delta.content == "x"
    comp = Completion(id="cmpl-1", created=1, model="m", usage=usage,
                      choices=[CompletionChoice(text="abc", finish_reason="length")])
    assert OACompletion.model_validate(comp.model_dump()).choices[0].finish_reason == "length"
    models = ModelList(data=[ModelCard(id="bot", created=1, owned_by="tenant")])
    assert OAModel.model_validate(models.model_dump()["data"][0]).id == "bot"
    assert [openai_finish_reason(r) for r in ("length", "stop", "abort", None)] == ["length", "stop", "stop", None]


def _openai_client(handler) -> openai.OpenAI:
    return openai.OpenAI(api_key="lpx_test", base_url="http://gateway.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def test_the_openai_client_reads_our_sse_stream():
    def events():
        created = now_s()
        yield sse_event(ChatCompletionChunk(id="c1", created=created, model="bot", choices=[
            ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]))
        for piece in ("Hel", "lo", "!"):
            yield sse_event(ChatCompletionChunk(id="c1", created=created, model="bot", choices=[
                ChatChunkChoice(delta=ChatDelta(content=piece))]))
        yield sse_event(ChatCompletionChunk(id="c1", created=created, model="bot", choices=[
            ChatChunkChoice(delta=ChatDelta(), finish_reason="length")]))
        yield sse_event(ChatCompletionChunk(id="c1", created=created, model="bot", choices=[],
                                            usage=Usage.of(5, 3)))
        yield SSE_DONE

    body = b"".join(events())
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers["authorization"]
        seen["body"] = request.read()
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    client = _openai_client(handler)
    stream = client.chat.completions.create(model="bot", messages=[{"role": "user", "content": "hi"}], stream=True,
                                            stream_options={"include_usage": True}, max_tokens=3)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello!" and chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 3
    assert seen["auth"] == "Bearer lpx_test"
    sent = parse_request(ChatCompletionRequest, json.loads(seen["body"]))
    assert sent.stream and sent.include_usage and sent.requested_max_tokens == 3
    assert parse_sse(body)[-1] == "[DONE]" and len(parse_sse(body)) == 7


def test_the_openai_client_reads_our_errors():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/completions") and b"ghost" in request.read():
            return httpx.Response(404, json=model_not_found("ghost").body().model_dump())
        err = InferenceError(429, "rate limit reached for requests per minute", code="rate_limit_exceeded",
                             headers={"retry-after": "2", "x-ratelimit-remaining-requests": "0"})
        return httpx.Response(429, json=err.body().model_dump(), headers=err.headers)

    client = _openai_client(handler)
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="ghost", prompt="x")
    assert nf.value.status_code == 404 and nf.value.code == "model_not_found"
    assert "The model `ghost` does not exist" in nf.value.message
    with pytest.raises(openai.RateLimitError) as rl:
        client.chat.completions.create(model="bot", messages=[{"role": "user", "content": "x"}])
    assert rl.value.status_code == 429 and rl.value.type == "rate_limit_exceeded"
    assert rl.value.response.headers["retry-after"] == "2"
    assert "requests per minute" in rl.value.message

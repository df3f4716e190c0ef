"""GPT-OSS chat in harmony through the real app with the official ``openai`` client: the prompt the engine gets is
harmony's reference rendering, ``reasoning_content`` comes apart from ``content`` (streamed and not), tool calls
come back as ``tool_calls``, malformed outputs degrade to content. A scripted engine plays the model's side (the
tiny model is random); the last test runs the real embedded engine on the tiny gpt_oss checkpoint."""
from __future__ import annotations

import json
import re

import openai
import pytest
from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
                            ToolDescription)

from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.engines.messages import EngineChunk, EngineRequest, OutputDelta
from loraplex.platform.inference.harmony import load_encoding
from loraplex.platform.inference.harmony.vocab import ENV_BASE, ENV_CACHE
from loraplex.platform.routing import Replica
from tests.platform.gateway.conftest import settings_for
from tests.utils.harmony_vocab import o200k_vocab_dir

REASONED = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
            '<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>')
CALLED = ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|>'
          '<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>'
          '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
          '{"location": "San Francisco"}<|call|>')
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Gets the current weather in the provided location.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}


@pytest.fixture(scope="session")
def gpt_oss_base(tmp_path_factory) -> str:
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    # harmony's system message alone is ~200 ids of the tiny (almost byte-level) tokenizer: room for it
    return make_tiny_checkpoint("gpt_oss", str(tmp_path_factory.mktemp("models") / "tiny-gpt-oss"),
                                max_position_embeddings=2048)


@pytest.fixture(scope="session")
def vocab_dir(tmp_path_factory) -> str:
    return o200k_vocab_dir(str(tmp_path_factory.mktemp("o200k")))


@pytest.fixture
def harmony_env(monkeypatch, tmp_path, vocab_dir):
    """The o200k vocabulary from the test copy (the tiny tokenizer is not o200k, so nothing can be rebuilt)."""
    monkeypatch.setenv(ENV_BASE, vocab_dir)
    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "harmony-cache"))


@pytest.fixture(scope="session")
def tok(gpt_oss_base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gpt_oss_base)


class ScriptedEngine(NullEngineClient):
    """The model's side: every request streams ``script`` (tokenized by the tiny tokenizer) three ids a chunk,
    cut at the first stop token the request asked for, as the engine would; requests are recorded."""

    def __init__(self, tok, script: str) -> None:
        super().__init__()
        self.tok, self.ids, self.requests = tok, tok.encode(script, add_special_tokens=False), []

    async def generate(self, request: EngineRequest):
        self.requests.append(request)
        stops = set(request.sampling.get("stop_token_ids", ()))
        ids = self.ids[:request.sampling["max_tokens"]]
        cut = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
        ids = ids[:cut]
        for i in range(0, len(ids), 3):
            part, last = ids[i:i + 3], i + 3 >= len(ids)
            reason = ("stop" if part[-1] in stops or part[-1] == self.tok.eos_token_id else "length") if last else None
            text = self.tok.decode(part, skip_special_tokens=True)
            yield EngineChunk(request.request_id, part, text, last, reason, len(request.prompt), i + len(part),
                              outputs=[OutputDelta(0, part, text, reason)])


def start(serve, tmp_path, base, engine):
    server = serve(settings_for(tmp_path, base), replicas=[Replica("scripted", engine)])
    _, key = server.new_tenant()
    return server, server.openai(key), server.gateway.model_name


def reference_prompt(vocab_dir: str, prompt_text: str, *, effort: str, instructions: str | None = None,
                     tools: list | None = None, history: list | None = None) -> str:
    """openai-harmony's rendering of the conversation, written with its own API (the date read off the prompt)."""
    date = re.search(r"Current date: (\d{4}-\d{2}-\d{2})\n", prompt_text).group(1)
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort(effort.capitalize())) \
        .with_conversation_start_date(date)
    messages = [Message.from_role_and_content(Role.SYSTEM, system)]
    if instructions or tools:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if tools:
            dev = dev.with_function_tools([ToolDescription.new(t["function"]["name"], t["function"]["description"],
                                                               parameters=t["function"]["parameters"]) for t in tools])
        messages.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    messages += history or []
    enc = load_encoding(vocab_dir)
    return enc.decode_utf8(enc.render_conversation_for_completion(Conversation.from_messages(messages),
                                                                  Role.ASSISTANT))


def test_reasoning_apart_from_content(serve, tmp_path, gpt_oss_base, harmony_env, vocab_dir, tok):
    engine = ScriptedEngine(tok, REASONED)
    server, client, model = start(serve, tmp_path, gpt_oss_base, engine)
    r = client.chat.completions.create(model=model, reasoning_effort="high", messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}])
    message = r.choices[0].message
    assert message.content == "2 + 2 = 4."
    assert message.reasoning_content == 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(engine.ids)
    # the engine got harmony's reference rendering, and harmony's stop tokens
    request = engine.requests[-1]
    text = tok.decode(request.prompt)
    assert text == reference_prompt(vocab_dir, text, effort="high", instructions="Be brief.", history=[
        Message.from_role_and_content(Role.USER, "What is 2 + 2?")])
    assert request.prompt == tok.encode(text, add_special_tokens=False) and r.usage.prompt_tokens == len(request.prompt)
    assert "\n\nReasoning: high\n\n" in text and text.endswith("<|start|>assistant")
    assert request.sampling["stop_token_ids"] == tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    # default effort: medium
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    assert "\n\nReasoning: medium\n\n" in tok.decode(engine.requests[-1].prompt)


def test_reasoning_streamed_apart_from_content(serve, tmp_path, gpt_oss_base, harmony_env, tok):
    server, client, model = start(serve, tmp_path, gpt_oss_base, ScriptedEngine(tok, REASONED))
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    content = [d.content for d in deltas if d.content]
    assert len(reasoning) > 3 and len(content) >= 2   # streamed as it comes, not at the end
    assert "".join(reasoning) == 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'
    assert "".join(content) == "2 + 2 = 4."
    assert not any(getattr(d, "reasoning_content", None) and d.content for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens > 0


def test_tool_calls(serve, tmp_path, gpt_oss_base, harmony_env, vocab_dir, tok):
    engine = ScriptedEngine(tok, CALLED)
    server, client, model = start(serve, tmp_path, gpt_oss_base, engine)
    ask = [{"role": "user", "content": "Weather in SF?"}]
    r = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking the weather." and \
        choice.message.reasoning_content == "Need to use function get_weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"location": "San Francisco"}
    text = tok.decode(engine.requests[-1].prompt)
    assert text == reference_prompt(vocab_dir, text, effort="medium", tools=[WEATHER_TOOL], history=[
        Message.from_role_and_content(Role.USER, "Weather in SF?")])
    # streamed: the call's id and name first, then its arguments in pieces
    parts = [d.tool_calls for c in client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL],
                                                                   stream=True) if c.choices
             for d in [c.choices[0].delta] if d.tool_calls]
    first = parts[0][0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
    assert len(parts) > 2 and all(p[0].id is None and p[0].index == 0 for p in parts[1:])
    assert json.loads("".join(p[0].function.arguments or "" for p in parts)) == {"location": "San Francisco"}
    # the call and its result go back to the model in harmony's form
    client.chat.completions.create(model=model, tools=[WEATHER_TOOL], messages=ask + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 20}'}])
    text = tok.decode(engine.requests[-1].prompt)
    assert text == reference_prompt(vocab_dir, text, effort="medium", tools=[WEATHER_TOOL], history=[
        Message.from_role_and_content(Role.USER, "Weather in SF?"),
        Message.from_role_and_content(Role.ASSISTANT, call.function.arguments).with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"temperature": 20}')
        .with_channel("commentary").with_recipient("assistant")])
    assert text.endswith('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
                         '{"temperature": 20}<|end|><|start|>assistant')
    # tool_choice "none": the model is not told of the tools and a call-shaped output stays content
    r = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL], tool_choice="none")
    assert "namespace functions" not in tok.decode(engine.requests[-1].prompt)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == 'Checking the weather.{"location": "San Francisco"}'


@pytest.mark.parametrize("script, content", [
    ("Hello there, no harmony here at all.</s>", "Hello there, no harmony here at all."),
    ("<|channel|>analysis<|message|>thinking and thinking and", ""),   # cut by max_tokens inside the analysis
    ("<|channel|>commentary to=python<|message|>print(1)<|call|>", "print(1)"),
])
def test_malformed_output_degrades_to_content(serve, tmp_path, gpt_oss_base, harmony_env, tok, script, content):
    server, client, model = start(serve, tmp_path, gpt_oss_base, ScriptedEngine(tok, script))
    for stream in (False, True):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], stream=stream)
        if stream:
            deltas = [c.choices[0].delta for c in r if c.choices]
            assert "".join(d.content or "" for d in deltas) == content
        else:
            assert r.choices[0].message.content == content and r.choices[0].message.tool_calls is None
            if "analysis" in script:
                assert r.choices[0].message.reasoning_content == "thinking and thinking and"
                assert r.choices[0].finish_reason == "length"


def test_bad_harmony_requests_are_400s(serve, tmp_path, gpt_oss_base, harmony_env, tok):
    server, client, model = start(serve, tmp_path, gpt_oss_base, ScriptedEngine(tok, REASONED))
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(messages=user, reasoning_effort="max"), "reasoning_effort", "'low', 'medium' or 'high'"),
        (dict(messages=user, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice.function.name", "not in 'tools'"),
        (dict(messages=user + [{"role": "tool", "tool_call_id": "call_nope", "content": "x"}]),
         "messages.1.tool_call_id", "needs the tool_call_id of an earlier assistant tool call"),
        (dict(messages=user, tools=[{"type": "function", "function": {"name": "has space"}}]),
         "tools.0.function.name", "should match pattern"),
    ]
    for kw, param, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, **kw)
        assert e.value.param == param and message in e.value.message, (kw, e.value.message)


def test_a_long_conversation_renders_in_a_worker_process(serve, tmp_path, gpt_oss_base, harmony_env, tok):
    """A conversation of MBs renders outside the gateway's process (harmony holds the GIL while it renders), from
    the request's own message objects; a refusal there keeps its field. The tiny model's 2048-token context makes
    the long prompt a 400 naming max_tokens once rendered."""
    from loraplex.platform.inference.harmony import render_pool

    server, client, model = start(serve, tmp_path, gpt_oss_base, ScriptedEngine(tok, REASONED))
    long = "a tale of 12345 words, 東京. " * (render_pool.LONG_CHARS // 20)
    before = render_pool.submitted
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": long}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": long},
                                                              {"role": "tool", "tool_call_id": "x", "content": "y"}])
    assert e.value.param == "messages.1.tool_call_id"
    assert render_pool.submitted == before + 2


def test_other_families_keep_their_template(serve, tmp_path, tiny_base):
    server = serve(settings_for(tmp_path, tiny_base))
    _, key = server.new_tenant()
    client, model = server.openai(key), server.gateway.model_name
    assert server.gateway.tokenizer.harmony is None
    raw = client.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": "hi"}])
    body = json.loads(raw.http_response.text)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": raw.parse().choices[0].message.content}
    with pytest.raises(openai.BadRequestError) as e:   # tools they have too: tests/platform/gateway/test_tool_calls.py
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       reasoning_effort="low")
    assert e.value.param == "reasoning_effort" and e.value.code == "unsupported_parameter"


def test_real_tiny_engine_end_to_end(serve, tmp_path, gpt_oss_base, harmony_env, vocab_dir, tok):
    """The embedded engine on the tiny gpt_oss checkpoint: the gateway sends harmony's prompt with its stop tokens,
    and the answer is the engine's own greedy tokens read through the harmony parser, streamed or not."""
    server = serve(settings_for(tmp_path, gpt_oss_base, engine_mode="embedded", engine_device="cpu",
                                engine_dtype="float32"))
    _, key = server.new_tenant()
    client, model = server.openai(key), server.gateway.model_name
    messages = [{"role": "user", "content": "Tell me about llamas"}]
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12,
                                       reasoning_effort="low")
    harmony = server.gateway.tokenizer.harmony
    prompt = harmony.prompt(messages, reasoning_effort="low")
    text = tok.decode(prompt)
    assert text == reference_prompt(vocab_dir, text, effort="low", history=[
        Message.from_role_and_content(Role.USER, "Tell me about llamas")])
    assert r.usage.prompt_tokens == len(prompt)

    async def direct():
        ids = []
        client_ = server.gateway.router.replicas["embedded"].client
        async for chunk in client_.generate(EngineRequest("direct", None, prompt, {
                "max_tokens": 12, "temperature": 0.0, "stop_token_ids": harmony.stop_token_ids})):
            ids += chunk.outputs[0].token_ids if chunk.outputs else []
        return ids

    ids = server.call(direct(), timeout=60)
    feed = harmony.parser()
    feed.push(ids)
    feed.finish()
    message = r.choices[0].message
    assert (message.content, getattr(message, "reasoning_content", None) or "") == \
        (feed.parser.content, feed.parser.reasoning)
    assert r.usage.completion_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12,
                                                 reasoning_effort="low", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == feed.parser.content
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == feed.parser.reasoning


BOUNDED_TOOL = {"type": "function", "function": {"name": "set_mode", "parameters": {
    "type": "object", "properties": {"mode": {"enum": ["fast", "slow"]}, "level": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 9}},
    "required": ["mode", "level"], "additionalProperties": False}}}


def test_forced_tool_call_grammar(serve, tmp_path, gpt_oss_base, harmony_env, tok):
    """tool_choice "required" / named: the engine gets harmony's one-call grammar beside the stop tokens."""
    engine = ScriptedEngine(tok, CALLED)
    server, client, model = start(serve, tmp_path, gpt_oss_base, engine)
    ask = [{"role": "user", "content": "Weather in SF?"}]
    r = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL, BOUNDED_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == \
        "get_weather"
    sampling = engine.requests[-1].sampling
    grammar = sampling["structured"]["grammar"]
    assert sampling["stop_token_ids"] == tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    assert "commentary to=functions.get_weather " in grammar and "set_mode" not in grammar
    client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL, BOUNDED_TOOL],
                                   tool_choice="required")
    grammar = engine.requests[-1].sampling["structured"]["grammar"]
    assert "functions.get_weather " in grammar and "functions.set_mode " in grammar
    client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL])
    assert "structured" not in engine.requests[-1].sampling   # auto: parsed, not forced


def test_forced_tool_call_on_the_real_tiny_engine(serve, tmp_path, gpt_oss_base, harmony_env):
    import jsonschema

    server = serve(settings_for(tmp_path, gpt_oss_base, engine_mode="embedded", engine_device="cpu",
                                engine_dtype="float32"))
    _, key = server.new_tenant()
    client, model = server.openai(key), server.gateway.model_name
    schema = BOUNDED_TOOL["function"]["parameters"]
    for stream in (False, True):
        for seed in (1, 2):
            args = dict(model=model, messages=[{"role": "user", "content": "Go fast"}],
                        tools=[WEATHER_TOOL, BOUNDED_TOOL], max_tokens=80, temperature=1.0, seed=seed,
                        tool_choice={"type": "function", "function": {"name": "set_mode"}})
            if stream:
                parts = [(c.choices[0].delta, c.choices[0].finish_reason)
                         for c in client.chat.completions.create(stream=True, **args) if c.choices]
                calls = [t for d, _ in parts for t in d.tool_calls or ()]
                assert calls[0].function.name == "set_mode" and calls[0].id.startswith("call_")
                arguments = "".join(t.function.arguments or "" for t in calls)
                reason = [r for _, r in parts if r][-1]
            else:
                r = client.chat.completions.create(**args)
                (call,) = r.choices[0].message.tool_calls
                assert call.function.name == "set_mode"
                arguments, reason = call.function.arguments, r.choices[0].finish_reason
            assert reason == "tool_calls"
            jsonschema.validate(json.loads(arguments), schema)

"""Tool calling outside harmony through the real app with the official ``openai`` client.

The real embedded engine on tiny checkpoints (random weights: they write gibberish, so what is checked is what
holds by construction): ``tool_choice`` "required" and a named function give calls whose arguments parse as JSON
valid for the function's schema, streamed and not, in every family's format (Llama 3.1 JSON, Hermes for Qwen3 and
Qwen3-MoE, Mistral for Mixtral), with two adapters in one batch, with n=2; "auto" gives exactly what the parser
reads off the engine's own tokens; a tool result in history reaches the prompt. A scripted engine plays a model that does call tools,
for the parsed ``tool_calls`` and their stream layout in each family's format.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.engines.messages import EngineChunk, EngineRequest, OutputDelta
from loraplex.platform.inference.tools import HERMES, LLAMA3_JSON, MISTRAL, ToolCallFeed
from loraplex.platform.routing import Replica
from tests.platform.gateway.conftest import make_adapter, settings_for

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two small numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "boolean"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
FAMILIES = ("llama", "qwen3")
ALL_FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral")   # Llama 3.1 JSON, Hermes, Hermes, Mistral
MAX_TOKENS = 200   # a forced call of these schemas: ~50 ids of wrapper, 8 characters of up to 4 bytes, 2 digits


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    # the tools' system text is ~1000 ids of the tiny (almost byte-level) tokenizer: room for it
    return {f: make_tiny_checkpoint(f, str(tmp_path_factory.mktemp("models") / f"tiny-{f}"),
                                    max_position_embeddings=2048) for f in ALL_FAMILIES}


@pytest.fixture(scope="module")
def family_adapters(bases, tmp_path_factory) -> dict[str, dict[str, str]]:
    return {f: {name: make_adapter(bases[f], str(tmp_path_factory.mktemp(f"adapter-{f}-{name}")), seed=seed)
                for name, seed in (("a", 1), ("b", 2))} for f in FAMILIES}


def real_engine(serve, tmp_path, base):
    server = serve(settings_for(tmp_path, base, engine_mode="embedded", engine_device="cpu", engine_dtype="float32"))
    _, key = server.new_tenant()
    return server, key


def assert_valid(calls, allowed: set[str]) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream) -> tuple[list, str | None, str]:
    """(calls assembled from ``delta.tool_calls``, the finish reason, the content) of a chat stream."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or ():
            if part.index not in calls:   # the first part: id, type and name
                assert part.id and part.type == "function" and part.function.name
                calls[part.index] = {"id": part.id, "type": "function",
                                     "function": {"name": part.function.name, "arguments": ""}}
            else:
                assert part.id is None and part.function.name is None
            calls[part.index]["function"]["arguments"] += part.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [openai.types.chat.ChatCompletionMessageToolCall.model_validate(calls[i]) for i in sorted(calls)], \
        reason, content


def forced(client, model, choice, *, stream: bool, messages=ASK, **kw):
    """(calls, finish reason, content) of one forced request."""
    args = dict(model=model, messages=messages, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                max_tokens=MAX_TOKENS, **kw)
    if stream:
        return streamed_calls(client.chat.completions.create(stream=True, **args))
    r = client.chat.completions.create(**args)
    return r.choices[0].message.tool_calls or [], r.choices[0].finish_reason, r.choices[0].message.content


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_required_and_named_give_valid_calls(serve, tmp_path, bases, family):
    server, key = real_engine(serve, tmp_path, bases[family])
    client, model = server.openai(key), server.gateway.model_name
    for choice, allowed in (("required", {"get_weather", "add"}),
                            ({"type": "function", "function": {"name": "add"}}, {"add"})):
        for stream in (False, True):
            for seed in (1, 2):
                calls, reason, content = forced(client, model, choice, stream=stream, temperature=1.0, seed=seed)
                assert reason == "tool_calls" and len(calls) == 1 and not content, (choice, stream, calls, content)
                assert_valid(calls, allowed)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_adapters_in_one_batch(serve, tmp_path, bases, family_adapters, family):
    server, key = real_engine(serve, tmp_path, bases[family])
    for name, folder in family_adapters[family].items():
        server.upload(key, f"bot-{name}", folder)
    client = server.openai(key)
    jobs = [(f"bot-{name}", choice, stream, seed) for name in ("a", "b") for stream in (False, True)
            for choice, seed in (("required", 3), ({"type": "function", "function": {"name": "get_weather"}}, 4))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: forced(client, j[0], j[1], stream=j[2], temperature=1.0, seed=j[3]), jobs))
    for (model, choice, stream, _), (calls, reason, content) in zip(jobs, results):
        assert reason == "tool_calls" and len(calls) == 1 and not content, (model, choice, stream)
        assert_valid(calls, {"get_weather"} if isinstance(choice, dict) else {"get_weather", "add"})


@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_calls_each_valid(serve, tmp_path, bases, family):
    server, key = real_engine(serve, tmp_path, bases[family])
    client, model = server.openai(key), server.gateway.model_name
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=400, temperature=1.0, seed=5)
    calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert calls and reason in ("tool_calls", "length")
    # cut by max_tokens: only the last call may be unfinished
    assert_valid(calls if reason == "tool_calls" else calls[:-1], {"get_weather", "add"})


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_is_what_the_parser_reads_off_the_engine(serve, tmp_path, bases, family):
    server, key = real_engine(serve, tmp_path, bases[family])
    client, model = server.openai(key), server.gateway.model_name
    gw = server.gateway
    body = dict(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=24)
    r = client.chat.completions.create(**body)
    from loraplex.platform.inference.protocol import ChatCompletionRequest

    prompt, n = gw.tokenizer.chat_prompt(ChatCompletionRequest.model_validate(body))
    assert r.usage.prompt_tokens == n

    async def direct():
        text = ""
        async for chunk in gw.router.replicas["embedded"].client.generate(
                EngineRequest("direct", None, prompt, {"max_tokens": 24, "temperature": 0.0})):
            text += chunk.outputs[0].text if chunk.outputs else ""
        return text

    feed = ToolCallFeed(gw.tokenizer.tool_format, functions={"get_weather", "add"})
    feed.push(server.call(direct(), timeout=60))
    feed.finish()
    message = r.choices[0].message
    assert (message.content or "") == feed.content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or ()] == \
        [(c.name, c.arguments) for c in feed.tool_calls]
    calls, _, content = streamed_calls(client.chat.completions.create(stream=True, **body))
    assert content == feed.content and len(calls) == len(feed.tool_calls)


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_result_in_history(serve, tmp_path, bases, family):
    server, key = real_engine(serve, tmp_path, bases[family])
    client, model = server.openai(key), server.gateway.model_name
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the next turn can be forced too, with the history in the prompt
    for stream in (False, True):
        calls, reason, _ = forced(client, model, "required", stream=stream, messages=history, temperature=1.0, seed=6)
        assert reason == "tool_calls"
        assert_valid(calls, {"get_weather", "add"})
    # the call and its result reach the model in the family's fallback form (the tiny template has no tools)
    from loraplex.platform.inference.protocol import ChatCompletionRequest

    gw = server.gateway
    prompt, _ = gw.tokenizer.chat_prompt(ChatCompletionRequest.model_validate(
        {"model": model, "messages": history, "tools": TOOLS}))
    text = gw.tokenizer.decode(prompt)
    fmt = gw.tokenizer.tool_format
    assert fmt.calls_text([("get_weather", call["function"]["arguments"])]) in text
    assert fmt.result_text("get_weather", '{"temperature": 21}') in text


# ---- a scripted model that calls tools ------------------------------------------------------------------------
class ScriptedEngine(NullEngineClient):
    """Streams ``script`` as the model's text, a few characters a chunk; records the requests."""

    def __init__(self, script: str) -> None:
        super().__init__()
        self.script, self.requests = script, []

    async def generate(self, request: EngineRequest):
        self.requests.append(request)
        pieces = [self.script[i:i + 5] for i in range(0, len(self.script), 5)]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            reason = "stop" if last else None
            yield EngineChunk(request.request_id, [1], piece, last, reason, len(request.prompt), k + 1,
                              outputs=[OutputDelta(0, [1], piece, reason)])


SCRIPTS = {
    "qwen3": ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": true}}\n</tool_call>', HERMES),
    "llama": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
              '{"name": "add", "parameters": {"a": 2, "b": true}}', LLAMA3_JSON),
    "mixtral": ('Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
                '{"name": "add", "arguments": {"a": 2, "b": true}}]', MISTRAL),
}


@pytest.mark.parametrize("family", sorted(SCRIPTS))
def test_auto_calls_of_a_model_that_calls(serve, tmp_path, bases, family):
    script, fmt = SCRIPTS[family]
    engine = ScriptedEngine(script)
    server = serve(settings_for(tmp_path, bases[family]), replicas=[Replica("scripted", engine)])
    _, key = server.new_tenant()
    client, model = server.openai(key), server.gateway.model_name
    assert server.gateway.tokenizer.tool_format is fmt
    expected = [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 2, "b": True})]
    content = None if family == "llama" else "Checking."
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == expected
    assert len({c.id for c in message.tool_calls}) == 2
    prompt = server.gateway.tokenizer.decode(engine.requests[-1].prompt)
    assert "get_weather" in prompt and "structured" not in engine.requests[-1].sampling   # auto: told, not forced
    calls, reason, streamed_content = streamed_calls(client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, stream=True))
    assert reason == "tool_calls" and streamed_content == (content or "")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    # tool_choice "none": not told of the tools, the call-shaped text stays content
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == script
    assert "get_weather" not in server.gateway.tokenizer.decode(engine.requests[-1].prompt)
    # required: the engine gets the calls' grammar
    client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required")
    grammar = engine.requests[-1].sampling["structured"]["grammar"]
    assert "%json" in grammar and '\\"name\\": \\"add\\"' in grammar


def test_bad_tools_are_400s(serve, tmp_path, bases):
    server = serve(settings_for(tmp_path, bases["qwen3"]))
    _, key = server.new_tenant()
    client, model = server.openai(key), server.gateway.model_name
    named = {"type": "function", "function": {"name": "nope"}}
    not_object = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    strict_bad = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}}}}
    cases = [
        (dict(tools=[WEATHER, WEATHER]), "tools.1.function.name", "must be unique"),
        (dict(tools=[not_object]), "tools.0.function.parameters", 'type "object"'),
        (dict(tools=TOOLS, tool_choice=named), "tool_choice.function.name", "not in 'tools'"),
        (dict(tools=TOOLS, tool_choice="always"), "tool_choice", '"required"'),
        (dict(tool_choice="required"), "tool_choice", "needs 'tools'"),
        (dict(tools=[WEATHER] * 129), "tools", "at most 128"),
        (dict(tools=[strict_bad], tool_choice="required"), "tools.0.function.parameters", "no-such-format"),
        (dict(messages=ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}], tools=TOOLS),
         "messages.1.tool_call_id", "earlier assistant tool call"),
    ]
    for kw, param, message in cases:
        kw = {"messages": ASK, **kw}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, **kw)
        assert e.value.param == param and message in e.value.message, (kw.get("tool_choice"), e.value.message)
        assert e.value.status_code == 400


def test_several_choices_with_logprobs(serve, tmp_path, bases):
    server, key = real_engine(serve, tmp_path, bases["qwen3"])
    client, model = server.openai(key), server.gateway.model_name
    args = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=2, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**args)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        assert_valid(c.message.tool_calls, {"get_weather", "add"})
        assert c.logprobs.content and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert sum(len(c.logprobs.content) for c in r.choices) == r.usage.completion_tokens   # every token, calls too
    # streamed: each choice's calls assembled apart
    parts: dict[int, list] = {0: [], 1: []}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            parts[c.index] += c.delta.tool_calls or []
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for index, deltas in parts.items():
        assert deltas[0].id and deltas[0].function.name and all(d.index == 0 for d in deltas)
        arguments = "".join(d.function.arguments or "" for d in deltas)
        jsonschema.validate(json.loads(arguments), SCHEMAS[deltas[0].function.name])

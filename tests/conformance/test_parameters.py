"""One test per parameter of ``chat.completions.create`` and ``completions.create`` (and each engine extension), from
the table in ``platform/inference/parameters.py``, with the official ``openai`` client against the real app and the
tiny llama: a supported parameter shows its effect (on the answer, or on the ``SamplingParams`` the engine got), a
refused one is a 400 ``unsupported_parameter`` naming it (its neutral values pass)."""
from __future__ import annotations

import inspect
import json
import re

import jsonschema
import openai
import pytest
from openai.resources.chat.completions.completions import Completions as ChatCompletions
from openai.resources.completions import Completions

from loraplex.platform.inference.parameters import PARAMETERS, parameters_of

MESSAGES = [{"role": "user", "content": "Tell me about llamas"}]
PROMPT = "Once upon a time"
CLIENT_ONLY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
SMALL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                 "b": {"enum": ["x", "y"]}},
                "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def call(live, endpoint: str, **kw):
    """A greedy, short request of ``endpoint`` ("chat" | "completion") with ``kw`` on top."""
    c = live.client()
    kw = {"model": live.model, "max_tokens": 4, "temperature": 0, **kw}
    if endpoint == "chat":
        return c.chat.completions.create(messages=kw.pop("messages", MESSAGES), **kw)
    return c.completions.create(prompt=kw.pop("prompt", PROMPT), **kw)


def text(r) -> str:
    choice = r.choices[0]
    return choice.message.content if hasattr(choice, "message") else choice.text


def streamed_text(events) -> str:
    parts = []
    for e in events:
        for c in e.choices:
            parts.append((c.delta.content if hasattr(c, "delta") else c.text) or "")
    return "".join(parts)


def sent(live) -> dict:
    """The SamplingParams fields of the last engine request."""
    return live.sent[-1].sampling


EFFECTS = {}


def effect(*keys: str):
    """Register the check of one or more "<endpoint>:<parameter>" rows."""
    def wrap(fn):
        for key in keys:
            EFFECTS[key] = fn
        return fn
    return wrap


# ---- both endpoints -----------------------------------------------------------------------------------------------
@effect("chat:model", "completion:model")
def _model(live, endpoint):
    base = call(live, endpoint, max_tokens=6, extra_body={"ignore_eos": True})
    tuned = call(live, endpoint, model=live.adapters[0], max_tokens=6, extra_body={"ignore_eos": True})
    assert tuned.model == live.adapters[0] and live.sent[-1].adapter is not None
    assert base.model == live.model and text(tuned) != text(base)


@effect("chat:frequency_penalty", "completion:frequency_penalty", "chat:presence_penalty",
        "completion:presence_penalty", "chat:top_p", "completion:top_p")
def _engine_float(live, endpoint, name):
    call(live, endpoint, **{name: 0.5})
    assert sent(live)[name] == 0.5


@effect("chat:logit_bias", "completion:logit_bias")
def _logit_bias(live, endpoint):
    tok = live.server.gateway.tokenizer
    token = tok.encode("llama", add_special_tokens=False)[0]
    r = call(live, endpoint, max_tokens=3, logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert text(r) == tok.decode([token] * 3)
    assert sent(live)["logit_bias"] == {str(token): 100.0}


@effect("chat:n", "completion:n")
def _n(live, endpoint):
    r = call(live, endpoint, n=3, temperature=1.0, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and sent(live)["n"] == 3


@effect("chat:seed", "completion:seed")
def _seed(live, endpoint):
    one = call(live, endpoint, temperature=1.0, seed=11, max_tokens=6)
    two = call(live, endpoint, temperature=1.0, seed=11, max_tokens=6)
    assert text(one) == text(two) and sent(live)["seed"] == 11


@effect("chat:stop", "completion:stop")
def _stop(live, endpoint):
    free = text(call(live, endpoint, max_tokens=10, extra_body={"ignore_eos": True}))
    at = next(i for i, ch in enumerate(free) if i > 0 and ch.isascii() and ch.isalpha())
    stopped = call(live, endpoint, max_tokens=10, stop=[free[at]], extra_body={"ignore_eos": True})
    assert text(stopped) == free[:free.index(free[at])] and stopped.choices[0].finish_reason == "stop"


@effect("chat:stream", "completion:stream")
def _stream(live, endpoint):
    whole = text(call(live, endpoint))
    assert streamed_text(list(call(live, endpoint, stream=True))) == whole


@effect("chat:stream_options", "completion:stream_options")
def _stream_options(live, endpoint):
    events = list(call(live, endpoint, stream=True, stream_options={"include_usage": True}))
    assert events[-1].choices == [] and events[-1].usage.total_tokens > 0
    assert all(e.usage is None for e in list(call(live, endpoint, stream=True)))


@effect("chat:temperature", "completion:temperature")
def _temperature(live, endpoint):
    assert text(call(live, endpoint, temperature=0)) == text(call(live, endpoint, temperature=0))
    assert sent(live)["temperature"] == 0.0
    call(live, endpoint, temperature=1.5)
    assert sent(live)["temperature"] == 1.5


@effect("chat:user", "completion:user", "chat:safety_identifier", "chat:prompt_cache_key")
def _accepted_not_used(live, endpoint, name):
    assert text(call(live, endpoint, **{name: "id-123"})) == text(call(live, endpoint))
    assert name not in sent(live)


@effect("chat:max_tokens", "completion:max_tokens", "chat:max_completion_tokens")
def _max_tokens(live, endpoint, name):
    r = call(live, endpoint, **{"max_tokens": None, name: 3}, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


@effect("chat:logprobs", "chat:top_logprobs")
def _chat_logprobs(live, endpoint, name):
    r = call(live, endpoint, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)


@effect("completion:logprobs")
def _completion_logprobs(live, endpoint):
    r = call(live, endpoint, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and all(1 <= len(t) <= 2 for t in lp.top_logprobs)


# ---- chat.completions ---------------------------------------------------------------------------------------------
@effect("chat:messages")
def _messages(live, endpoint):
    short = call(live, endpoint, messages=[{"role": "user", "content": "Hi"}])
    long = call(live, endpoint, messages=[{"role": "system", "content": "You are terse."}, *MESSAGES])
    assert long.usage.prompt_tokens > short.usage.prompt_tokens


@effect("chat:response_format")
def _response_format(live, endpoint):
    r = call(live, endpoint, max_tokens=40, response_format={"type": "json_object"})
    assert isinstance(json.loads(text(r)), dict) and sent(live)["structured"] == {"json_object": True}
    r = call(live, endpoint, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "pair", "schema": SMALL_SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(text(r)), SMALL_SCHEMA)
    assert text(call(live, endpoint, response_format={"type": "text"})) == text(call(live, endpoint))


@effect("chat:reasoning_effort")
def _reasoning_effort(live, endpoint):
    # the tiny llama is no reasoning model: the documented 400 (GPT-OSS: tests/platform/gateway/test_harmony_chat.py)
    with pytest.raises(openai.BadRequestError) as e:
        call(live, endpoint, reasoning_effort="low")
    assert e.value.param == "reasoning_effort"


@effect("chat:tools", "chat:tool_choice", "chat:parallel_tool_calls")
def _tools(live, endpoint, name):
    # accepted with tool_choice "none" (a plain answer); tool calls themselves: platform/inference/tools/'s tests and
    # tests/platform/gateway/test_harmony_chat.py
    r = call(live, endpoint, tools=TOOLS, tool_choice="none", parallel_tool_calls=False)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


# ---- completions --------------------------------------------------------------------------------------------------
@effect("completion:prompt")
def _prompt(live, endpoint):
    one = call(live, endpoint, prompt="a b c")
    r = call(live, endpoint, prompt=["a b c", PROMPT], n=2, temperature=1.0, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens + call(live, endpoint).usage.prompt_tokens
    ids = live.server.gateway.tokenizer.encode(PROMPT, add_special_tokens=True)
    assert text(call(live, endpoint, prompt=ids)) == text(call(live, endpoint))


@effect("completion:echo")
def _echo(live, endpoint):
    r = call(live, endpoint, echo=True)
    assert text(r) == PROMPT + text(call(live, endpoint))


@effect("completion:best_of")
def _best_of(live, endpoint):
    r = call(live, endpoint, best_of=3, n=1, temperature=1.0, seed=2, max_tokens=3, extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.usage.completion_tokens == 3 * 3 and sent(live)["n"] == 3


# ---- extensions (extra_body) --------------------------------------------------------------------------------------
@effect("completion:response_format")
def _completion_response_format(live, endpoint):
    r = call(live, endpoint, max_tokens=40, extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(text(r)), dict)


@effect("chat:top_k", "completion:top_k", "chat:min_tokens", "completion:min_tokens")
def _engine_int(live, endpoint, name):
    call(live, endpoint, extra_body={name: 2})
    assert sent(live)[name] == 2


@effect("chat:min_p", "completion:min_p", "chat:repetition_penalty", "completion:repetition_penalty")
def _engine_extension_float(live, endpoint, name):
    call(live, endpoint, extra_body={name: 0.25})
    assert sent(live)[name] == 0.25


@effect("chat:ignore_eos", "completion:ignore_eos")
def _ignore_eos(live, endpoint):
    r = call(live, endpoint, max_tokens=12, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and sent(live)["ignore_eos"] is True


@effect("chat:speculative", "completion:speculative")
def _speculative(live, endpoint):
    # this engine does not speculate: the opt-out reaches the engine and changes nothing; the engine's counters with
    # an engine that speculates: tests/platform/gateway/test_speculative.py
    default = text(call(live, endpoint, max_tokens=6, extra_body={"ignore_eos": True}))
    assert "speculative" not in sent(live)
    r = call(live, endpoint, max_tokens=6, extra_body={"ignore_eos": True, "speculative": False})
    assert sent(live)["speculative"] is False and text(r) == default
    with pytest.raises(openai.BadRequestError) as e:
        call(live, endpoint, extra_body={"speculative": "no"})
    assert e.value.param == "speculative" and e.value.code == "invalid_value"


@effect("chat:guided_json", "completion:guided_json")
def _guided_json(live, endpoint):
    for schema in (SMALL_SCHEMA, json.dumps(SMALL_SCHEMA)):   # an object or its JSON text
        r = call(live, endpoint, max_tokens=40, extra_body={"guided_json": schema})
        jsonschema.validate(json.loads(text(r)), SMALL_SCHEMA)


@effect("chat:guided_regex", "completion:guided_regex")
def _guided_regex(live, endpoint):
    r = call(live, endpoint, max_tokens=12, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text(r)) and r.choices[0].finish_reason == "stop"


@effect("chat:guided_choice", "completion:guided_choice")
def _guided_choice(live, endpoint):
    r = call(live, endpoint, max_tokens=12, extra_body={"guided_choice": ["yes", "no way"]})
    assert text(r) in ("yes", "no way")


@effect("chat:guided_grammar", "completion:guided_grammar")
def _guided_grammar(live, endpoint):
    r = call(live, endpoint, max_tokens=12, extra_body={"guided_grammar": 'start: "ab" ("c" | "d")'})
    assert text(r) in ("abc", "abd")


# ---- refused ------------------------------------------------------------------------------------------------------
REFUSED_VALUES = {
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "functions": [TOOLS[0]["function"]], "function_call": "auto", "prediction": {"type": "content", "content": "x"},
    "store": True, "metadata": {"k": "v"}, "service_tier": "flex", "web_search_options": {}, "verbosity": "low",
    "moderation": {"enabled": True}, "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "x"},
    "suffix": "The end.",
}

ROWS = [f"{e}:{p.name}" for p in PARAMETERS for e in p.endpoints]


@pytest.mark.parametrize("row", ROWS)
def test_parameter(live, row):
    endpoint, name = row.split(":")
    p = parameters_of(endpoint)[name]
    if p.status == "refused":
        with pytest.raises(openai.BadRequestError) as e:
            call(live, endpoint, extra_body={name: REFUSED_VALUES[name]})
        assert e.value.code == "unsupported_parameter" and e.value.param == name, e.value.body
        assert "not supported" in e.value.message
        for neutral in p.neutral:
            assert call(live, endpoint, extra_body={name: neutral}).choices
        return
    check = EFFECTS[row]
    args = inspect.signature(check).parameters
    check(live, endpoint, name) if "name" in args else check(live, endpoint)


def test_the_table_covers_the_openai_client():
    """Every parameter of the installed client's create() is in the table, and every row has a test here."""
    for endpoint, method in (("chat", ChatCompletions.create), ("completion", Completions.create)):
        names = set(inspect.signature(method).parameters) - CLIENT_ONLY
        missing = names - set(parameters_of(endpoint))
        assert not missing, f"{endpoint}: {sorted(missing)} not in parameters.py"
    untested = [r for r in ROWS if r not in EFFECTS and parameters_of(r.split(":")[0])[r.split(":")[1]].status
                != "refused"]
    assert not untested and set(REFUSED_VALUES) == {p.name for p in PARAMETERS if p.status == "refused"}


def test_unknown_fields_are_400_naming_them(live):
    for endpoint in ("chat", "completion"):
        with pytest.raises(openai.BadRequestError) as e:
            call(live, endpoint, extra_body={"max_token": 5})
        assert e.value.code == "unsupported_parameter" and e.value.param == "max_token"
        assert "Unrecognized request argument supplied: max_token" in e.value.message

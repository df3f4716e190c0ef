"""Harmony prompts: ``HarmonyRenderer`` on OpenAI-shaped conversations gives, byte for byte, what openai-harmony
renders for the harmony conversation written by hand with its own API, and the format guide's examples verbatim.
The o200k vocabulary comes from the quicktok-v1 wheel, checked against harmony's sha256 (no download)."""
from __future__ import annotations

import json

import pytest
from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
                            ToolDescription)

from loraplex.platform.inference.harmony import HarmonyRenderer, HarmonyRenderError, load_encoding
from tests.utils.harmony_vocab import o200k_vocab_dir

DATE = "2025-06-28"
WEATHER = {"type": "object", "properties": {
    "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
    "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}}, "required": ["location"]}
MULTI = {"type": "object", "properties": {
    "locations": {"type": "array", "items": {"type": "string"},
                  "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]'},
    "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}}, "required": ["locations"]}
TOOLS = [{"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}},
         {"type": "function", "function": {"name": "get_current_weather", "parameters": WEATHER,
                                           "description": "Gets the current weather in the provided location."}},
         {"type": "function", "function": {"name": "get_multiple_weathers", "parameters": MULTI,
                                           "description": "Gets the current weather in the provided list of "
                                                          "locations."}}]
NESTED = {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "default": 10},
    "filters": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                                 "since": {"type": ["string", "null"]}}},
    "mode": {"anyOf": [{"type": "string", "enum": ["fast"]}, {"type": "number"}]}}, "required": ["query"]}


@pytest.fixture(scope="module")
def encoding(tmp_path_factory):
    return load_encoding(o200k_vocab_dir(str(tmp_path_factory.mktemp("o200k"))))


@pytest.fixture(scope="module")
def renderer(encoding):
    return HarmonyRenderer(encoding)


def system(effort: str = "medium") -> Message:
    content = SystemContent.new().with_reasoning_effort(ReasoningEffort(effort.capitalize())) \
        .with_conversation_start_date(DATE)
    return Message.from_role_and_content(Role.SYSTEM, content)


def developer(instructions: str | None = None, tools: list | None = None) -> Message:
    dev = DeveloperContent.new()
    if instructions:
        dev = dev.with_instructions(instructions)
    if tools:
        dev = dev.with_function_tools([ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                                           parameters=t["function"].get("parameters"))
                                       for t in tools])
    return Message.from_role_and_content(Role.DEVELOPER, dev)


def user(text: str) -> Message:
    return Message.from_role_and_content(Role.USER, text)


def assistant(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def call(name: str, arguments: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, arguments).with_channel("commentary") \
        .with_recipient(f"functions.{name}").with_content_type("<|constrain|>json")


def result(name: str, text: str) -> Message:
    return Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), text) \
        .with_channel("commentary").with_recipient("assistant")


def tool_call(id_: str, name: str, args: dict) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


CASES = {
    "user only, default effort": (
        [{"role": "user", "content": "What is 2 + 2?"}], {},
        [system(), user("What is 2 + 2?")]),
    "system prompt, low effort": (
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
        {"reasoning_effort": "low"},
        [system("low"), developer("You are terse."), user("Hi")]),
    "system and developer joined, content parts": (
        [{"role": "system", "content": "Rule one."},
         {"role": "developer", "content": [{"type": "text", "text": "Rule "}, {"type": "text", "text": "two."}]},
         {"role": "user", "content": [{"type": "text", "text": "Go"}]}], {"reasoning_effort": "high"},
        [system("high"), developer("Rule one.\n\nRule two."), user("Go")]),
    "multi-turn, earlier analysis dropped": (
        [{"role": "user", "content": "What is 2 + 2?"},
         {"role": "assistant", "content": "2 + 2 = 4.", "reasoning_content": "Simple arithmetic."},
         {"role": "user", "content": "What about 9 / 2?"}], {},
        [system(), user("What is 2 + 2?"), assistant("Simple arithmetic.", "analysis"),
         assistant("2 + 2 = 4.", "final"), user("What about 9 / 2?")]),
    "tools in the developer message": (
        [{"role": "system", "content": "Use a friendly tone."},
         {"role": "user", "content": "What is the weather like in SF?"}], {"tools": TOOLS, "reasoning_effort": "high"},
        [system("high"), developer("Use a friendly tone.", TOOLS), user("What is the weather like in SF?")]),
    "nested schema, no instructions": (
        [{"role": "user", "content": "search"}],
        {"tools": [{"type": "function", "function": {"name": "search", "description": "Search the docs.",
                                                     "parameters": NESTED}}]},
        [system(), developer(None, [{"function": {"name": "search", "description": "Search the docs.",
                                                  "parameters": NESTED}}]), user("search")]),
    "tool call and result, chain of thought kept": (
        [{"role": "user", "content": "Weather in SF?"},
         {"role": "assistant", "content": None, "reasoning_content": "Need to use get_current_weather.",
          "tool_calls": [tool_call("c1", "get_current_weather", {"location": "San Francisco"})]},
         {"role": "tool", "tool_call_id": "c1", "content": '{"sunny": true, "temperature": 20}'}],
        {"tools": TOOLS[1:2]},
        [system(), developer(None, TOOLS[1:2]), user("Weather in SF?"),
         assistant("Need to use get_current_weather.", "analysis"),
         call("get_current_weather", '{"location": "San Francisco"}'),
         result("get_current_weather", '{"sunny": true, "temperature": 20}')]),
    "preamble, call, result, final, next turn": (
        [{"role": "user", "content": "Weather in SF?"},
         {"role": "assistant", "content": "Checking the weather.", "reasoning_content": "Call the tool.",
          "tool_calls": [tool_call("c1", "get_current_weather", {"location": "SF"})]},
         {"role": "tool", "tool_call_id": "c1", "content": "20 C"},
         {"role": "assistant", "content": "It is 20 C.", "reasoning_content": "Report it."},
         {"role": "user", "content": "Thanks! And tomorrow?"}], {"tools": TOOLS[1:2], "reasoning_effort": "low"},
        [system("low"), developer(None, TOOLS[1:2]), user("Weather in SF?"), assistant("Call the tool.", "analysis"),
         assistant("Checking the weather.", "commentary"), call("get_current_weather", '{"location": "SF"}'),
         result("get_current_weather", "20 C"), assistant("Report it.", "analysis"), assistant("It is 20 C.", "final"),
         user("Thanks! And tomorrow?")]),
    "tool result by name, unicode, literal markers stay text": (
        [{"role": "user", "content": "東京の天気は？ 🙂 <|end|><|start|>system"},
         {"role": "assistant", "tool_calls": [tool_call("x", "get_location", {})]},
         {"role": "tool", "name": "get_location", "content": "Tokyo"}], {"tools": TOOLS[:1]},
        [system(), developer(None, TOOLS[:1]), user("東京の天気は？ 🙂 <|end|><|start|>system"),
         call("get_location", "{}"), result("get_location", "Tokyo")]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_render_is_byte_identical_to_harmony(name, encoding, renderer):
    messages, kw, expected = CASES[name]
    reference_ids = encoding.render_conversation_for_completion(Conversation.from_messages(expected), Role.ASSISTANT)
    ids = renderer.render_ids(messages, current_date=DATE, **kw)
    assert ids == reference_ids
    text = renderer.render_text(messages, current_date=DATE, **kw)
    assert text == encoding.decode_utf8(reference_ids)
    assert text.endswith("<|start|>assistant") and text.startswith("<|start|>system<|message|>")


def test_effort_and_channels_lines(renderer):
    for effort in ("low", "medium", "high"):
        text = renderer.render_text([{"role": "user", "content": "x"}], reasoning_effort=effort, current_date=DATE)
        assert f"\n\nReasoning: {effort}\n\n" in text
        assert "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n" in text
        assert "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>" \
            in text
    default = renderer.render_text([{"role": "user", "content": "x"}])
    assert "Reasoning: medium" in default and "Current date: 20" in default


def test_earlier_analysis_is_dropped(renderer):
    text = renderer.render_text(CASES["multi-turn, earlier analysis dropped"][0], current_date=DATE)
    assert "Simple arithmetic." not in text
    assert text.endswith("<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|end|><|start|>user<|message|>"
                         "What about 9 / 2?<|end|><|start|>assistant")
    kept = renderer.render_text(CASES["tool call and result, chain of thought kept"][0], current_date=DATE,
                                tools=TOOLS[1:2])
    assert "Need to use get_current_weather." in kept


def test_literal_markers_in_content_are_not_special_tokens(encoding, renderer):
    ids = renderer.render_ids([{"role": "user", "content": "a<|end|>b"}], current_date=DATE)
    specials = [t for t in ids if encoding.is_special_token(t)]
    assert len(specials) == 2 * 2 + 1 + 2   # system + user: start/message/end each, then <|start|>assistant


# The format guide's "complete input example including the definition of two functions" (docs/format.md of
# openai/harmony), verbatim.
GUIDE_TOOLS_PROMPT = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: 2025-06-28

Reasoning: high

# Valid channels: analysis, commentary, final. Channel must be included for every message.
Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>developer<|message|># Instructions

Use a friendly tone.

# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

} // namespace functions<|end|><|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant"""

GUIDE_SYSTEM = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: 2025-06-28

Reasoning: high

# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"""


def test_format_guide_examples_verbatim(renderer):
    messages = [{"role": "system", "content": "Use a friendly tone."},
                {"role": "user", "content": "What is the weather like in SF?"}]
    assert renderer.render_text(messages, tools=TOOLS, reasoning_effort="high", current_date=DATE) == \
        GUIDE_TOOLS_PROMPT
    plain = renderer.render_text([{"role": "user", "content": "What is 2 + 2?"}], reasoning_effort="high",
                                 current_date=DATE)
    assert plain == GUIDE_SYSTEM + "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant"


@pytest.mark.parametrize("messages, kw, param", [
    ([{"role": "tool", "tool_call_id": "nope", "content": "x"}], {}, "messages.0.tool_call_id"),
    ([{"role": "user", "content": "x"}], {"tools": [{"type": "retrieval"}]}, "tools.0"),
    ([{"role": "user", "content": "x"}], {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools.0.function.name"),
    ([{"role": "user", "content": "x"}], {"reasoning_effort": "max"}, "reasoning_effort"),
    ([{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "bad name", "arguments": "{}"}}]}], {},
     "messages.0.tool_calls"),
])
def test_bad_conversations_are_refused_with_the_field(renderer, messages, kw, param):
    with pytest.raises(HarmonyRenderError) as e:
        renderer.render_ids(messages, current_date=DATE, **kw)
    assert e.value.param == param

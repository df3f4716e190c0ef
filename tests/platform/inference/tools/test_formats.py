"""Each family's call format: the text of calls (what the grammar forces and the parser reads), results, the
fallback system text, and which model types use it."""
from __future__ import annotations

import json

import pytest

from loraplex.platform.inference.tools import HERMES, LLAMA3_JSON, MISTRAL, Function, format_for

CALLS = [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1}')]


def test_model_types():
    assert format_for("qwen3") is HERMES and format_for("qwen3_moe") is HERMES
    assert format_for("llama") is LLAMA3_JSON and format_for("mixtral") is MISTRAL
    assert format_for("something_else") is HERMES and format_for(None) is HERMES


def test_calls_text():
    assert HERMES.calls_text(CALLS) == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
                                        '</tool_call>')
    assert LLAMA3_JSON.calls_text(CALLS) == ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                             '{"name": "add", "parameters": {"a": 1}}')
    assert MISTRAL.calls_text(CALLS) == ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                         '{"name": "add", "arguments": {"a": 1}}]')
    assert HERMES.calls_text([("f", "")]) == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_system_prompt_lists_every_function(fmt):
    fns = [Function("get_weather", "The weather.", {"type": "object", "properties": {"city": {"type": "string"}}}),
           Function("add", "", {"type": "object", "properties": {}})]
    text = fmt.system_prompt(fns)
    for f in fns:
        assert json.dumps(f.openai_tool()["function"]["parameters"]) in text and f'"name": "{f.name}"' in text
    assert {"hermes": "<tool_call>", "llama3_json": '"parameters"', "mistral": "[TOOL_CALLS]"}[fmt.name] in text


def test_result_text():
    assert HERMES.result_text("f", "21") == "<tool_response>\n21\n</tool_response>"
    assert MISTRAL.result_text("f", "21") == '[TOOL_RESULTS] {"name": "f", "content": "21"} [/TOOL_RESULTS]'
    assert LLAMA3_JSON.result_text("f", "21") == "Output of the function f: 21"

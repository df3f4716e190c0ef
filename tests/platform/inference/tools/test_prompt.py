"""Tools and tool turns as chat-template inputs: a template that reads ``tools`` gets them and the structured turns;
one that does not (the tiny checkpoints') gets the family's fallback text."""
from __future__ import annotations

import pytest

from loraplex.engine.testing.tiny_tokenizer import CHAT_TEMPLATE
from loraplex.platform.inference.chat_template import ChatTemplate
from loraplex.platform.inference.errors import InferenceError
from loraplex.platform.inference.protocol import ChatCompletionRequest
from loraplex.platform.inference.tools import (HERMES, LLAMA3_JSON, MISTRAL, has_tool_history, template_inputs,
                                               tool_request)
from loraplex.platform.inference.tools.prompt import short_call_id

TOOL_TEMPLATE = (   # a template that renders tools itself, as Qwen3's and Llama 3.1's do
    "{% if tools %}<|system|>TOOLS{% for t in tools %} {{ t.function.name }}={{ t.function.parameters | tojson }}"
    "{% endfor %}</s>{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}{% if m.role == 'tool' %}({{ m.tool_call_id }} {{ m.name }}){% endif %}</s>{% endfor %}"
    "<|assistant|>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
HISTORY = [{"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]


def request(messages, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **kw})


def test_native_template_gets_tools_and_structured_turns():
    body = request([{"role": "system", "content": "Be brief."}, *HISTORY], tools=[WEATHER])
    template = ChatTemplate(TOOL_TEMPLATE)
    assert template.supports_tools and not ChatTemplate(CHAT_TEMPLATE).supports_tools
    messages, extra = template_inputs(body.messages, tool_request(body), HERMES, native=True)
    assert extra == {"tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}}]}
    assert template.render(messages, **extra) == (
        '<|system|>TOOLS get_weather={"type": "object", "properties": {"city": {"type": "string"}}}</s>'
        "<|system|>Be brief.</s><|user|>Weather?</s>"
        '<|assistant|>[call_1 get_weather {"city": "Paris"}]</s>'   # arguments as an object, as transformers passes
        "<|tool|>21 C(call_1 get_weather)</s><|assistant|>")


def test_fallback_text_for_a_template_without_tools():
    body = request([{"role": "system", "content": "Be brief."}, *HISTORY], tools=[WEATHER])
    messages, extra = template_inputs(body.messages, tool_request(body), HERMES, native=False)
    assert extra == {}
    tools_text = HERMES.system_prompt(tool_request(body).functions)
    assert messages == [
        {"role": "system", "content": "Be brief.\n\n" + tools_text},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": HERMES.calls_text([("get_weather", '{"city": "Paris"}')])},
        {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}]
    # no system message: the tools' text is one, first; tool_choice "none": history only
    messages, _ = template_inputs(request(HISTORY).messages, tool_request(request(HISTORY, tools=[WEATHER])),
                                  LLAMA3_JSON, native=False)
    assert messages[0] == {"role": "system", "content": LLAMA3_JSON.system_prompt(
        tool_request(request(HISTORY, tools=[WEATHER])).functions)}
    assert messages[-1] == {"role": "user", "content": "Output of the function get_weather: 21 C"}
    body = request(HISTORY, tools=[WEATHER], tool_choice="none")
    messages, _ = template_inputs(body.messages, tool_request(body), HERMES, native=False)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"] and has_tool_history(body.messages)
    assert not has_tool_history(request(HISTORY[:1]).messages)


def test_tool_result_without_its_call_is_a_400():
    body = request([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_9", "content": "1"}])
    for native in (True, False):
        with pytest.raises(InferenceError) as e:
            template_inputs(body.messages, None, HERMES, native=native)
        assert e.value.status_code == 400 and e.value.param == "messages.1.tool_call_id"
    named = request([{"role": "user", "content": "x"}, {"role": "tool", "name": "get_weather", "content": "1"}])
    messages, _ = template_inputs(named.messages, None, HERMES, native=False)
    assert messages[-1]["content"] == "<tool_response>\n1\n</tool_response>"


def test_mistral_ids_are_nine_alphanumerics_that_pair_up():
    body = request(HISTORY, tools=[WEATHER])
    messages, _ = template_inputs(body.messages, tool_request(body), MISTRAL, native=True)
    call_id = messages[1]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum() and call_id == short_call_id("call_1")
    assert messages[2]["tool_call_id"] == call_id and short_call_id("call_2") != call_id
    messages, _ = template_inputs(body.messages, tool_request(body), HERMES, native=True)
    assert messages[1]["tool_calls"][0]["id"] == messages[2]["tool_call_id"] == "call_1"


def test_argument_text_kept_for_templates_that_write_it_as_is():
    source = TOOL_TEMPLATE.replace("{{ c.function.arguments | tojson }}",
                                   "{% if c.function.arguments is string %}{{ c.function.arguments }}{% else %}"
                                   "{{ c.function.arguments | tojson }}{% endif %}")
    template = ChatTemplate(source)
    assert template.takes_argument_text and not ChatTemplate(TOOL_TEMPLATE).takes_argument_text
    history = [dict(HISTORY[1], tool_calls=[{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": '{"city":"Paris"}'}}]), HISTORY[2]]
    body = request([HISTORY[0], *history], tools=[WEATHER])
    messages, extra = template_inputs(body.messages, tool_request(body), HERMES, native=True, argument_text=True)
    assert '[call_1 get_weather {"city":"Paris"}]' in template.render(messages, **extra)   # the model's own bytes
    messages, extra = template_inputs(body.messages, tool_request(body), HERMES, native=True)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}

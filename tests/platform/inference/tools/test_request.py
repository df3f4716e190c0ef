"""Validation of a chat request's tools: what is refused (400 naming the field) and what a valid one means."""
from __future__ import annotations

import pytest

from loraplex.platform.inference.errors import InferenceError
from loraplex.platform.inference.protocol import ChatCompletionRequest
from loraplex.platform.inference.tools import tool_request
from loraplex.platform.inference.tools.request import EMPTY_PARAMETERS


def body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **kw})


def fn(name: str, parameters=None, **kw) -> dict:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters is not None
                                                               else {}), **kw}}


def test_defaults():
    assert tool_request(body()) is None
    assert tool_request(body(tools=[fn("a")], tool_choice="none")) is None
    tools = tool_request(body(tools=[fn("a"), fn("b", {"properties": {"x": {"type": "integer"}}}, strict=True)]))
    assert tools.choice == "auto" and not tools.forced and tools.parallel and tools.names == {"a", "b"}
    a, b = tools.functions
    assert a.parameters == EMPTY_PARAMETERS and not a.strict
    assert b.parameters == {"type": "object", "properties": {"x": {"type": "integer"}}} and b.strict
    assert b.openai_tool() == {"type": "function", "function": {"name": "b", "parameters": b.parameters}}


def test_forced_choices():
    tools = tool_request(body(tools=[fn("a"), fn("b")], tool_choice="required", parallel_tool_calls=False))
    assert tools.forced and not tools.parallel and tools.names == {"a", "b"}
    tools = tool_request(body(tools=[fn("a"), fn("b")], tool_choice={"type": "function", "function": {"name": "b"}}))
    assert tools.choice == "function" and tools.forced and tools.names == {"b"} and tools.parallel


@pytest.mark.parametrize("kw, param, message", [
    (dict(tools=[fn("a"), fn("b"), fn("a")]), "tools.2.function.name", "also tools[0]'s"),
    (dict(tools=[fn("a", {"type": "array"})]), "tools.0.function.parameters", 'type "object"'),
    (dict(tools=[fn("a")], tool_choice="any"), "tool_choice", "got 'any'"),
    (dict(tools=[fn("a")], tool_choice={"type": "function"}), "tool_choice", '"function": {"name": NAME}'),
    (dict(tools=[fn("a")], tool_choice={"type": "function", "function": {"name": "z"}}),
     "tool_choice.function.name", "'z', which is not in 'tools' (offered: a)"),
    (dict(tool_choice="required"), "tool_choice", "needs 'tools'"),
    (dict(tool_choice={"type": "function", "function": {"name": "a"}}), "tool_choice", "needs 'tools'"),
])
def test_refusals_name_the_field(kw, param, message):
    with pytest.raises(InferenceError) as e:
        tool_request(body(**kw))
    assert e.value.status_code == 400 and e.value.param == param and message in e.value.message

"""A chat request's tools, validated: the functions offered, ``tool_choice`` and ``parallel_tool_calls``.

    tool_request(body) -> ToolRequest | None     None: no tools, or tool_choice "none" (the model is not told)

``tool_choice``: "auto" (default with tools: the model decides, its output is parsed), "none", "required" (at
least one call, enforced by the engine's grammar) or ``{"type": "function", "function": {"name": NAME}}`` (that
function, enforced). ``parallel_tool_calls`` false: a forced choice makes exactly one call. Every problem is a 400
naming the field: a function's ``parameters`` that is not a JSON Schema of type object, two functions with one
name, a named choice that is not among the tools, ``required`` or a name without tools.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loraplex.platform.inference.errors import InferenceError

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Function:
    """One offered function: ``parameters`` is its JSON Schema (an object schema; ``{}`` when none was sent)."""

    name: str
    description: str
    parameters: dict
    strict: bool = False

    def openai_tool(self) -> dict:
        """The OpenAI tool entry, as chat templates take ``tools``."""
        fn: dict[str, Any] = {"name": self.name, **({"description": self.description} if self.description else {}),
                              "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    functions: tuple[Function, ...]
    choice: str                 # "auto" | "required" | "function"
    named: str | None = None    # choice "function": the name
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The output must be tool calls (grammar-enforced): ``required`` or a named function."""
        return self.choice in ("required", "function")

    @property
    def callable(self) -> tuple[Function, ...]:
        """The functions the output may call: the named one, or all."""
        if self.choice == "function":
            return tuple(f for f in self.functions if f.name == self.named)
        return self.functions

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.callable)


def _bad(message: str, param: str) -> InferenceError:
    return InferenceError(400, message, param=param, code="invalid_value")


def _functions(tools: list) -> tuple[Function, ...]:
    out: list[Function] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in seen:
            raise _bad(f"tools[{i}].function.name {fn.name!r} is also tools[{seen[fn.name]}]'s; function names must "
                       "be unique", f"tools.{i}.function.name")
        seen[fn.name] = i
        params = fn.parameters
        if params is None or params == {}:
            params = EMPTY_PARAMETERS
        elif params.get("type", "object") != "object":
            raise _bad(f"tools[{i}].function.parameters must be a JSON Schema of type \"object\" (the arguments are "
                       f"a JSON object), got type {json.dumps(params.get('type'))}", f"tools.{i}.function.parameters")
        elif "type" not in params:
            params = {**params, "type": "object"}
        out.append(Function(fn.name, fn.description or "", params, bool(fn.strict)))
    return tuple(out)


def _choice(raw: Any, has_tools: bool) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if has_tools else "none"), None
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise _bad(f"'tool_choice' must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {raw!r}", "tool_choice")
        return raw, None
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if raw.get("type") != "function" or not isinstance(name, str) or not name:
        raise _bad("a named 'tool_choice' is {\"type\": \"function\", \"function\": {\"name\": NAME}}",
                   "tool_choice")
    return "function", name


def tool_request(body: Any) -> ToolRequest | None:
    """The validated tools of a chat request (``ChatCompletionRequest``); None when the model gets no tools."""
    tools = list(getattr(body, "tools", None) or [])
    choice, named = _choice(getattr(body, "tool_choice", None), bool(tools))
    if choice in ("required", "function") and not tools:
        raise _bad(f"'tool_choice' {json.dumps(getattr(body, 'tool_choice'))} needs 'tools' to choose from; send "
                   "the functions in 'tools'", "tool_choice")
    functions = _functions(tools)
    if choice == "none" or not tools:
        return None
    if named is not None and named not in {f.name for f in functions}:
        raise _bad(f"'tool_choice' names the function {named!r}, which is not in 'tools' (offered: "
                   f"{', '.join(f.name for f in functions)})", "tool_choice.function.name")
    parallel = getattr(body, "parallel_tool_calls", None)
    return ToolRequest(functions, choice, named, parallel is not False)

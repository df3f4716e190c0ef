"""A chat conversation with tools as chat-template inputs: ``(messages, template kwargs)``.

Two ways, by the model's template:

* native (the template reads ``tools``: Qwen3's, Llama 3.1's, Mistral's): the template gets ``tools=`` (OpenAI's
  tool entries) and the messages as transformers passes them: assistant ``tool_calls`` with ``arguments`` as a
  JSON object (the text when it is not JSON, or when the template writes the text as it is:
  ``argument_text``, so the prompt holds the model's own bytes), ``tool`` messages with ``tool_call_id``,
  ``name`` and ``content``.
* fallback (a template without tools): the family's tool text (``ToolFormat.system_prompt``) is added to the
  first system message (or is one, first), an assistant turn's calls become its text in the family's wrapper
  (after its content), and a tool result becomes a ``user`` turn (``ToolFormat.result_text``).

Either way a ``tool`` message must answer an earlier assistant call (its ``tool_call_id``) or carry the function's
``name``; else a 400 naming ``messages.N.tool_call_id``. Mistral's templates take only 9-character alphanumeric
call ids: in that format every id (a call's and the result's ``tool_call_id`` alike) is replaced by one derived
from it (``short_call_id``), so calls and results still pair up.
"""
from __future__ import annotations

import hashlib
import json
import string
from typing import Any, Iterable

from loraplex.platform.inference.errors import InferenceError
from loraplex.platform.inference.tools.formats import ToolFormat
from loraplex.platform.inference.tools.request import ToolRequest


def _text(m: Any) -> str:
    return m.text() if hasattr(m, "text") else str(m.get("content") or "")


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments


_ALPHANUMERIC = string.ascii_letters + string.digits


def short_call_id(call_id: str) -> str:
    """A 9-character alphanumeric id derived from ``call_id`` (the same for the same id)."""
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    out = ""
    for _ in range(9):
        n, k = divmod(n, len(_ALPHANUMERIC))
        out += _ALPHANUMERIC[k]
    return out


def has_tool_history(messages: Iterable[Any]) -> bool:
    """Whether any message is a tool result or an assistant turn with tool calls."""
    return any(m.role == "tool" or m.tool_calls for m in messages)


def template_inputs(messages: list, tools: ToolRequest | None, fmt: ToolFormat, *, native: bool,
                    argument_text: bool = False) -> tuple[list[dict], dict[str, Any]]:
    """``(messages, kwargs)`` for ``ChatTemplate.render``; ``messages`` are ``ChatMessage`` models."""
    names: dict[str, str] = {}       # tool_call_id -> function name
    out: list[dict] = []
    ids = short_call_id if fmt.name == "mistral" else (lambda i: i)
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            for call in m.tool_calls:
                names[call.id] = call.function.name
            if native:
                out.append({"role": "assistant", "content": _text(m), "tool_calls": [
                    {"id": ids(c.id), "type": "function", "function": {
                        "name": c.function.name, "arguments": c.function.arguments if argument_text
                        else _arguments_value(c.function.arguments)}}
                    for c in m.tool_calls]})
            else:
                calls = fmt.calls_text((c.function.name, c.function.arguments) for c in m.tool_calls)
                out.append({"role": "assistant", "content": "\n".join(p for p in (_text(m), calls) if p)})
        elif m.role == "tool":
            name = names.get(m.tool_call_id or "") or m.name
            if not name:
                raise InferenceError(400, f"messages[{i}] (role tool) needs the tool_call_id of an earlier assistant "
                                          "tool call (or the function's name)", param=f"messages.{i}.tool_call_id",
                                     code="invalid_value")
            if native:
                out.append({"role": "tool", "content": _text(m), "tool_call_id": ids(m.tool_call_id or ""),
                            "name": name})
            else:
                out.append({"role": "user", "content": fmt.result_text(name, _text(m))})
        else:
            d = {"role": m.role, "content": _text(m)}
            if m.name:
                d["name"] = m.name
            out.append(d)
    if tools is None:
        return out, {}
    if native:
        return out, {"tools": [f.openai_tool() for f in tools.functions]}
    text = fmt.system_prompt(tools.functions)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, {}

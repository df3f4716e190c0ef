"""``tool_choice`` "required" or a named function, enforced: a Lark grammar (llguidance's dialect) of the family's
call wrapper around each function's JSON Schema, sent to the engine as ``structured: {"grammar": ...}``.

    start: call ("\\n" call)*              parallel_tool_calls (default): one call or more; false: start: call
    call: call_0 | call_1                  the functions the choice allows (Hermes' wrapper here)
    call_0: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " args_0 "}\\n</tool_call>"
    args_0: %json {<the function's parameters>}

The arguments are JSON valid for the function's schema by construction; JSON whitespace is at most one space
(as the engine's own JSON schemas), so a weak model cannot loop on newlines; a tenant's own ``x-guidance``
options in a schema are replaced. A function's schema is compiled as ``strict`` says: strict functions refuse
keywords the grammar library cannot enforce (400 naming the function's ``parameters``), others leave those
keywords unchecked. ``check_schemas`` validates each function's
schema in the gateway (no tokenizer needed), so a bad one is a 400 before the engine sees the request.
``harmony_tool_grammar`` is the same for GPT-OSS: one call in harmony's commentary-channel form.
"""
from __future__ import annotations

import json

from loraplex.platform.inference.errors import InferenceError
from loraplex.platform.inference.tools.formats import ToolFormat
from loraplex.platform.inference.tools.request import ToolRequest

JSON_WHITESPACE = "[ ]?"
MAX_ERROR_CHARS = 400


def _literal(text: str) -> str:
    return json.dumps(text)


def _args_schema(parameters: dict, strict: bool) -> dict:
    """The function's schema with the grammar library's options (a tenant's own ``x-guidance`` is replaced)."""
    return {**parameters, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE, "lenient": not strict}}


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p and p != '""')


def tool_grammar(tools: ToolRequest, fmt: ToolFormat) -> str:
    """The Lark grammar of the calls ``tools`` forces, written in ``fmt``."""
    rules = []
    alternatives = []
    for i, fn in enumerate(tools.callable):
        head = fmt.call_prefix + f'{{"name": {json.dumps(fn.name)}, "{fmt.args_key}": '
        rules.append(f"call_{i}: {_seq(_literal(head), f'args_{i}', _literal('}' + fmt.call_suffix))}")
        rules.append(f"args_{i}: %json {json.dumps(_args_schema(fn.parameters, fn.strict))}")
        alternatives.append(f"call_{i}")
    calls = "call" if not tools.parallel else f"call ({_seq(_literal(fmt.call_separator), 'call')})*"
    start = f"start: {_seq(_literal(fmt.list_prefix), calls, _literal(fmt.list_suffix))}"
    return "\n".join([start, "call: " + " | ".join(alternatives), *rules]) + "\n"


def harmony_tool_grammar(tools: ToolRequest) -> str:
    """GPT-OSS (harmony): the assistant's message is one call of an allowed function on the commentary channel,
    ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments}<|call|>`` (the markers are
    the tokenizer's special tokens; a forced call goes straight to the function, with no analysis before it).
    Harmony makes one call per turn, so ``parallel_tool_calls`` changes nothing here."""
    rules, alternatives = [], []
    for i, fn in enumerate(tools.callable):
        rules.append(f"call_{i}: <|channel|> {_literal(f'commentary to=functions.{fn.name} ')} <|constrain|> "
                     f'"json" <|message|> args_{i} <|call|>')
        rules.append(f"args_{i}: %json {json.dumps(_args_schema(fn.parameters, fn.strict))}")
        alternatives.append(f"call_{i}")
    return "\n".join(["start: " + " | ".join(alternatives), *rules]) + "\n"


def check_schemas(tools: ToolRequest) -> None:
    """400 naming ``tools.N.function.parameters`` for a schema the grammar library refuses."""
    import llguidance

    for i, fn in enumerate(tools.functions):
        if fn not in tools.callable:
            continue
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(_args_schema(fn.parameters, fn.strict))
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
            error = messages[0] if is_error and messages else ""
        except ValueError as e:
            error = str(e) or type(e).__name__
        if error:
            error = error.strip()
            short = error if len(error) <= MAX_ERROR_CHARS else error[:MAX_ERROR_CHARS] + "…"
            hint = "" if not fn.strict else "; or send strict=false to leave unsupported keywords unchecked"
            raise InferenceError(400, f"tools[{i}].function.parameters cannot be enforced for tool_choice "
                                      f"{tools.choice!r}: {short}{hint}", param=f"tools.{i}.function.parameters",
                                 code="invalid_value")


def structured_field(tools: ToolRequest, fmt: ToolFormat) -> dict:
    """The engine's ``structured`` sampling field for a forced choice (400 naming ``tools`` past the engine's size
    limit for a grammar)."""
    return {"grammar": checked_size(tool_grammar(tools, fmt))}


def checked_size(grammar: str) -> str:
    from loraplex.engine.structured.spec import MAX_SPEC_BYTES

    size = len(grammar.encode())
    if size > MAX_SPEC_BYTES:
        raise InferenceError(400, f"the tools' schemas make a {size}-byte grammar for tool_choice; the limit is "
                                  f"{MAX_SPEC_BYTES} bytes: send fewer or smaller functions", param="tools",
                             code="invalid_value")
    return grammar

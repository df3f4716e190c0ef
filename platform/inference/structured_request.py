"""Structured outputs as the API asks for them, mapped onto the engine's ``StructuredOutput``.

    response_format {"type": "text"}                                      nothing (free text)
    response_format {"type": "json_object"}                               StructuredOutput(json_object=True)
    response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                                          StructuredOutput(json_schema, strict)
    guided_json (a schema, or its JSON text)                              StructuredOutput(json_schema, strict)
    guided_regex / guided_choice / guided_grammar                         regex / choice / grammar

At most one of them per request. ``strict`` true (what ``client.beta.chat.completions.parse`` sends) refuses a schema
keyword the grammar cannot enforce, naming it; false (and ``guided_json``, as vLLM) leaves such keywords unchecked.
``structured_of`` checks the shape (cheap, on the event loop); ``check_compiles`` compiles the grammar without a
tokenizer (run it off the event loop) so that a schema that cannot compile is a 400 naming the feature and the field
before the request is queued.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.engine.structured.compiler import GrammarError, check_grammar
from loraplex.engine.structured.spec import StructuredOutput
from loraplex.platform.inference.errors import InferenceError

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's name (1..64 of ``[A-Za-z0-9_-]``), description, schema, strict."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


@dataclass(frozen=True)
class StructuredRequest:
    """The request's constraint and the field it came from (the ``param`` of its errors)."""

    spec: StructuredOutput
    param: str


def structured_of(body) -> StructuredRequest | None:
    """The constraint of a validated request body (``response_format`` and ``guided_*`` fields), or None; 400 naming
    the field when two are set or one is malformed."""
    found: list[tuple[str, dict]] = []
    rf: ResponseFormat | None = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        js = rf.json_schema
        if js is None or js.schema_ is None:
            raise InferenceError(400, "response_format of type 'json_schema' needs 'json_schema': {\"name\", "
                                      "\"schema\", \"strict\"}", param="response_format", code="invalid_value")
        found.append(("response_format", {"json_schema": js.schema_, "strict": bool(js.strict)}))
    if body.guided_json is not None:
        found.append(("guided_json", {"json_schema": _schema_of(body.guided_json), "strict": False}))
    for name, kind in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            found.append((name, {kind: value}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InferenceError(400, f"send one output constraint per request; got {names}", param=found[1][0],
                             code="invalid_value")
    param, wire = found[0]
    try:
        return StructuredRequest(StructuredOutput.from_dict(wire), param)
    except ValueError as e:
        raise InferenceError(400, _named(str(e), param), param=param, code="invalid_value") from None


def check_compiles(req: StructuredRequest) -> None:
    """400 ``invalid_value`` naming the unsupported feature and the field when ``req`` does not compile (llguidance,
    no tokenizer: CPU work bounded by the spec's size limit; call it off the event loop)."""
    try:
        check_grammar(req.spec)
    except GrammarError as e:
        raise InferenceError(400, f"Invalid '{req.param}': {_named(str(e), req.param)}", param=req.param,
                             code="invalid_value") from None


def _schema_of(value) -> dict | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InferenceError(400, f"'guided_json' is not valid JSON: {e}", param="guided_json",
                                 code="invalid_value") from None
    if not isinstance(value, (dict, bool)):
        raise InferenceError(400, "'guided_json' must be a JSON schema (an object, or its JSON text)",
                             param="guided_json", code="invalid_value")
    return value


def _named(message: str, param: str) -> str:
    """The engine's wording (``structured.<kind>``) with the request field's name instead."""
    for kind in ("json_schema", "json_object", "regex", "grammar", "choice"):
        message = message.replace(f"structured.{kind}", param)
    return message

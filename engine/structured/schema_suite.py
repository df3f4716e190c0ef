"""JSON schemas that cover the features structured outputs support, for tests and benchmarks (torch-free).

    for name, schema in SCHEMAS.items(): ...          # 25 schemas, each exercising one or two features

Every string has a ``maxLength``, ``pattern``, ``enum`` or ``format``, every array a ``maxItems`` and every number
bounds, so a constrained random model finishes the document in a few dozen tokens. ``UNSUPPORTED`` holds schemas
with a keyword the grammar library refuses (the engine names it in its error).
"""
from __future__ import annotations

_NAME = {"type": "string", "minLength": 1, "maxLength": 8}

SCHEMAS: dict[str, dict] = {
    "flat_object": {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120}},
                    "required": ["name", "age"], "additionalProperties": False},
    "nested_object": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "address": {"type": "object", "properties": {
                                                      "city": _NAME, "zip": {"type": "string",
                                                                             "pattern": "^[0-9]{5}$"}},
                                                      "required": ["city", "zip"], "additionalProperties": False}},
                 "required": ["id", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array_min_max": {"type": "object", "properties": {"tags": {"type": "array", "items": _NAME, "minItems": 2,
                                                                 "maxItems": 3}},
                      "required": ["tags"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"k": _NAME, "v": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["k", "v"], "additionalProperties": False}},
    "string_enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                    "required": ["color"], "additionalProperties": False},
    "mixed_enum": {"type": "object", "properties": {"v": {"enum": [1, "two", None, True]}}, "required": ["v"],
                   "additionalProperties": False},
    "const": {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}},
              "required": ["kind", "x"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 50}, {"type": "string", "maxLength": 4},
        {"type": "boolean"}]}}, "required": ["value"], "additionalProperties": False},
    "one_of_objects": {"oneOf": [
        {"type": "object", "properties": {"cat": {"const": "meow"}}, "required": ["cat"],
         "additionalProperties": False},
        {"type": "object", "properties": {"dog": {"const": "woof"}}, "required": ["dog"],
         "additionalProperties": False}]},
    "string_pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                       "required": ["code"], "additionalProperties": False},
    "string_lengths": {"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 5}},
                       "required": ["s"], "additionalProperties": False},
    "integer_bounds": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20}},
                       "required": ["n"], "additionalProperties": False},
    "number_bounds": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
                      "required": ["x"], "additionalProperties": False},
    "exclusive_bounds": {"type": "object", "properties": {"p": {"type": "integer", "exclusiveMinimum": 0,
                                                                "exclusiveMaximum": 4}},
                         "required": ["p"], "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                         "b": {"type": "boolean"}, "c": _NAME},
                        "required": ["a"], "additionalProperties": False},
    "boolean_null": {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
                     "required": ["ok", "none"], "additionalProperties": False},
    "nullable_type_list": {"type": "object", "properties": {"v": {"type": ["integer", "null"], "minimum": 0,
                                                                  "maximum": 9}},
                           "required": ["v"], "additionalProperties": False},
    "ref_defs": {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}, "required": ["a", "b"],
        "additionalProperties": False},
    "nested_arrays": {"type": "object", "properties": {"grid": {"type": "array", "minItems": 1, "maxItems": 2,
                                                                "items": {"type": "array", "minItems": 1,
                                                                          "maxItems": 2,
                                                                          "items": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 9}}}},
                      "required": ["grid"], "additionalProperties": False},
    "format_date": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}},
                    "required": ["day"], "additionalProperties": False},
    "all_of": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                "b": {"type": "boolean"}},
               "allOf": [{"required": ["a"]}, {"required": ["b"]}], "additionalProperties": False},
    "deep_nesting": {"type": "object", "properties": {"l1": {"type": "object", "properties": {"l2": {
        "type": "object", "properties": {"l3": {"type": "object", "properties": {"leaf": {"enum": ["x", "y"]}},
                                                "required": ["leaf"], "additionalProperties": False}},
        "required": ["l3"], "additionalProperties": False}}, "required": ["l2"], "additionalProperties": False}},
        "required": ["l1"], "additionalProperties": False},
    "tool_call": {"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {
            "city": _NAME, "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
    # a nested Pydantic v2 model's schema made strict the way OpenAI's client does for parse() ($defs, $ref,
    # titles, Optional as anyOf-null, every property required, additionalProperties false)
    "pydantic_strict": {
        "$defs": {"Reading": {"properties": {"city": {"maxLength": 6, "title": "City", "type": "string"},
                                             "unit": {"$ref": "#/$defs/Unit"},
                                             "value": {"maximum": 60, "minimum": -50, "title": "Value",
                                                       "type": "integer"}},
                              "required": ["city", "unit", "value"], "title": "Reading", "type": "object",
                              "additionalProperties": False},
                  "Unit": {"enum": ["celsius", "fahrenheit"], "title": "Unit", "type": "string"}},
        "properties": {"readings": {"items": {"$ref": "#/$defs/Reading"}, "maxItems": 1, "minItems": 1,
                                    "title": "Readings", "type": "array"},
                       "note": {"anyOf": [{"maxLength": 6, "type": "string"}, {"type": "null"}], "title": "Note"},
                       "kind": {"const": "daily", "title": "Kind", "type": "string"}},
        "required": ["readings", "note", "kind"], "title": "Report", "type": "object", "additionalProperties": False},
    "array_tuple": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                     {"enum": ["a", "b"]}], "items": False, "minItems": 2},
}

# Keywords the library refuses rather than ignore silently: (schema, the name its error carries).
UNSUPPORTED: dict[str, tuple[dict, str]] = {
    "unique_items": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    "unknown_format": ({"type": "string", "format": "not-a-format"}, "not-a-format"),
    "not": ({"not": {"type": "string"}}, "not"),
    "if_then": ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    "contains": ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    "remote_ref": ({"$ref": "https://example.com/schema.json"}, "https://example.com/schema.json"),
}

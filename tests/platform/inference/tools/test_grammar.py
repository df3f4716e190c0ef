"""The grammar of forced calls, compiled by the engine's own grammar compiler over the tiny tokenizer: the
family's call text with schema-valid arguments is accepted; another function, arguments off the schema, a second
call without ``parallel_tool_calls`` and runs of whitespace are refused."""
from __future__ import annotations

import pytest

from loraplex.engine.structured.compiler import GrammarCompiler
from loraplex.engine.structured.spec import StructuredOutput
from loraplex.engine.testing.tiny_tokenizer import EOS, build_tiny_tokenizer
from loraplex.platform.inference.errors import InferenceError
from loraplex.platform.inference.tools import HERMES, LLAMA3_JSON, MISTRAL, Function, ToolRequest, check_schemas
from loraplex.platform.inference.tools import structured_field

WEATHER = Function("get_weather", "", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
    "additionalProperties": False})
ADD = Function("add", "", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, strict=True)
OK_WEATHER = ("get_weather", '{"city": "Paris", "unit": "c"}')
OK_ADD = ("add", '{"a":12}')


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(build_tiny_tokenizer(320), vocab_size=320, eos_token_ids=[EOS])


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(320)


def accepts(compiler, tok, tools: ToolRequest, fmt, text: str) -> bool:
    grammar = compiler.compile(StructuredOutput.from_dict(structured_field(tools, fmt)))
    matcher = grammar.new_matcher()
    return all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False)) and matcher.is_accepting


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_family_calls(compiler, tok, fmt):
    required = ToolRequest((WEATHER, ADD), "required")
    single = ToolRequest((WEATHER, ADD), "required", parallel=False)
    named = ToolRequest((WEATHER, ADD), "function", "add")
    assert accepts(compiler, tok, required, fmt, fmt.calls_text([OK_WEATHER]))
    assert accepts(compiler, tok, required, fmt, fmt.calls_text([OK_WEATHER, OK_ADD, OK_ADD]))
    assert accepts(compiler, tok, single, fmt, fmt.calls_text([OK_ADD]))
    assert not accepts(compiler, tok, single, fmt, fmt.calls_text([OK_ADD, OK_ADD]))      # exactly one call
    assert accepts(compiler, tok, named, fmt, fmt.calls_text([OK_ADD]))
    assert not accepts(compiler, tok, named, fmt, fmt.calls_text([OK_WEATHER]))           # not the named one
    assert not accepts(compiler, tok, required, fmt, fmt.calls_text([("nope", "{}")]))
    for bad in ('{"city": "Paris", "unit": "k"}', '{"city": "Paris"}', '{"city": "Paris", "unit": "c", "x": 1}',
                '{"city": "Paris, France", "unit": "c"}', '{"city":\n"Paris", "unit": "c"}'):
        assert not accepts(compiler, tok, required, fmt, fmt.calls_text([("get_weather", bad)])), bad
    assert not accepts(compiler, tok, required, fmt, "Sure! " + fmt.calls_text([OK_ADD]))   # calls only


def test_schemas_checked_in_the_gateway():
    check_schemas(ToolRequest((WEATHER, ADD), "required"))
    odd = {"type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}}
    check_schemas(ToolRequest((Function("f", "", odd),), "required"))   # not strict: left unchecked
    with pytest.raises(InferenceError) as e:
        check_schemas(ToolRequest((WEATHER, Function("f", "", odd, strict=True)), "required"))
    assert e.value.param == "tools.1.function.parameters" and "no-such-format" in e.value.message
    # a named choice compiles only the named function's schema
    check_schemas(ToolRequest((WEATHER, Function("f", "", odd, strict=True)), "function", "get_weather"))


def test_tenant_grammar_options_are_replaced(compiler, tok):
    odd = Function("f", "", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                             "x-guidance": "not options"})
    tools = ToolRequest((odd,), "required", parallel=False)
    check_schemas(tools)
    assert '"x-guidance": {"whitespace_pattern": "[ ]?", "lenient": true}' in structured_field(tools, HERMES)["grammar"]
    assert accepts(compiler, tok, tools, HERMES, HERMES.calls_text([("f", '{"a": 1}')]))
    assert not accepts(compiler, tok, tools, HERMES, HERMES.calls_text([("f", '{\n"a": 1}')]))


def test_grammar_past_the_engine_limit_is_a_400():
    from loraplex.engine.structured.spec import MAX_SPEC_BYTES

    big = Function("f", "", {"type": "object", "properties": {"a": {"enum": ["x" * 1000] * (MAX_SPEC_BYTES // 1000)}}})
    with pytest.raises(InferenceError) as e:
        structured_field(ToolRequest((big,), "required"), HERMES)
    assert e.value.status_code == 400 and e.value.param == "tools" and "limit" in e.value.message

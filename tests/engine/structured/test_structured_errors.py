"""Bad structured-output requests: refused synchronously where the spec alone says so, failed fast with an
invalid-request error naming the feature when the compile says so (and at once on a repeat), never leaking KV
blocks, never disturbing the other requests of the batch; the same through AsyncEngine."""
from __future__ import annotations

import asyncio

import pytest

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.structured import StructuredOutput
from loraplex.engine.structured.compiler import GrammarError
from loraplex.engine.structured.schema_suite import SCHEMAS, UNSUPPORTED


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


def make_engine(path: str) -> LLMEngine:
    return LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4, max_num_seqs=8,
                                     progress=False)


def run(engine: LLMEngine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    return final


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_keyword_fails_fast_naming_it_then_refused_at_once(llama, name):
    schema, keyword = UNSUPPORTED[name]
    engine = make_engine(llama)
    good = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    bad = SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredOutput(json_schema=schema))
    engine.add_request("ok", [1, 5, 6], good)
    engine.add_request("bad", [1, 5, 6], bad)  # compiles off the step thread
    final = run(engine)
    assert final["ok"].finish_reason == "length" and len(final["ok"].output_token_ids) == 8
    out = final["bad"]
    assert out.finish_reason == "error" and out.error_type == "invalid_request"
    assert keyword in out.error and "structured.json_schema" in out.error, out.error
    assert out.output_token_ids == []
    with pytest.raises(GrammarError, match=keyword.replace("$", r"\$").replace(".", r"\.")):
        engine.add_request("bad-again", [1, 5, 6], bad)  # the cached failure: refused synchronously
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks
    engine.close()


def test_lenient_schema_compiles_and_ignores_the_keyword(llama):
    engine = make_engine(llama)
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2,
                                                      "uniqueItems": True}},
              "required": ["xs"], "additionalProperties": False}
    p = SamplingParams(max_tokens=48, temperature=0.0, structured=StructuredOutput(json_schema=schema, strict=False))
    (out,) = engine.generate([[1, 3, 4]], p)
    assert out.finish_reason == "stop"
    import json

    assert set(json.loads(out.text)) == {"xs"}
    engine.close()


@pytest.mark.parametrize("spec, match", [
    ({"regex": "([a-z]"}, "unclosed group"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"grammar": "root ::= foo bar ::="}, "neither Lark nor GBNF"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "missing"),
    ({"json_schema": {"type": "no-such-type"}}, "no-such-type"),
])
def test_compile_errors_name_the_problem(llama, spec, match):
    engine = make_engine(llama)
    engine.add_request("r", [1, 2], SamplingParams(max_tokens=4, structured=spec))
    out = run(engine)["r"]
    assert out.finish_reason == "error" and out.error_type == "invalid_request"
    assert match in out.error, out.error
    engine.close()


def test_spec_errors_are_synchronous(llama):
    engine = make_engine(llama)
    for spec, match in [({"json_schema": "not a dict"}, "JSON Schema object"), ({}, "exactly one"),
                        ({"choice": []}, "1 to"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
                        ({"json_schema": {}, "bogus": 1}, "unknown structured field")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request("r", [1, 2], SamplingParams(max_tokens=4, structured=spec))
    with pytest.raises(ValueError, match="use_beam_search"):
        SamplingParams(max_tokens=4, use_beam_search=True, beam_width=2, structured={"json_object": True})
    assert not engine.has_unfinished_requests()
    engine.close()


def test_no_tokenizer_is_refused(tmp_path):
    from tests.utils.tiny_models import make_tiny_base

    path = make_tiny_base("llama", str(tmp_path / "base"))  # config and weights, no tokenizer
    engine = make_engine(path)
    with pytest.raises(ValueError, match="need a tokenizer"):
        engine.add_request("r", [1, 2], SamplingParams(max_tokens=4, structured={"json_object": True}))
    engine.close()


def test_async_engine_raises_compile_error_as_value_error(llama):
    async def main():
        engine = AsyncEngine(make_engine(llama))
        try:
            bad = SamplingParams(max_tokens=4, structured={"json_schema": UNSUPPORTED["not"][0]})
            with pytest.raises(ValueError, match="not"):
                async for _ in engine.generate("bad", [1, 2], bad):
                    pass
            good = SamplingParams(max_tokens=64, temperature=0.0, structured={"json_schema": SCHEMAS["const"]})
            outs = [o async for o in engine.generate("good", [1, 2], good)]
            assert outs[-1].finish_reason == "stop" and '"point"' in outs[-1].text
        finally:
            engine.shutdown()

    asyncio.run(main())

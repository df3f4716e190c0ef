"""Structured outputs through the whole engine, every family, float32 CPU: greedy output under each suite schema
parses and validates (with and without an adapter, in one batch with free requests), free requests keep exactly
their unconstrained tokens, and the other kinds (regex, choice, grammar, JSON object) hold."""
from __future__ import annotations

import json
import os

import pytest

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.lora.fetch import file_uri
from loraplex.engine.lora.manager import sha256_file
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.structured import StructuredOutput
from loraplex.engine.structured.schema_suite import SCHEMAS

from .conftest import assert_valid

FAMILIES = ["gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3"]
FREE = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
FREE_PROMPTS = [[1, 40, 41, 42], [1, 7, 8, 9, 10, 11], [1, 200, 3], [1, 60, 61, 62, 63]]


def constrained(schema: dict, max_tokens: int = 128) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=StructuredOutput(json_schema=schema))


def make_engine(path: str, tmp_path, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4, max_num_seqs=32,
                                     max_num_batched_tokens=512, progress=False, enable_lora=True, max_loras=1,
                                     max_lora_rank=4, adapter_cache_dir=str(tmp_path / "adapters"), **kw)


def adapter_ref(folder: str) -> AdapterRef:
    return AdapterRef("tenant/json/1", file_uri(folder), sha256_file(os.path.join(folder, "adapter_model.safetensors")))


@pytest.mark.parametrize("family", FAMILIES)
def test_suite_schemas_valid_with_and_without_adapter_free_rows_untouched(family, tiny_checkpoint,
                                                                          attention_adapter, tmp_path):
    path = tiny_checkpoint(family)
    ref = adapter_ref(attention_adapter(path))
    engine = make_engine(path, tmp_path)
    free_adapters = [None, ref, None, ref]
    alone = engine.generate(FREE_PROMPTS, FREE, adapters=free_adapters)

    names = list(SCHEMAS)
    prompts = [[1, 5 + i, 30 + 2 * i, 9] for i in range(len(names))] + FREE_PROMPTS
    params = [constrained(SCHEMAS[n]) for n in names] + [FREE] * len(FREE_PROMPTS)
    adapters = [ref if i % 2 else None for i in range(len(names))] + free_adapters
    outs = engine.generate(prompts, params, adapters=adapters)

    for i, name in enumerate(names):
        label = f"{family}/{name}/{'adapter' if adapters[i] else 'base'}"
        assert outs[i].finish_reason == "stop", f"{label}: {outs[i].finish_reason} after {outs[i].text!r}"
        assert_valid(outs[i].text, SCHEMAS[name], label)
    for k, free in enumerate(outs[len(names):]):
        assert free.output_token_ids == alone[k].output_token_ids, f"{family}: free request {k} changed"
    stats = engine.structured.stats()
    assert stats["misses"] == len(names) and stats["failures"] == 0
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks
    engine.close()


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


def plain_engine(path: str, **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 16)
    return LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4, progress=False,
                                     max_num_batched_tokens=256, **kw)


def test_other_kinds(llama):
    engine = plain_engine(llama)
    specs = {
        "regex": StructuredOutput(regex=r"[0-9]{3}-[a-z]{2,4}"),
        "choice": StructuredOutput(choice=["positive", "negative", "neutral"]),
        "grammar": StructuredOutput(grammar='start: "ok" | "no" " " NUM\nNUM: /[0-9]{1,3}/'),
        "gbnf": StructuredOutput(grammar='root ::= "yes" | "maybe"'),
        "json_object": StructuredOutput(json_object=True),
    }
    params = [SamplingParams(max_tokens=64, temperature=0.0, structured=s) for s in specs.values()]
    outs = dict(zip(specs, engine.generate([[1, 20 + i, 5] for i in range(len(specs))], params)))
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs["regex"].text), outs["regex"].text
    assert outs["choice"].text in ("positive", "negative", "neutral")
    assert re.fullmatch(r"ok|no [0-9]{1,3}", outs["grammar"].text), outs["grammar"].text
    assert outs["gbnf"].text in ("yes", "maybe")
    if outs["json_object"].finish_reason == "stop":
        assert isinstance(json.loads(outs["json_object"].text), dict)
    else:  # any object: a random model may fill max_tokens inside it; the prefix is still an object's start
        assert outs["json_object"].text.lstrip().startswith("{")
    assert all(o.finish_reason in ("stop", "length") for o in outs.values())
    assert [o.finish_reason for k, o in outs.items() if k != "json_object"] == ["stop"] * 4
    engine.close()


def test_max_tokens_cuts_grammar_short_and_stop_strings_apply(llama):
    engine = plain_engine(llama)
    schema = SCHEMAS["tool_call"]
    full, cut = engine.generate([[1, 9, 9], [1, 9, 9]], [constrained(schema), constrained(schema, max_tokens=5)])
    assert full.finish_reason == "stop"
    assert cut.finish_reason == "length" and len(cut.output_token_ids) == 5
    assert cut.output_token_ids == full.output_token_ids[:5]
    # a stop string inside the JSON ends it there, as for free text
    stop = '"arguments"'
    p = SamplingParams(max_tokens=96, temperature=0.0, stop=[stop], structured=StructuredOutput(json_schema=schema))
    (out,) = engine.generate([[1, 9, 9]], p)
    assert out.finish_reason == "stop" and full.text.startswith(out.text) and stop not in out.text
    assert stop in full.text
    engine.close()


def test_cache_hits_prefix_hits_and_parallel_sampling(llama):
    engine = plain_engine(llama, enable_prefix_caching=True)
    schema = SCHEMAS["nested_object"]
    prompt = [1] + list(range(40, 64))  # six full blocks shared by every request
    first = engine.generate([prompt], constrained(schema))[0]
    again = engine.generate([prompt, prompt], [constrained(schema), constrained(json.loads(json.dumps(schema)))])
    assert [o.output_token_ids for o in again] == [first.output_token_ids] * 2
    assert all(o.num_cached_tokens > 0 for o in again)
    stats = engine.structured.stats()
    assert stats["misses"] == 1 and stats["hits"] == 2  # a reordered/copied schema is the same grammar
    # n > 1 and best_of: every forked sequence follows its own matcher
    p = SamplingParams(max_tokens=96, temperature=1.0, seed=3, n=3, structured=StructuredOutput(json_schema=schema))
    b = SamplingParams(max_tokens=96, temperature=1.0, seed=4, n=2, best_of=3,
                       structured=StructuredOutput(json_schema=schema))
    par, best = engine.generate([prompt, prompt], [p, b])
    assert len(par.outputs) == 3 and len(best.outputs) == 2
    for c in par.outputs + best.outputs:
        assert c.finish_reason == "stop", c.text
        assert_valid(c.text, schema, "n>1")
    assert len({tuple(c.output_token_ids) for c in par.outputs}) > 1
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks
    engine.close()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_matcher_state(llama, mode):
    names = ["nested_object", "tool_call", "array_of_objects", "ref_defs", "deep_nesting", "array_min_max"]
    prompts = [[1] + [50 + 3 * i + j for j in range(9)] for i in range(len(names))]
    params = [constrained(SCHEMAS[n]) for n in names]
    ref_engine = plain_engine(llama)
    expected = [o.output_token_ids for o in ref_engine.generate(prompts, params)]
    ref_engine.close()
    engine = plain_engine(llama, num_kv_blocks=40, num_cpu_blocks=64, preemption_mode=mode)
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0, "the pool was not tight enough to preempt"
    if mode == "swap":
        assert engine.scheduler.num_swap_outs > 0
    for name, out, want in zip(names, outs, expected):
        assert out.output_token_ids == want, f"{mode}: {name} changed by preemption"
        assert_valid(out.text, SCHEMAS[name], f"{mode}/{name}")
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks
    engine.close()


def test_overlapped_steps_match_synchronous(llama):
    names = ["flat_object", "string_enum", "nested_arrays", "any_of"]
    prompts = [[1, 70 + i, 4] for i in range(len(names))] + FREE_PROMPTS
    params = [constrained(SCHEMAS[n]) for n in names] + [FREE] * len(FREE_PROMPTS)
    sync = plain_engine(llama, async_scheduling=False)
    expected = [o.output_token_ids for o in sync.generate(prompts, params)]
    sync.close()
    engine = plain_engine(llama, async_scheduling=True)
    outs = engine.generate(prompts, params)
    assert engine.num_overlapped_steps > 0
    assert [o.output_token_ids for o in outs] == expected
    for name, out in zip(names, outs):
        assert out.finish_reason == "stop"
        assert_valid(out.text, SCHEMAS[name], f"overlapped/{name}")
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks
    engine.close()

"""The parts of structured outputs on their own: the spec (validation, wire form, cache key), the matcher (masks,
rollback, fork, speculative draft masks), the packed bitmask on logits, the grammar cache (hits, cached failures,
LRU bound, the compile-time bound)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.structured import StructuredOutput
from loraplex.engine.structured.bitmask import TokenBitmask, apply_token_bitmask, bitmask_width
from loraplex.engine.structured.cache import GrammarCache
from loraplex.engine.structured.compiler import GrammarCompiler, GrammarError
from loraplex.engine.structured.schema_suite import SCHEMAS
from loraplex.engine.testing.tiny_tokenizer import EOS, build_tiny_tokenizer

VOCAB = 333  # not a multiple of 32: the last bitmask word is partial


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(320)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS])


def allowed(matcher) -> set[int]:
    mask = torch.zeros((1, bitmask_width(VOCAB)), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    bits = [(int(mask[0, t // 32]) >> (t % 32)) & 1 for t in range(VOCAB)]
    return {t for t, b in enumerate(bits) if b}


# ---- spec ---------------------------------------------------------------------------------------------------
def test_spec_wire_form_round_trips_and_key_ignores_key_order():
    a = StructuredOutput(json_schema={"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    b = StructuredOutput.from_dict({"json_schema": {"required": ["x"], "properties": {"x": {"type": "integer"}},
                                                    "type": "object"}, "strict": True})
    assert a.cache_key == b.cache_key and a.kind == "json_schema"
    assert StructuredOutput.from_dict(a.to_dict()) == a
    assert StructuredOutput(json_schema=a.json_schema, strict=False).cache_key != a.cache_key
    c = StructuredOutput.from_dict({"choice": ["a", "b"]})
    assert c.choice == ("a", "b") and c.to_dict() == {"choice": ["a", "b"]}
    assert StructuredOutput(regex="a+").cache_key != StructuredOutput(grammar="a+").cache_key


@pytest.mark.parametrize("bad, match", [
    ({"json_schema": {"a": float("nan")}}, "not plain JSON"),
    ({"json_schema": {}, "strict": "yes"}, "strict"),
    ({"regex": "   "}, "non-empty"),
    ({"choice": "a"}, "list of strings"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"json_object": False}, "exactly one"),
    ({"json_schema": {"x": "y" * (300 * 1024)}}, "limit"),
    ("json", "an object"),
])
def test_spec_refuses(bad, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutput.from_dict(bad)


def test_sampling_params_carry_structured_and_logit_bias():
    p = SamplingParams.from_dict({"structured": {"json_object": True}, "logit_bias": {"7": 5, 9: -100}})
    assert isinstance(p.structured, StructuredOutput) and p.structured.kind == "json_object"
    assert p.logit_bias == {7: 5.0, 9: -100.0}
    assert SamplingParams().logit_bias == {} and SamplingParams().structured is None
    for bias, match in [({"x": 1}, "token ids"), ({-1: 1}, "token ids"), ({3: 101}, r"\[-100, 100\]"),
                        ({3: float("inf")}, r"\[-100, 100\]"), ({3: True}, r"\[-100, 100\]"), ([1], "object"),
                        ({i: 1 for i in range(1025)}, "at most 1024")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(logit_bias=bias)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(logit_bias={400: 1}).verify(320)
    with pytest.raises(ValueError, match="StructuredOutput"):
        SamplingParams(structured="json")


# ---- matcher ------------------------------------------------------------------------------------------------
def test_matcher_masks_eos_only_at_the_end_and_terminates(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutput(choice=["yes", "no"]))
    m = grammar.new_matcher()
    first = allowed(m)
    assert EOS not in first and all(tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in first)
    assert all(t < 320 for t in first)  # padding ids past the tokenizer are never allowed
    assert m.advance_to(tokenizer.encode("ye", add_special_tokens=False))
    assert not m.is_accepting and not m.is_terminated
    assert m.accept(tokenizer.encode("s", add_special_tokens=False)[0])
    assert m.is_accepting and m.is_terminated and allowed(m) == {EOS}
    assert not m.accept(tokenizer.encode("x", add_special_tokens=False)[0]) and m.error


def test_rollback_fork_and_draft_masks(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutput(json_schema=SCHEMAS["flat_object"]))
    tokens = tokenizer.encode('{"name":"ab","age":7}', add_special_tokens=False)
    m = grammar.new_matcher()
    masks = []
    for t in tokens:
        masks.append(allowed(m))
        assert m.accept(t)
    assert m.is_terminated and m.num_tokens == len(tokens)
    m.rollback(4)
    assert m.num_tokens == len(tokens) - 4 and allowed(m) == masks[-4]
    child = m.fork()
    assert child.advance_to(tokens) and child.is_terminated and not m.is_terminated  # independent states
    assert m.advance_to(tokens[:3]) and allowed(m) == masks[3]  # fewer tokens than consumed: rolled back
    with pytest.raises(ValueError):
        m.rollback(4)
    # a verifier's masks for k drafts: k + 1 rows, the matcher left where it was
    m = grammar.new_matcher()
    assert m.advance_to(tokens[:2])
    bogus = tokenizer.encode("}", add_special_tokens=False)[0]
    drafts = tokens[2:5] + [bogus]
    rows = torch.zeros((6, bitmask_width(VOCAB)), dtype=torch.int32)
    assert m.fill_draft_bitmasks(drafts, rows, 1) == 3
    assert m.num_tokens == 2 and m.error is None and allowed(m) == masks[2]
    for i in range(4):
        one = torch.zeros((1, rows.shape[1]), dtype=torch.int32)
        one[0] = rows[1 + i]
        bits = {t for t in range(VOCAB) if (int(one[0, t // 32]) >> (t % 32)) & 1}
        assert bits == masks[2 + i], f"draft position {i}"
    assert not rows[0].any() and not rows[5].any()


def test_suite_compiles(compiler):
    for name, schema in SCHEMAS.items():
        g = compiler.compile(StructuredOutput(json_schema=schema))
        assert g.kind == "json_schema" and g.compile_ms >= 0, name


# ---- bitmask ------------------------------------------------------------------------------------------------
def test_apply_token_bitmask_matches_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    for n, v in [(1, 1), (3, 33), (5, 333), (2, 64)]:
        logits = torch.randn(n, v, generator=g)
        before = logits.clone()
        words = torch.randint(-2**31, 2**31 - 1, (n, bitmask_width(v)), generator=g, dtype=torch.int64)
        mask = words.to(torch.int32)
        got = apply_token_bitmask(logits, mask)
        want = logits.clone()
        for r in range(n):
            for t in range(v):
                if not (int(words[r, t // 32]) >> (t % 32)) & 1:
                    want[r, t] = float("-inf")
        assert torch.equal(got, want), (n, v)
        assert torch.equal(logits, before)  # out of place
    narrow = apply_token_bitmask(torch.zeros(1, 40), torch.full((1, 1), -1, dtype=torch.int32))
    assert torch.isinf(narrow[0, 32:]).all() and (narrow[0, :32] == 0).all()
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(torch.zeros(2, 40), torch.zeros((1, 2), dtype=torch.int32))


def test_token_bitmask_rows_follow_sequence_ids():
    mask = TokenBitmask.allocate([7, 9], 40, pin=False)
    mask.host[0] = 1
    mask.host[1] = 2
    rows = mask.rows_for([9, 3, 7, 9], torch.device("cpu"))
    assert rows[:, 0].tolist() == [2, -1, 1, 2]
    assert mask.rows_for([3, 4], torch.device("cpu")) is None
    assert mask.rows_for([7, 9], torch.device("cpu"))[:, 0].tolist() == [1, 2]


# ---- cache --------------------------------------------------------------------------------------------------
def wait_state(cache: GrammarCache, entry, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while cache.poll(entry) == "compiling" and time.monotonic() < deadline:
        cache.wait([entry], 0.05)
    return cache.poll(entry)


def test_cache_hits_failures_and_lru_bound(compiler):
    cache = GrammarCache(compiler.compile, max_entries=2)
    a, b, c = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
    ea = cache.get(a)
    assert wait_state(cache, ea) == "ready" and cache.get(a) is ea
    bad = StructuredOutput(json_schema={"type": "array", "uniqueItems": True})
    eb = cache.get(bad)
    assert wait_state(cache, eb) == "failed" and "uniqueItems" in eb.error
    assert cache.get(bad).state == "failed"  # remembered: no second compile
    cache.get(b)
    cache.get(c)  # evicts the least recently used (a)
    assert len(cache) == 2 and cache.get(a) is not ea
    s = cache.stats()
    assert (s["hits"], s["misses"], s["failures"]) == (2, 5, 1) and 0 < s["hit_rate"] < 1
    cache.close()


def test_cache_compile_time_bound():
    release = threading.Event()

    def slow(spec):
        release.wait(5)
        return object()

    cache = GrammarCache(slow, compile_timeout_s=0.2)
    entry = cache.get(StructuredOutput(regex="x"))
    assert wait_state(cache, entry, timeout=3) == "failed" and "longer than 0.2 s" in entry.error
    release.set()
    cache.close()


def test_grammar_error_is_a_value_error(compiler):
    with pytest.raises(ValueError):
        compiler.compile(StructuredOutput(json_schema={"not": {}}))
    with pytest.raises(GrammarError) as e:
        compiler.compile(StructuredOutput(json_schema={"contains": {}}))
    assert e.value.kind == "json_schema"
    with pytest.raises(ValueError, match="tokenizer"):
        GrammarCompiler(None, vocab_size=10, eos_token_ids=[1])


def test_matcher_for_is_caught_up_with_the_sequence_and_none_without_a_grammar(tokenizer):
    from types import SimpleNamespace

    from loraplex.engine.structured.decoding import StructuredDecoding

    sd = StructuredDecoding(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS])
    try:
        sd.add_request("r", StructuredOutput(choice=["yes", "no"]))
        deadline = time.monotonic() + 30
        while sd.state("r") == "compiling" and time.monotonic() < deadline:
            sd.wait_for_compiles(1.0)
        assert sd.state("r") == "ready"
        out = tokenizer.encode("ye", add_special_tokens=False)
        seq = SimpleNamespace(request_id="r", seq_id=0, output_token_ids=out, num_output_tokens=len(out),
                              num_pending_tokens=0)
        m = sd.matcher_for(seq)
        assert m is not None and m.num_tokens == len(out) and not m.is_accepting
        assert sd.matcher_for(seq) is m                                  # one matcher per sequence, kept
        free = SimpleNamespace(request_id="free", seq_id=1, output_token_ids=[], num_output_tokens=0,
                               num_pending_tokens=0)
        assert sd.matcher_for(free) is None
    finally:
        sd.close()

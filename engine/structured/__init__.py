"""Structured outputs: grammar-constrained decoding (llguidance) for JSON schemas, JSON objects, regexes, grammars
and choice lists.

    spec.py       StructuredOutput: what a request's output must match (torch-free; what SamplingParams carries)
    compiler.py   GrammarCompiler / CompiledGrammar / GrammarError: spec -> grammar, tokenizer wrapped once
    matcher.py    GrammarMatcher: one sequence's grammar state (consume, fill its bitmask row, rollback, fork)
    cache.py      GrammarCache: compiled grammars by schema hash, LRU, compiled on a small executor, time-bounded
    decoding.py   StructuredDecoding: the engine's constrained requests, their matchers, each step's bitmask
    bitmask.py    TokenBitmask / apply_token_bitmask: the packed int32 mask, host to device to logits (torch)
    schema_suite.py  JSON schemas covering the supported features (tests, benchmarks)
"""
from loraplex.engine.structured.spec import KINDS, StructuredOutput

__all__ = ["KINDS", "StructuredOutput"]

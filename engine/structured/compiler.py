"""Compile a ``StructuredOutput`` into a grammar with llguidance (torch-free).

    compiler = GrammarCompiler(hf_tokenizer, vocab_size=201088, eos_token_ids=[200002])
    grammar = compiler.compile(StructuredOutput(json_schema=schema))    # GrammarError naming the problem
    matcher = grammar.new_matcher()                                     # one per sequence (matcher.py)

The tokenizer is wrapped once (``llguidance.hf.from_tokenizer``: the byte string of every token, a token trie;
about a second per 100k tokens) on the first compile, under a lock, so an engine pays for it only when a
constrained request arrives and never on its step thread (compiles run on ``GrammarCache``'s executor).
The mask covers the model's vocabulary (``vocab_size``, which may exceed the tokenizer's: the padding ids are
never allowed); EOS is allowed exactly where the grammar may end.

JSON whitespace: at most one space wherever JSON allows whitespace, so compact JSON (what OpenAI's structured
outputs return) and ``", "`` / ``": "``-spaced JSON both match, while runs of whitespace, newlines and indentation
(a weak model's favourite loop, which would spend ``max_tokens`` on nothing) cannot be generated.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

from loraplex.engine.structured.matcher import GrammarMatcher
from loraplex.engine.structured.spec import StructuredOutput

JSON_WHITESPACE = "[ ]?"
MAX_ERROR_CHARS = 600


class GrammarError(ValueError):
    """A grammar that cannot be compiled: an unsupported keyword or format, a syntax error, a resource limit.
    The message names it; ``kind`` is the StructuredOutput kind."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class CompiledGrammar:
    """A compiled grammar: a matcher in its start state that ``new_matcher`` copies."""

    kind: str
    key: str
    compile_ms: float
    _template: object

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


def grammar_definition(spec: StructuredOutput) -> str:
    """llguidance's grammar text for ``spec`` (no tokenizer needed; nothing checked yet)."""
    import llguidance

    kind = spec.kind
    if kind in ("json_schema", "json_object"):
        schema = spec.json_schema if kind == "json_schema" else {"type": "object"}
        options = {"whitespace_pattern": JSON_WHITESPACE, "lenient": kind == "json_schema" and not spec.strict}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    try:
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(f"structured.grammar is neither Lark nor GBNF: {_short(str(e))}", kind) from None


def check_grammar(spec: StructuredOutput) -> None:
    """Compile-check ``spec`` without a tokenizer (what a gateway can do before it queues the request); a
    ``GrammarError`` names what does not compile. The engine's own compile may still refuse a grammar its vocabulary
    cannot produce."""
    import llguidance

    kind = spec.kind
    try:
        definition = grammar_definition(spec)
    except GrammarError:
        raise
    except ValueError as e:
        raise GrammarError(f"invalid structured.{kind}: {_short(str(e))}", kind) from None
    error = llguidance.LLMatcher.validate_grammar(definition, None)
    if error:
        raise GrammarError(_describe(kind, error), kind)


class GrammarCompiler:
    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: list[int]) -> None:
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this engine has none")
        if not eos_token_ids:
            raise ValueError("structured outputs need an EOS token id (the model config and generation config "
                             "name none)")
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer = None
        self.tokenizer_ms: float | None = None

    def _ll_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                t0 = time.perf_counter()
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids)
                self.tokenizer_ms = (time.perf_counter() - t0) * 1e3
            return self._tokenizer

    def warm(self) -> None:
        """Wrap the tokenizer now (the first compile would)."""
        self._ll_tokenizer()

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        import llguidance

        t0 = time.perf_counter()
        kind = spec.kind
        try:
            definition = grammar_definition(spec)
        except ValueError as e:
            if isinstance(e, GrammarError):
                raise
            raise GrammarError(f"invalid structured.{kind}: {_short(str(e))}", kind) from None
        template = llguidance.LLMatcher(self._ll_tokenizer(), definition, log_level=0)
        if template.is_error():
            raise GrammarError(_describe(kind, template.get_error()), kind)
        return CompiledGrammar(kind, spec.cache_key, (time.perf_counter() - t0) * 1e3, template)


def _describe(kind: str, error: str) -> str:
    what = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
            "grammar": "grammar", "choice": "choice list"}[kind]
    fix = "remove it, or send strict=false to leave it unchecked"
    if error.startswith("Unimplemented keys:"):
        try:
            keys = ", ".join(json.loads(error.split(":", 1)[1]))
        except ValueError:
            keys = error.split(":", 1)[1].strip()
        return f"unsupported JSON schema keyword(s): {_short(keys)}; {fix.replace('it', 'them')}"
    if error.startswith("Unknown format:"):
        return f"unsupported JSON schema format {error.split(':', 1)[1].strip()!r}; {fix}"
    return f"the {what} does not compile: {_short(error)}"


def _short(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "…"

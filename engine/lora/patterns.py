"""Tenant-supplied module patterns, matched in linear time: the keys of ``rank_pattern`` / ``alpha_pattern`` and a
``target_modules`` string in ``adapter_config.json``.

PEFT's rule (``peft.utils.other.get_pattern_key``): pattern ``P`` applies to the module key ``K``
(``model.layers.3.self_attn.q_proj``) when ``re.match(rf"(.*\\.)?({P})$", K)``; the first pattern in the file that
matches wins. ``P`` is a general regular expression, and Python's backtracking ``re`` takes exponential time on
some of them (``(a+)+$``, ``(.*.*)*x``): one 2 KB config once held the GIL for tens of seconds. So patterns are
split in two classes, each matched with PEFT's exact semantics in time linear in the key:

- **literal** patterns, what PEFT's docs and real configs use: letters, digits, ``_``, ``-``, ``.`` (any character,
  as in a regex), ``\\.`` (a dot), an optional leading ``^`` and trailing ``$`` (``q_proj``,
  ``^model.layers.0.self_attn.q_proj``). Such a pattern has no quantifier, group or alternation, so it matches a
  fixed number of characters and Python's ``re`` runs PEFT's expression in O(len(K) x len(P)) steps: no regex
  engine beyond the standard library is needed (the GPU image has only that).
- every other pattern is compiled by RE2 (``google-re2``, module ``re2``; a runtime dependency of the platform),
  whose automaton matches in linear time whatever the pattern. RE2 has no lookaround and no backreferences: a
  pattern using them is refused, naming the key. Where ``re2`` is not installed (an engine-only image) such a
  pattern is refused with a message saying so, and literal patterns keep working.

Bounds, checked before any compilation: ``MAX_PATTERN_CHARS`` per pattern, ``MAX_PATTERNS`` per map. A match
costs about a microsecond (Python call overhead, not the pattern), so the worst case, ``MAX_PATTERNS`` patterns
against every module of a 128-layer model, is a few seconds of one upload-pool thread, never a stall.
"""
from __future__ import annotations

import re
from typing import Callable

MAX_PATTERN_CHARS = 256
MAX_PATTERNS = 1024
RE2_MAX_MEM = 8 << 20            # bytes RE2 may spend on one compiled pattern (its own default)
_LITERAL = re.compile(r"\^?(?:[A-Za-z0-9_\-.]|\\\.)+\$?")

Matcher = Callable[[str], bool]


class PatternError(ValueError):
    """A pattern that cannot be matched safely; the message names it and says what to change."""


def is_literal(pattern: str) -> bool:
    """Whether ``pattern`` is in the literal class (matched with Python's ``re``, no RE2 needed)."""
    return len(pattern) <= MAX_PATTERN_CHARS and _LITERAL.fullmatch(pattern) is not None


def compile_suffix_pattern(pattern: object, *, where: str) -> Matcher:
    """``K -> bool``: PEFT's rank_pattern / alpha_pattern rule for ``pattern``. ``where`` names the field
    (``rank_pattern``) in error messages."""
    text = _checked(pattern, where)
    expression = rf"(.*\.)?({text})$"
    if is_literal(text):
        compiled = re.compile(expression)
        return lambda key: compiled.match(key) is not None
    compiled2 = _re2_compile(expression, text, where)
    return lambda key: compiled2.match(key.encode("utf-8")) is not None   # bytes: no offset bookkeeping


def check_full_pattern(pattern: object, *, where: str) -> str:
    """Checks a pattern PEFT applies with ``re.fullmatch`` (a ``target_modules`` string); returns it."""
    text = _checked(pattern, where)
    if not is_literal(text):
        _re2_compile(text, text, where)
    return text


def _checked(pattern: object, where: str) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise PatternError(f"{where}: every pattern must be a non-empty string, got {pattern!r}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"{where}: pattern {pattern[:40]!r}... is {len(pattern)} characters, over the "
                           f"{MAX_PATTERN_CHARS}-character limit; name the modules with a shorter pattern")
    try:
        pattern.encode("utf-8")
    except UnicodeEncodeError:
        raise PatternError(f"{where}: pattern {pattern!r} is not valid text (a lone surrogate); "
                           "write it in plain UTF-8") from None
    return pattern


def _re2_compile(expression: str, pattern: str, where: str):
    try:
        import re2
    except ImportError:
        raise PatternError(f"{where}: pattern {pattern!r} is a general regular expression, which this process "
                           "matches only with google-re2 (not installed here); install google-re2, or use a "
                           "literal module path such as 'model.layers.0.self_attn.q_proj' or 'q_proj'") from None
    options = re2.Options()
    options.log_errors = False
    options.max_mem = RE2_MAX_MEM
    options.never_capture = True     # only "does it match": no submatch extraction
    try:
        return re2.compile(expression, options)
    except re2.error as e:
        reason = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise PatternError(f"{where}: pattern {pattern!r} is not supported ({reason}); patterns are RE2 regular "
                           "expressions: no lookaround (?=, (?!, (?<=), no backreferences, bounded "
                           "repetition") from None


__all__ = ["MAX_PATTERNS", "MAX_PATTERN_CHARS", "PatternError", "compile_suffix_pattern", "check_full_pattern",
           "is_literal"]

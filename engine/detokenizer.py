"""Incremental detokenization: each step yields only the new text, never a half-decoded UTF-8 character.

    text after a step = tokenizer.decode(all output ids)            (trailing U+FFFD held back until final)

Decoding every id again each step costs O(output length) per sequence per step. For tokenizers whose decode is
a plain concatenation over the ids (a byte-level BPE decoder, no clean-up of tokenization spaces: GPT-OSS,
Qwen, Llama 3 ...), the decoded text of ids[:k] is final once it ends in a complete character, so only the ids
after the last such point are decoded again:

    ids:   [ o0 o1 o2 o3 | o4 o5 ]      decode(ids) == base_text + decode(ids[4:])
             base (text ends in a whole character)

A byte-level decoder turns the ids into one byte string and decodes it as UTF-8 with replacement; a prefix
whose text does not end in U+FFFD ends on a character boundary, so the decoder starts afresh after it and the
concatenation is exact. Other tokenizers decode all ids each step, as before.
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"


def decodes_by_concatenation(tokenizer) -> bool:
    """True when ``tokenizer.decode(a + b) == decode(a) + decode(b)`` whenever ``decode(a)`` ends in a complete
    character: a fast tokenizer with a byte-level decoder and no clean-up of tokenization spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    return type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


class IncrementalDetokenizer:
    """Decodes a growing list of token ids. Text ending in U+FFFD (an incomplete multi-byte character) is held
    back until the next token completes it, so streamed deltas concatenate to the final text."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, incremental: bool | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        # incremental=None: decide from the tokenizer; False forces the full decode (tests compare the two)
        self._incremental = decodes_by_concatenation(tokenizer) if incremental is None else incremental
        self._base_ids = 0     # ids whose text is final: decode(ids[:_base_ids]) == _base_text
        self._base_text = ""

    def update(self, token_ids: list[int], final: bool = False) -> str:
        full = self._decode(token_ids)
        if not final:
            while full.endswith(_REPLACEMENT):
                full = full[:-1]
        if not full.startswith(self.text):  # the tokenizer re-spaced earlier text; emit nothing to retract
            self.text = full
            return ""
        delta = full[len(self.text):]
        self.text = full
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        """``tokenizer.decode(token_ids)``, decoding only the ids after the last complete character when the
        tokenizer allows it (see the module docstring)."""
        if not self._incremental:
            return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        if len(token_ids) < self._base_ids:  # not the list it grew from: start over
            self._base_ids, self._base_text = 0, ""
        tail = self.tokenizer.decode(token_ids[self._base_ids:], skip_special_tokens=self.skip_special_tokens)
        full = self._base_text + tail
        if not tail.endswith(_REPLACEMENT):  # "" too: ids with no bytes (skipped special ids) keep it whole
            self._base_ids, self._base_text = len(token_ids), full
        return full

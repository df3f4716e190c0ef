"""Incremental detokenization: each step yields only the new text, never a half-decoded UTF-8 character."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing list of token ids. Text ending in U+FFFD (an incomplete multi-byte character) is held
    back until the next token completes it, so streamed deltas concatenate to the final text."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""

    def update(self, token_ids: list[int], final: bool = False) -> str:
        full = self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        if not final:
            while full.endswith("\ufffd"):
                full = full[:-1]
        if not full.startswith(self.text):  # the tokenizer re-spaced earlier text; emit nothing to retract
            self.text = full
            return ""
        delta = full[len(self.text):]
        self.text = full
        return delta

"""The gateway's tokenizer: prompts are tokenized here (quotas count exact prompt tokens; engines get ids).

Uses the ``tokenizers`` library on the base model's ``tokenizer.json`` (fast, no torch); falls back to
transformers' ``AutoTokenizer`` for folders without one. No tokenizer at all (``ENGINE_MODE=null`` without a
base model): prompts go to the engine as text and count as ``ceil(len(text) / 4)`` tokens.
"""
from __future__ import annotations

import math
import os

from loraplex.platform.inference.chat_template import ChatTemplate


class PromptTokenizer:
    def __init__(self, folder: str | None) -> None:
        self._fast = None
        self._hf = None
        self.chat_template = ChatTemplate.from_pretrained(folder) if folder else ChatTemplate(None)
        if folder and os.path.isfile(os.path.join(folder, "tokenizer.json")):
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        elif folder and os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(folder)

    @property
    def available(self) -> bool:
        return self._fast is not None or self._hf is not None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; chat prompts pass ``add_special_tokens=False`` (templates add their own)."""
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=add_special_tokens).ids
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=add_special_tokens))
        raise RuntimeError("no tokenizer loaded")

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped (what ``echo`` returns for a token-id prompt)."""
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=True)
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=True)
        raise RuntimeError("no tokenizer loaded")

    def prompt(self, text: str, *, add_special_tokens: bool) -> tuple[str | list[int], int]:
        """(what the engine gets, prompt token count)."""
        if not self.available:
            return text, max(1, math.ceil(len(text) / 4))
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return ids, len(ids)

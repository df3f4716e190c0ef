"""GPT-OSS chat completions in harmony, for a served tokenizer: prompt ids, stop ids, output parsers.

    HarmonyChat.for_model(folder, tokenizer)    None unless the tokenizer knows every harmony marker
      .prompt(messages, tools=, reasoning_effort=)   -> token ids ending with <|start|>assistant
      .stop_token_ids                                -> the served ids of <|return|> and <|call|>
      .parser(functions)                             -> TokenFeed over a HarmonyParser

Prompt ids: openai-harmony's own when the served vocabulary is o200k_harmony (a GPT-OSS checkpoint; the
vocabulary was rebuilt from its tokenizer.json and hash-checked), else harmony's text tokenized by the served
tokenizer (each marker is one special token there). No o200k vocabulary at all: ``renderer`` is None and the
caller renders with the model's chat template instead (``vocab_error`` says why).
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Protocol

from loraplex.platform.inference.harmony.parser import CALL, MARKERS, RETURN, HarmonyParser, TokenFeed
from loraplex.platform.inference.harmony.render import HarmonyRenderer, HarmonyRenderError
from loraplex.platform.inference.harmony.vocab import HarmonyVocabError, find_vocab_dir

logger = logging.getLogger(__name__)


_SAMPLE = "Hello, world! 2 + 2 = 4.\n\tÜnïcode: 東京, emoji 🙂"   # vocabularies that agree on it are one


class ServedTokenizer(Protocol):
    def token_to_id(self, token: str) -> int | None: ...
    def encode_plain(self, text: str) -> list[int]: ...   # special tokens' text stays text
    def decode(self, ids: list[int]) -> str: ...           # special tokens skipped


class HarmonyChat:
    def __init__(self, tokenizer: ServedTokenizer, markers: dict[str, int], renderer: HarmonyRenderer | None,
                 *, vocab_error: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.marker_ids = markers                          # marker text -> served id
        self.markers_by_id = {i: m for m, i in markers.items()}
        self.renderer = renderer
        self.vocab_error = vocab_error
        self.native_ids = renderer is not None and all(
            renderer.encoding.encode(m, allowed_special={m}) == [i] for m, i in markers.items()) and \
            renderer.encoding.encode(_SAMPLE) == tokenizer.encode_plain(_SAMPLE)

    @classmethod
    def for_model(cls, folder: str | None, tokenizer: ServedTokenizer) -> "HarmonyChat | None":
        """Harmony for a served GPT-OSS tokenizer; None when it lacks a harmony marker (then it is not harmony)."""
        markers = {m: tokenizer.token_to_id(m) for m in MARKERS}
        if any(i is None for i in markers.values()):
            missing = [m for m, i in markers.items() if i is None]
            logger.warning("gpt_oss tokenizer without the harmony tokens %s: chat uses the model's chat template",
                           " ".join(missing))
            return None
        renderer, error = None, None
        try:
            renderer = HarmonyRenderer.from_vocab_dir(find_vocab_dir(folder))
        except HarmonyVocabError as e:
            error = str(e)
            logger.warning("harmony prompts need the o200k vocabulary: %s; GPT-OSS chat prompts use the model's "
                           "chat template until then (outputs are still parsed as harmony)", e)
        return cls(tokenizer, markers, renderer, vocab_error=error)  # type: ignore[arg-type]

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.marker_ids[RETURN], self.marker_ids[CALL]]

    def prompt(self, messages: Iterable[Any], **kw: Any) -> list[int]:
        """The prompt's served token ids (``renderer`` must be set); ``kw`` as ``harmony_messages``."""
        assert self.renderer is not None
        ids = self.renderer.render_ids(messages, **kw)
        return ids if self.native_ids else self._served_ids(ids)

    def _served_ids(self, ids: list[int]) -> list[int]:
        """Harmony's ids in another vocabulary: each special token -> the served one, each run of text between
        them re-encoded as plain text (a tenant's literal "<|start|>" stays text, as in harmony's own ids)."""
        enc = self.renderer.encoding
        out: list[int] = []
        run: list[int] = []
        for t in [*ids, None]:
            if t is not None and not enc.is_special_token(t):
                run.append(t)
                continue
            if run:
                out.extend(self.tokenizer.encode_plain(enc.decode_utf8(run)))
                run = []
            if t is not None:
                special = enc.decode_utf8([t])
                served = self.marker_ids.get(special, self.tokenizer.token_to_id(special))
                if served is None:
                    raise HarmonyRenderError(f"the served tokenizer has no {special} token")
                out.append(served)
        return out

    def parser(self, functions: Iterable[str] | None = None) -> TokenFeed:
        """A fresh output parser over served token ids; ``functions``: the tool names the request offered."""
        return TokenFeed(HarmonyParser(functions=functions), markers=self.markers_by_id, decode=self.tokenizer.decode)

"""ChunkEncoder: one request's ``RequestOutput`` stream as wire chunk dicts (``protocol.chunk_dict``).

    RequestOutput (cumulative per completion + this step's delta) ──encode──▶ {"token_ids", "text", ...,
                                                                                "outputs": [changed completions]}

A request of one plain sequence gets the old chunk (top-level fields only). With ``n > 1``, ``best_of`` or
``logprobs`` each chunk lists the completions that changed: new tokens or text, or the step that ended them
(``finish_reason`` is sent once per completion). A completion's logprob entries arrive with its tokens (the engine
keeps the whole list; the encoder sends the ones not sent yet). Token texts come from the engine's tokenizer,
one id at a time, cached per id (a vocabulary is finite); without a tokenizer they are "". A token that is only
part of a UTF-8 character decodes to U+FFFD; its entry then also carries the token's raw ``bytes`` (byte-level
BPE pieces and ``<0xNN>`` byte-fallback pieces), so a client can join the bytes of consecutive tokens.
"""
from __future__ import annotations

import re
from typing import Any

from loraplex.engine.server.protocol import chunk_dict, logprob_dict, output_dict


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in of each byte (GPT-2's table), inverted: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


class TokenTexts:
    """``text(id)``: one token decoded alone (``tokenizer.decode([id])``), memoised; ``raw_bytes(id)``: its bytes
    when its text alone is not valid UTF-8 (else None)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def _get(self, token_id: int) -> tuple[str, list[int] | None]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
            hit = (text, self._bytes(token_id) if "\ufffd" in text else None)
            self._cache[token_id] = hit
        return hit

    def _bytes(self, token_id: int) -> list[int] | None:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return [int(m.group(1), 16)]
        if piece and all(ch in _BYTE_LEVEL for ch in piece):
            return [_BYTE_LEVEL[ch] for ch in piece]
        return None

    def text(self, token_id: int) -> str:
        return self._get(token_id)[0]

    def raw_bytes(self, token_id: int) -> list[int] | None:
        return self._get(token_id)[1]


class ChunkEncoder:
    """Per request; ``params`` is its ``SamplingParams``, ``texts`` a shared ``TokenTexts``."""

    def __init__(self, params: Any, texts: TokenTexts) -> None:
        self.texts = texts
        self.detailed = params.num_sequences > 1 or params.logprobs is not None or params.use_beam_search
        self._lp_sent: dict[int, int] = {}   # completion index -> logprob entries sent
        self._ended: set[int] = set()        # completion indexes whose finish_reason was sent

    def entry(self, e: Any) -> dict:
        """A ``TokenLogprob`` as its wire dict."""
        texts = self.texts
        top = []
        for t, lp in e.top:
            raw = texts.raw_bytes(t)
            top.append((t, texts.text(t), lp) if raw is None else (t, texts.text(t), lp, raw))
        return logprob_dict(e.token_id, texts.text(e.token_id), e.logprob, e.rank, top,
                            raw_bytes=texts.raw_bytes(e.token_id))

    def encode(self, out: Any) -> dict:
        completions = out.outputs
        completion_tokens = (sum(len(c.output_token_ids) for c in completions) if completions
                             else len(out.output_token_ids))
        outputs = None
        if self.detailed:
            outputs = [self._output(c) for c in completions
                       if c.new_token_ids or c.new_text or (c.finish_reason and c.index not in self._ended)]
        prompt_lp = None
        if out.finished and out.prompt_logprobs is not None:
            prompt_lp = [None if e is None else self.entry(e) for e in out.prompt_logprobs]
        return chunk_dict(out.request_id, list(out.new_token_ids), out.new_text, finished=out.finished,
                          finish_reason=out.finish_reason, prompt_tokens=len(out.prompt_token_ids),
                          completion_tokens=completion_tokens, cached_tokens=out.num_cached_tokens,
                          outputs=outputs, prompt_logprobs=prompt_lp)

    def _output(self, c: Any) -> dict:
        logprobs = None
        if c.logprobs is not None:
            start = self._lp_sent.get(c.index, 0)
            new = c.logprobs[start:len(c.output_token_ids)]
            self._lp_sent[c.index] = start + len(new)
            logprobs = [self.entry(e) for e in new]
        reason = None
        if c.finish_reason and c.index not in self._ended:
            self._ended.add(c.index)
            reason = c.finish_reason
        return output_dict(c.index, list(c.new_token_ids), c.new_text, finish_reason=reason,
                           cumulative_logprob=c.cumulative_logprob, logprobs=logprobs)

"""Engine logprob entries in OpenAI's two shapes.

An entry (``platform.engines.messages.TokenLogprob``) has ``token`` (its text), ``token_bytes``, ``logprob`` and
``top`` ``[(id, text, logprob, bytes | None)]`` best first; None marks a position without a logprob (the first
prompt token).

    chat:         {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...k]}]}
    completions:  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob} | null],
                   "text_offset": [...]}

``bytes`` is the token's own bytes: the UTF-8 of its text, or, for a token that is only part of a multi-byte
character (its text alone is U+FFFD), the raw bytes the engine sent. The legacy shape has no bytes: such a token
shows as ``"bytes:\\xe2\\x80"`` (OpenAI's notation), so its ``top_logprobs`` key differs from its siblings'. A legacy
``top_logprobs`` dict has the ``k`` best and the chosen token. ``text_offset`` advances by each token's text
length (a character split over tokens counts one U+FFFD per token).
"""
from __future__ import annotations

from typing import Any, Sequence

from loraplex.platform.inference.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def _top(token: str, logprob: float, raw: tuple[int, ...] | None) -> TopLogprob:
    return TopLogprob(token=token, logprob=logprob, bytes=list(raw) if raw is not None else list(token.encode("utf-8")))


def legacy_token(text: str, raw: tuple[int, ...] | None) -> str:
    """A token as the legacy shape shows it: its text, or ``bytes:\\x..`` when it is part of a character."""
    return text if raw is None else "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(entries: Sequence[Any], k: int) -> ChatLogprobs:
    """``choices[i].logprobs`` of a chat choice (or of one stream chunk's tokens); ``k`` = ``top_logprobs``."""
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=e.token, logprob=e.logprob, bytes=e.token_bytes,
                         top_logprobs=[_top(text, lp, raw) for _, text, lp, raw in e.top[:k]])
        for e in entries])


def completion_logprobs(entries: Sequence[Any | None], k: int, *, offset: int = 0,
                        first_token: str = "") -> tuple[CompletionLogprobs, int]:
    """The legacy shape of ``entries`` whose text starts at character ``offset``; a None entry (the first prompt
    token) shows as ``first_token`` with null logprobs. Returns it and the offset after the last token."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for e in entries:
        offsets.append(offset)
        if e is None:
            tokens.append(first_token)
            token_logprobs.append(None)
            tops.append(None)
            offset += len(first_token)
            continue
        tokens.append(legacy_token(e.token, e.bytes))
        token_logprobs.append(e.logprob)
        top = {legacy_token(text, raw): lp for _, text, lp, raw in e.top[:k]}
        top.setdefault(tokens[-1], e.logprob)
        tops.append(top)
        offset += len(e.token)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops,
                              text_offset=offsets), offset


def merge_completion_logprobs(a: CompletionLogprobs | None, b: CompletionLogprobs) -> CompletionLogprobs:
    """``a`` followed by ``b`` (the echoed prompt's, then the completion's)."""
    if a is None:
        return b
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)

"""OpenAI-shaped answers of a ``Generation``: a whole completion, or an SSE stream that closes the generation
(aborting the engine request) when the client goes away.

Stream layout (chat): a first chunk with ``delta.role``, one chunk per engine chunk with text, a last chunk with
``finish_reason``, a usage chunk (``choices: []``) when ``stream_options.include_usage``, then ``[DONE]``. An
engine error after the stream started is sent as an ``{"error": {...}}`` event before ``[DONE]``.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loraplex.platform.gateway.pipeline import Generation
from loraplex.platform.inference.errors import InferenceError
from loraplex.platform.inference.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                                  ChatCompletionChunk, ChatDelta, Completion, CompletionChoice,
                                                  Usage, now_s, openai_finish_reason)
from loraplex.platform.inference.sse import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, sse_event

logger = logging.getLogger(__name__)


def _usage(gen: Generation) -> Usage:
    return Usage.of(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)


async def complete(gen: Generation) -> ChatCompletion | Completion:
    """Run to the end and build the whole answer."""
    parts: list[str] = []
    async for chunk in gen.chunks():
        if chunk.text:
            parts.append(chunk.text)
    text, prep = "".join(parts), gen.prep
    reason = openai_finish_reason(gen.finish_reason) or "stop"
    if prep.kind == "chat":
        return ChatCompletion(id=prep.request_id, created=now_s(), model=prep.body.model, usage=_usage(gen),
                              choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=reason)])
    return Completion(id=prep.request_id, created=now_s(), model=prep.body.model, usage=_usage(gen),
                      choices=[CompletionChoice(text=text, finish_reason=reason)])


async def sse_stream(gen: Generation, chunks: AsyncIterator, first: list) -> AsyncIterator[bytes]:
    """SSE events of ``chunks`` (``gen.chunks()``); ``first`` holds the chunk already taken from it, so that errors
    before the first token were answered as plain HTTP errors."""
    prep = gen.prep
    created, model, chat = now_s(), prep.body.model, prep.kind == "chat"

    def event(text: str | None, reason: str | None, *, role: bool = False):
        if chat:
            delta = ChatDelta(role="assistant" if role else None, content=text)
            return sse_event(ChatCompletionChunk(id=prep.request_id, created=created, model=model,
                                                 choices=[ChatChunkChoice(delta=delta, finish_reason=reason)]))
        return sse_event(Completion(id=prep.request_id, created=created, model=model,
                                    choices=[CompletionChoice(text=text or "", finish_reason=reason)]))

    try:
        if chat:
            yield event("", None, role=True)
        pending = first
        while True:
            if pending:
                chunk = pending.pop()
            else:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
            reason = openai_finish_reason(chunk.finish_reason) if chunk.finished else None
            if chunk.text or reason:
                yield event(chunk.text if chunk.text or not chat else None, reason)
        if prep.body.include_usage:
            cls = ChatCompletionChunk if chat else Completion
            yield sse_event(cls(id=prep.request_id, created=created, model=model, choices=[], usage=_usage(gen)))
        yield SSE_DONE
    except InferenceError as e:
        logger.warning("request %s failed mid-stream: %s", prep.request_id, e.code)
        yield sse_event(e.body())
        yield SSE_DONE
    finally:
        with anyio.CancelScope(shield=True):
            await chunks.aclose()


class SSEResponse(StreamingResponse):
    """A streaming response that notices a client disconnect at once (not only at the next write) and always
    closes its body iterator, so the generation's cleanup runs while the request is still being handled."""

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(content, media_type=SSE_MEDIA_TYPE, headers={**SSE_HEADERS, **(headers or {})})
        self.on_close = on_close  # runs last, also when the body never started (client gone before the headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-write
                    finally:
                        tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                if self.on_close is not None:
                    await self.on_close()

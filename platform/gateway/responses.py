"""OpenAI-shaped answers of a ``Generation``: a whole completion, or an SSE stream that closes the generation
(aborting the engine request) when the client goes away.

Stream layout (chat): a first chunk with ``delta.role`` per choice, one chunk per choice and engine chunk with text
(and that text's tokens' logprobs; GPT-OSS: ``delta.reasoning_content`` beside ``delta.content``; with tools:
``delta.tool_calls``, a call's index, id, type and name first, then its arguments in pieces), each choice's last
chunk with ``finish_reason``, a usage chunk (``choices: []``) when ``stream_options.include_usage``, then
``[DONE]``. An engine error after the stream started is sent as an ``{"error": {...}}`` event before ``[DONE]``.

Completions with several prompts: each prompt's choices are built apart (a ``Choices`` per prompt) and numbered
``prompt_index * n + choice``; streamed, the prompts' events interleave as the engine produces them.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loraplex.platform.gateway.choices import Choices
from loraplex.platform.gateway.pipeline import Generation
from loraplex.platform.inference.errors import InferenceError
from loraplex.platform.inference.logprobs import chat_logprobs, completion_logprobs, merge_completion_logprobs
from loraplex.platform.inference.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                                  ChatCompletionChunk, ChatDelta, Completion, CompletionChoice,
                                                  CompletionLogprobs, FunctionCall, FunctionCallDelta, ToolCall,
                                                  ToolCallDelta, Usage, now_s, openai_finish_reason)
from loraplex.platform.inference.sse import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, sse_event

logger = logging.getLogger(__name__)


def _usage(gen: Generation) -> Usage:
    return Usage.of(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)


def _reason(engine_reason: str | None) -> str:
    return openai_finish_reason(engine_reason) or "stop"


def _first_prompt_token(gen: Generation, p: int) -> str:
    """Text of prompt ``p``'s first token (its logprob entry is null, so the engine sent no text for it)."""
    prompt = gen.prep.prompts[p]
    if isinstance(prompt, list) and prompt and gen.gw.tokenizer.available:
        return gen.gw.tokenizer.decode(prompt[:1])
    return ""


def _echo_logprobs(gen: Generation, choices: Choices, p: int) -> CompletionLogprobs | None:
    if not gen.prep.plan.prompt_logprobs or choices.prompt_logprobs is None:
        return None
    return completion_logprobs(choices.prompt_logprobs, gen.prep.plan.logprobs or 0,
                               first_token=_first_prompt_token(gen, p))[0]


def _choices(gen: Generation) -> Choices:
    """The request's choices; GPT-OSS chat parses each completion's harmony channels, other chats with tools their
    tool calls."""
    parser = None
    if gen.prep.kind == "chat" and gen.gw.tokenizer.parses_output(gen.prep.body):
        parser = lambda: gen.gw.tokenizer.output_parser(gen.prep.body)  # noqa: E731
    return Choices(gen.prep.plan, parser)


def _message(c) -> AssistantMessage:
    calls = [ToolCall(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments)) for t in c.tool_calls]
    return AssistantMessage(content=c.text if c.text or not calls else None, reasoning_content=c.reasoning or None,
                            tool_calls=calls or None)


def _delta(d, role: bool = False) -> ChatDelta:
    calls = [ToolCallDelta(index=t.index, id=t.id, type="function" if t.id else None,
                           function=FunctionCallDelta(name=t.name, arguments=t.arguments)) for t in d.tool_calls]
    return ChatDelta(role="assistant" if role else None, content=d.text or None,
                     reasoning_content=d.reasoning or None, tool_calls=calls or None)


async def complete(gen: Generation) -> ChatCompletion | Completion:
    """Run to the end and build the whole answer: ``n`` choices (best_of: the best ``n``), with logprobs and the
    echoed prompt when asked."""
    prep = gen.prep
    plan = prep.plan
    groups = [_choices(gen) for _ in range(prep.num_prompts)]
    async for chunk in gen.chunks():
        groups[prep.prompt_index(chunk.request_id)].add(chunk)
    k = plan.logprobs
    if prep.kind == "chat":
        final = groups[0].final(gen.finish_reason)
        return ChatCompletion(id=prep.request_id, created=now_s(), model=prep.body.model, usage=_usage(gen), choices=[
            ChatChoice(index=c.index, message=_message(c), finish_reason=_reason(c.finish_reason),
                       logprobs=chat_logprobs(c.logprobs, k) if k is not None else None) for c in final])
    out = []
    for p, choices in enumerate(groups):
        echo = prep.echo_texts[p] if plan.echo else ""
        prompt_lp = _echo_logprobs(gen, choices, p)
        for c in choices.final(gen.finish_reasons.get(prep.engine_request_id(p))):
            logprobs = None
            if k is not None:
                logprobs = merge_completion_logprobs(prompt_lp,
                                                     completion_logprobs(c.logprobs, k, offset=len(echo))[0])
            out.append(CompletionChoice(index=p * plan.n + c.index, text=echo + c.text,
                                        finish_reason=_reason(c.finish_reason), logprobs=logprobs))
    return Completion(id=prep.request_id, created=now_s(), model=prep.body.model, usage=_usage(gen), choices=out)


async def sse_stream(gen: Generation, chunks: AsyncIterator, first: list) -> AsyncIterator[bytes]:
    """SSE events of ``chunks`` (``gen.chunks()``); ``first`` holds the chunk already taken from it, so that errors
    before the first token were answered as plain HTTP errors.

    With ``n > 1`` every event carries one choice (its ``index``), in the order the engine produced them. Echo
    sends the prompt as each choice's first event; echo with logprobs holds the events back until the engine's
    last chunk brings the prompt's logprobs (the stream then comes at once)."""
    prep = gen.prep
    plan, k = prep.plan, prep.plan.logprobs
    created, model, chat = now_s(), prep.body.model, prep.kind == "chat"
    groups = [_choices(gen) for _ in range(prep.num_prompts)]
    n_all = plan.n * prep.num_prompts
    offsets = {i: len(prep.echo_texts[i // plan.n]) if plan.echo else 0 for i in range(n_all)}  # legacy text_offset

    def event(index: int, text: str | None, reason: str | None, *, role: bool = False, logprobs=None,
              parsed=None) -> bytes:
        if chat:
            delta = _delta(parsed) if parsed is not None else ChatDelta(role="assistant" if role else None,
                                                                        content=text)
            lp = chat_logprobs(logprobs, k) if k is not None and logprobs else None
            return sse_event(ChatCompletionChunk(id=prep.request_id, created=created, model=model, choices=[
                ChatChunkChoice(index=index, delta=delta, finish_reason=reason, logprobs=lp)]))
        lp = None
        if k is not None and logprobs:
            lp, offsets[index] = completion_logprobs(logprobs, k, offset=offsets[index])
        return sse_event(Completion(id=prep.request_id, created=created, model=model, choices=[
            CompletionChoice(index=index, text=text or "", finish_reason=reason, logprobs=lp)]))

    def echo_events() -> list[bytes]:
        events = []
        for p, choices in enumerate(groups):
            lp = _echo_logprobs(gen, choices, p)
            events.extend(sse_event(Completion(id=prep.request_id, created=created, model=model, choices=[
                CompletionChoice(index=p * plan.n + i, text=prep.echo_texts[p], logprobs=lp)]))
                for i in range(plan.n))
        return events

    held: list[bytes] | None = [] if plan.prompt_logprobs else None
    try:
        if chat:
            for i in range(plan.n):
                yield event(i, "", None, role=True)
        elif plan.echo and held is None:
            for e in echo_events():
                yield e
        pending = first
        while True:
            if pending:
                chunk = pending.pop()
            else:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
            events = []
            p = prep.prompt_index(chunk.request_id)
            first_index = p * plan.n
            for d in groups[p].add(chunk):
                reason = openai_finish_reason(d.finish_reason)
                if d.text or d.reasoning or d.tool_calls or reason or (k is not None and d.logprobs):
                    events.append(event(first_index + d.index, d.text if d.text or not chat else None, reason,
                                        logprobs=d.logprobs if k is not None else None,
                                        parsed=d if chat else None))
            if chunk.finished:
                events.extend(event(first_index + i, None if chat else "", _reason(chunk.finish_reason))
                              for i in groups[p].unfinished())
            if held is None:
                for e in events:
                    yield e
            else:
                held.extend(events)
        if held is not None:
            for e in echo_events() + held:
                yield e
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

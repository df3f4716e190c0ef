"""Several engine requests of one API request (a completions request with a list of prompts), run at once.

    merge([stream_0, stream_1, ...])   their items as they come; each stream is iterated and closed by a task of
                                       its own, so closing the merge cancels them all (each closes its stream,
                                       which aborts its engine request); the first error raised by one is raised
    gather([coro_0, coro_1, ...])      their results in order; the first failure is raised, the others cancelled
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable

import anyio

_ENDED = object()


async def merge(streams: list[AsyncIterator]) -> AsyncIterator:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(_ENDED)
        except Exception as e:  # noqa: BLE001 - raised by the consumer
            await queue.put(_Failed(e))
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _ENDED:
                running -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def gather(coros: list[Awaitable[Any]]) -> list[Any]:
    results: list[Any] = [None] * len(coros)

    async def run(i: int) -> None:
        results[i] = await coros[i]

    try:
        async with anyio.create_task_group() as tg:
            for i in range(len(coros)):
                tg.start_soon(run, i)
    except BaseExceptionGroup as group:
        raise _first_error(group) from None
    return results


class _Failed:
    def __init__(self, error: Exception) -> None:
        self.error = error


def _first_error(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first_error(first) if isinstance(first, BaseExceptionGroup) else first

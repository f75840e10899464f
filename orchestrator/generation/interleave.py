"""Several async iterators read at once, their items interleaved as they arrive.

Used where one answer streams several generations that run concurrently: ``n`` > 1 choices
(:mod:`orchestrator.generation.choices`) and llama-server's ``/completion`` with several prompts,
whose tasks run on their slots at once and whose chunks go out as they come, each with its
``index`` (``tools/server/server-context.cpp``, ``handle_completions_impl``: one reader of every
task's results).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")


async def interleaved(sources: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """``(index, item)`` for each item of ``sources[index]``, in the order the items arrive, until every
    source is exhausted.  The first exception a source raises is raised here (the others are then
    cancelled).  Closing the iterator cancels the sources still running; a source that is an async
    generator is closed (its ``finally`` blocks run) when its task is cancelled or ends."""
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                queue.put_nowait((index, item))
            queue.put_nowait(None)
        except BaseException as exc:
            queue.put_nowait(exc)
        finally:
            closing = getattr(source, "aclose", None)
            if closing is not None:
                with contextlib.suppress(BaseException):
                    await closing()

    tasks = [asyncio.create_task(pump(i, s), name=f"interleaved-{i}") for i, s in enumerate(sources)]
    try:
        left = len(tasks)
        while left:
            got = await queue.get()
            if got is None:
                left -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

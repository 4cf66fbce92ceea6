"""Several async tasks or streams run as one: all succeed, or the first error stops all.

The REST handlers answer `n` choices with n engine requests, and a response is all of
them or one error. Stopping a request means cancelling the task that awaits its
stream (the cancel lands in the pending `anext`, so the dispatch path's `finally`s run
and the replica aborts the request in its engine) and then closing the stream, which
stops one that was between items. No Ray here: tests drive it with plain generators.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def all_or_first_error(aws: Sequence[Awaitable[T]]) -> list[T]:
    """The results of `aws`, run concurrently, in their order. When one raises, the
    others are cancelled (and awaited) and its error is raised (the lowest index among
    errors that land together); cancelling the caller cancels them all."""
    if len(aws) == 1:  # one choice: no task, exactly the plain await it always was
        return [await aws[0]]
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        await _cancel(tasks)


async def merge_streams(
    streams: Sequence[AsyncGenerator[T, None]],
) -> AsyncIterator[tuple[int, T]]:
    """(index, item) of each stream's items as they arrive, every stream's in its own
    order; ends when all streams end. The first error a stream raises ends the merge
    with that error, after the other streams are stopped; closing or cancelling the
    merge stops them all too. Example: a yields 1, 2 and b yields 3 ->
    (0, 1), (1, 3), (0, 2) or any other interleaving keeping 1 before 2."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    # Unbounded: a pump then only ever waits inside its stream's anext, where a cancel
    # reaches the stream (a pump blocked on a full queue would leave it suspended).
    queue: asyncio.Queue[tuple[int, object, Exception | None]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(i, s, queue)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                live -= 1
            else:
                yield index, item  # type: ignore[misc]
    finally:
        await _cancel(tasks)
        await close_all(streams)


async def _pump(index: int, stream: AsyncIterator[object], queue: asyncio.Queue) -> None:
    try:
        async for item in stream:
            queue.put_nowait((index, item, None))
    except Exception as e:
        queue.put_nowait((index, None, e))
        return
    queue.put_nowait((index, _END, None))


async def _cancel(tasks: list[asyncio.Future]) -> None:
    """Cancel `tasks` and wait until each has finished (a stream is closed only after its
    task let go of it: closing a running generator raises)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def close_all(streams: Sequence[AsyncGenerator[object, None]]) -> None:
    """Close streams no task iterates any more (a finished one is left as it is)."""
    for s in streams:
        await s.aclose()

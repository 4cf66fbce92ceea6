"""Bounded waits on observable state, for tests of live processes (Ray Serve, Redis) and
of tasks on an event loop.

A fixed sleep is too short on a loaded CI machine and too long everywhere else; these
polls end as soon as the state shows, and fail naming what they waited for.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def _timed_out(what: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(f"{what} did not happen within {timeout_s} s")


def wait_for(probe: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.25) -> T:
    """The first truthy value `probe` returns, polled every interval_s; a TimeoutError
    naming `what` once timeout_s has passed without one (probed once more at the end).
    Example: wait_for(lambda: running_replicas() == 2, 90, "scaling up to 2 replicas")."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s)
        time.sleep(interval_s)


async def wait_for_async(
    probe: Callable[[], T | Awaitable[T]], timeout_s: float, what: str, interval_s: float = 0.05
) -> T:
    """wait_for inside a coroutine: between probes it awaits asyncio.sleep, so the tasks
    whose progress it waits for keep running on the same loop (time.sleep would stall
    them until the timeout). `probe` is a plain callable, or one returning an awaitable
    (an async method such as `reg.get_served`), awaited on each round.
    Example: await wait_for_async(lambda: engine.stats().num_running == 2, 30, "2 running")."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s)
        await asyncio.sleep(interval_s)

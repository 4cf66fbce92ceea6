"""tests.polling.wait_for_async: the value once the probe shows it (plain or awaitable
probe), a TimeoutError naming what was awaited, and the loop free meanwhile."""

from __future__ import annotations

import asyncio

import pytest

from tests.polling import wait_for_async


class Counter:
    """A probe returning 0 until its ready_at-th call, then that call's number."""

    def __init__(self, ready_at: int):
        self.ready_at, self.calls = ready_at, 0

    def __call__(self) -> int:
        self.calls += 1
        return self.calls if self.calls >= self.ready_at else 0


@pytest.mark.parametrize("awaitable", [False, True], ids=["plain", "awaitable"])
def test_returns_the_first_truthy_value(awaitable):
    count = Counter(3)

    async def async_probe() -> int:
        return count()

    probe = async_probe if awaitable else count
    got = asyncio.run(wait_for_async(probe, 5, "the third call", interval_s=0.001))
    assert got == 3


def test_times_out_naming_what_it_waited_for():
    probe = Counter(10**9)
    with pytest.raises(TimeoutError, match=r"^the flag did not happen within 0\.1 s$"):
        asyncio.run(wait_for_async(probe, 0.1, "the flag", interval_s=0.01))
    assert probe.calls > 2  # probed again and again until the deadline, not once


def test_other_tasks_progress_while_it_waits():
    """The awaited state is set by another task on the same loop: a wait that slept
    with time.sleep would never let it run, and time out."""
    state = {"ticks": 0}

    async def ticker() -> None:
        for _ in range(5):
            await asyncio.sleep(0.01)
            state["ticks"] += 1

    async def main() -> int:
        task = asyncio.create_task(ticker())
        got = await wait_for_async(lambda: state["ticks"] == 5 and state["ticks"], 5, "5 ticks")
        await task
        return got

    assert asyncio.run(main()) == 5

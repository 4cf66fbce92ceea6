"""Loops that run until cancelled end on a cancel even when something below them drops
the CancelledError (pure: fake registries; the loss is made on purpose, and once the
way Python 3.11's asyncio.wait_for makes it)."""

from __future__ import annotations

import asyncio
import sys
from contextlib import asynccontextmanager

import pytest

from cluster.reconcile import watch_desired_state
from lora_core.aio import raise_if_cancelled
from replica.outputs import EngineStats
from replica.serve_registry import PublisherConfig, RegistryPublisher
from router.admin import keep_served_published

ENDS_WITHIN_S = 2.0


async def swallow_a_cancel() -> None:
    """Wait until cancelled, then return as if nothing happened (what a dropped
    cancellation looks like to the caller)."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass


async def cancel_and_wait(task: asyncio.Task) -> None:
    """Cancel task once, as asyncio.run does at its end; fail if it is still running
    ENDS_WITHIN_S later (before raise_if_cancelled these loops went round for ever)."""
    await asyncio.sleep(0.05)  # let it reach the point that drops the cancel
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=ENDS_WITHIN_S)
    assert task in done, "the loop kept running after its cancel was dropped"
    assert task.cancelled()


def run(main) -> None:
    """asyncio.run without its closing cancel of leftover tasks, which would hang on
    a loop that failed the test by not ending."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_raise_if_cancelled_only_with_a_request_outstanding():
    async def go():
        raise_if_cancelled()  # nothing asked: returns
        await swallow_a_cancel()
        raise_if_cancelled()

    async def main():
        task = asyncio.create_task(go())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancel since 3.12")
def test_python_3_11_wait_for_drops_a_cancel_that_meets_the_result():
    """The way a cancel was lost in CI: redis-py awaits socket writes in wait_for, and a
    write finishing in the loop turn of the cancel returned normally."""

    async def main():
        fut = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(asyncio.wait_for(fut, 10))
        await asyncio.sleep(0)
        fut.set_result("written")
        task.cancel()
        assert await task == "written"  # no CancelledError ...
        assert task.cancelling() == 1  # ... but the request is still counted

    run(main)


class FakeEngine:
    def stats(self) -> EngineStats:
        return EngineStats((), (), (), 2, 2, 0, 0, 0.0, 0, 0, 0)


def test_publisher_run_ends_when_a_tick_drops_the_cancel():
    pub = RegistryPublisher(PublisherConfig("r", "d", tick_s=0.01), object(), FakeEngine(), {})
    ticks = []

    async def tick():
        ticks.append(1)
        await swallow_a_cancel()

    pub.tick = tick

    async def main():
        await cancel_and_wait(asyncio.create_task(pub.run()))
        assert ticks == [1]

    run(main)


def test_publisher_keep_alive_ends_when_a_heartbeat_drops_the_cancel():
    class Registry:
        beats = 0

        async def heartbeat(self, replica_id, epoch, ttl_s):
            self.beats += 1
            await swallow_a_cancel()
            return True

    reg = Registry()
    pub = RegistryPublisher(PublisherConfig("r", "d", tick_s=0.01), reg, FakeEngine(), {})
    pub.epoch = 1

    async def main():
        await cancel_and_wait(asyncio.create_task(pub.keep_alive()))
        assert reg.beats == 1

    run(main)


def test_served_republish_ends_when_a_publish_drops_the_cancel():
    class Registry:
        async def publish_served(self, served):
            await swallow_a_cancel()

    async def main():
        await cancel_and_wait(asyncio.create_task(keep_served_published(Registry(), None, 0.01)))

    run(main)


def test_desired_state_watch_ends_when_a_read_drops_the_cancel():
    class Hints:
        async def get(self, timeout_s):
            await asyncio.sleep(timeout_s)

    class State:
        version = 1

    class Registry:
        reads = 0

        @asynccontextmanager
        async def subscribe_hints(self):
            yield Hints()

        async def desired_state(self):
            self.reads += 1
            await swallow_a_cancel()
            return State()

    reg = Registry()

    async def consume():
        async for _ in watch_desired_state(reg, 0.01):
            pass

    async def main():
        await cancel_and_wait(asyncio.create_task(consume()))
        assert reg.reads == 1

    run(main)

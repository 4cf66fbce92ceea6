"""watch_desired_state: hints wake it fast; the periodic full read catches lost hints."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio

from cluster.keys import Keys
from cluster.reconcile import watch_desired_state
from cluster.registry import AsyncRegistry, Registry


def test_hint_and_lost_hint(registry: Registry, redis_url, adapters):
    registry.register_adapter("a", str(adapters["a"]))
    registry.register_adapter("b", str(adapters["b"]))

    async def scenario() -> None:
        areg = AsyncRegistry(redis_url, namespace="t")
        # within the test only a hint wakes this one: its full read is an hour away
        hinted_only = watch_desired_state(areg, interval_s=3600.0)
        ticking = watch_desired_state(areg, interval_s=1.0)
        for watch in (hinted_only, ticking):
            first = await anext(watch)
            assert (first.version, first.pins) == (0, {})
        await areg.pin("a", "decode")
        hinted = await asyncio.wait_for(anext(hinted_only), timeout=30.0)
        assert hinted.version > 1_000_000_000_000  # a fresh counter starts at the clock (ms)
        assert hinted.pins == {"a": "decode"}
        assert await anext(ticking) == hinted
        # a change whose hint is lost: written without PUBLISH
        raw = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        keys = Keys("t")
        await raw.hset(keys.pins, "b", "all")
        await raw.incr(keys.desired)
        await raw.aclose()
        reconciled = await asyncio.wait_for(anext(ticking), timeout=3.0)  # the 1 s read
        assert reconciled.version == hinted.version + 1
        assert reconciled.pins == {"a": "decode", "b": "all"}
        await hinted_only.aclose()
        await ticking.aclose()
        await areg.close()

    asyncio.run(scenario())

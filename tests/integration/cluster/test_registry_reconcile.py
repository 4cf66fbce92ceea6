"""watch_desired_state: hints wake it fast; the periodic full read catches lost hints."""

from __future__ import annotations

import asyncio
import time

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
        watch = watch_desired_state(areg, interval_s=1.0)
        first = await anext(watch)
        assert (first.version, first.pins) == (0, {})
        t0 = time.monotonic()
        await areg.pin("a", "decode")
        hinted = await anext(watch)
        assert hinted.version > 1_000_000_000_000  # a fresh counter starts at the clock (ms)
        assert hinted.pins == {"a": "decode"}
        assert time.monotonic() - t0 < 0.8  # woken by the hint, not the 1 s reconcile
        # a change whose hint is lost: written without PUBLISH
        raw = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        keys = Keys("t")
        await raw.hset(keys.pins, "b", "all")
        await raw.incr(keys.desired)
        await raw.aclose()
        t0 = time.monotonic()
        reconciled = await asyncio.wait_for(anext(watch), timeout=3.0)
        assert reconciled.version == hinted.version + 1
        assert reconciled.pins == {"a": "decode", "b": "all"}
        await watch.aclose()
        await areg.close()

    asyncio.run(scenario())

"""Pins, warm targets, desired state and pub/sub hints on a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from cluster.records import Hint, WarmTarget
from cluster.registry import AsyncRegistry, Registry
from lora_core.errors import AdapterDraining, AdapterNotFound
from tests.redis_fixture import dump_redis


@pytest.fixture
def reg(registry: Registry, adapters) -> Registry:
    registry.register_adapter("a", str(adapters["a"]))
    registry.register_adapter("b", str(adapters["b"]))
    return registry


def test_pin_warm_and_full_reconcile(reg: Registry):
    assert reg.desired_state().version == 0
    reg.pin("a", "prefill")
    first = reg.desired_state().version  # the clock in ms: see test_desired_version_*
    reg.warm("b", 2, "decode")
    state = reg.desired_state()
    assert state.version == first + 1
    assert state.pins == {"a": "prefill"}
    assert state.warm == {"b": WarmTarget(2, "decode")}
    assert state.refs == {"a": reg.get_adapter("a").ref, "b": reg.get_adapter("b").ref}
    assert reg.unpin("a") is True
    assert reg.unpin("a") is False  # not pinned: no change, no bump
    reg.warm("b", 0)
    state = reg.desired_state()
    assert (state.version, state.pins, state.warm, state.refs) == (first + 3, {}, {}, {})


def test_desired_state_refusals_leave_redis_unchanged(reg: Registry, redis_url):
    e = reg.register_replica("r1", "mixed", "d", 4, 30.0)
    reg.report_resident("r1", e, ("b", 1), "gpu")
    reg.unregister_adapter("b")
    before = dump_redis(redis_url)
    with pytest.raises(AdapterNotFound):
        reg.pin("zzz")
    with pytest.raises(AdapterNotFound):
        reg.warm("zzz", 1)
    with pytest.raises(AdapterDraining):
        reg.pin("b")
    with pytest.raises(AdapterDraining):
        reg.warm("b", 2)
    with pytest.raises(ValueError, match="pool='mixed'"):
        reg.pin("a", "mixed")
    with pytest.raises(ValueError, match="replicas=-1"):
        reg.warm("a", -1)
    assert dump_redis(redis_url) == before


def test_sync_hints_follow_changes(reg: Registry):
    with reg.subscribe_hints() as hints:
        assert hints.get(0.05) is None
        reg.pin("a")
        reg.warm("b", 3)
        reg.register_adapter("a", reg.get_adapter("b").path, replace=True)
        got = [hints.get(1.0) for _ in range(3)]
    v = got[0].version
    assert got == [Hint(v, "a", "pin"), Hint(v + 1, "b", "warm"), Hint(v + 2, "a", "replaced")]


def test_async_hints(reg: Registry, redis_url):
    async def scenario() -> list[Hint | None]:
        areg = AsyncRegistry(redis_url, namespace="t")
        async with areg.subscribe_hints() as hints:
            await areg.pin("b", "decode")
            await areg.unregister_adapter("b")
            got = [await hints.get(1.0), await hints.get(1.0)]
        await areg.close()
        return got

    got = asyncio.run(scenario())
    assert got == [Hint(got[0].version, "b", "pin"), Hint(got[0].version + 1, "b", "removed")]

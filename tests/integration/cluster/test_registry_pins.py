"""Pins against the served base's GPU slots (max_loras) on a real redis-server.

A replica keeps at most max_loras - 1 pins (one slot must stay evictable), so the
registry refuses, atomically with the write, a pin that would bind max_loras adapters
on the replicas of some pool.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.records import ServedBase
from cluster.registry import AsyncRegistry, Registry
from lora_core.base_shape import BaseShape
from lora_core.errors import PinRefused
from tests.redis_fixture import dump_redis

SHAPE = BaseShape("LlamaForCausalLM", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate=128)  # fmt: skip
NAMES = ("a", "b", "c", "d")


@pytest.fixture
def reg(registry: Registry, adapters) -> Registry:
    for name in NAMES:
        registry.register_adapter(name, str(adapters["a"]))
    return registry


def serve_slots(reg: Registry, max_loras: int | None) -> None:
    reg.set_served(ServedBase("tiny", SHAPE, max_lora_rank=16, max_loras=max_loras))


def test_pin_that_fills_every_slot_is_refused_and_changes_nothing(reg: Registry, redis_url):
    serve_slots(reg, 2)
    reg.pin("a")
    before = dump_redis(redis_url)
    with pytest.raises(PinRefused) as err:
        reg.pin("b")
    assert str(err.value) == (
        "pinning 'b' would leave replicas no evictable GPU adapter slot: each has 2 slots "
        "(max_loras) and 1 pinned already (a); allowed: at most 1 pinned at a time "
        "(max_loras - 1, over all pools: mixed replicas take every pin); unpin one of them first"
    )
    assert dump_redis(redis_url) == before  # no pin, no version bump, no hint
    reg.pin("a")  # repeating a pin adds none: allowed
    reg.pin("a", "decode")  # so does moving it to another pool
    assert reg.desired_state().pins == {"a": "decode"}
    reg.unpin("a")
    reg.pin("b")
    assert reg.desired_state().pins == {"b": "all"}


def test_one_slot_allows_no_pin(reg: Registry):
    serve_slots(reg, 1)
    with pytest.raises(PinRefused, match="1 slots .* none pinned yet; allowed: at most 0 pinned"):
        reg.pin("a")
    assert reg.desired_state().pins == {}


def test_pins_of_every_pool_share_the_slots(reg: Registry):
    # prefill and decode pins both bind mixed replicas (records.pin_applies)
    serve_slots(reg, 3)
    reg.pin("a", "prefill")
    reg.pin("b", "decode")
    full = "3 slots .* 2 pinned already \\(a, b\\); allowed: at most 2"
    with pytest.raises(PinRefused, match=full):
        reg.pin("c", "prefill")
    serve_slots(reg, 4)  # a redeploy with more slots lifts the limit at once
    reg.pin("c", "all")
    assert reg.desired_state().pins == {"a": "prefill", "b": "decode", "c": "all"}


def test_without_a_published_slot_count_pins_are_not_checked(reg: Registry):
    for name in NAMES:  # no served base at all (a registry used standalone)
        reg.pin(name)
    for name in NAMES:
        reg.unpin(name)
    # a served record from before max_loras was published
    old = json.loads(ServedBase("tiny", SHAPE, max_lora_rank=16).to_json())
    del old["max_loras"]
    reg.client.set("t:served", json.dumps(old))
    assert reg.get_served() == ServedBase("tiny", SHAPE, max_lora_rank=16)
    for name in NAMES:
        reg.pin(name)
    assert len(reg.desired_state().pins) == len(NAMES)


def test_concurrent_pins_never_exceed_the_slots(reg: Registry):
    serve_slots(reg, 3)  # 2 pins at most

    def pin(name: str) -> bool:
        try:
            reg.pin(name)
            return True
        except PinRefused:
            return False

    with ThreadPoolExecutor(len(NAMES)) as pool:
        won = list(pool.map(pin, NAMES))
    assert sum(won) == 2
    assert sorted(reg.desired_state().pins) == [n for n, w in zip(NAMES, won, strict=True) if w]


def test_async_registry_refuses_too(reg: Registry, redis_url):
    serve_slots(reg, 2)

    async def scenario() -> None:
        areg = AsyncRegistry(redis_url, namespace="t")
        try:
            await areg.pin("a", "prefill")
            with pytest.raises(PinRefused, match="allowed: at most 1 pinned"):
                await areg.pin("b", "decode")
        finally:
            await areg.close()

    asyncio.run(scenario())

"""The ingress publishes the served base model again and again, so a Redis that restarted
empty (here: flushed) gets it back without restarting the cluster (real Redis, no Ray)."""

from __future__ import annotations

import asyncio

import redis

from cluster.records import ServedBase
from cluster.registry import AsyncRegistry
from lora_core.base_shape import BaseShape
from router.admin import keep_served_published
from tests.polling import wait_for_async


def test_a_flushed_registry_gets_the_served_base_back(redis_url):
    shape = BaseShape("LlamaForCausalLM", num_layers=2, hidden=64, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate=128)  # fmt: skip
    served = ServedBase("tiny", shape, max_lora_rank=16, max_loras=2)

    async def scenario() -> list[ServedBase | None]:
        reg = AsyncRegistry(redis_url)
        await reg.set_served(served)
        task = asyncio.create_task(keep_served_published(reg, served, every_s=0.05))
        seen = [await reg.get_served()]
        redis.Redis.from_url(redis_url).flushall()
        seen.append(await reg.get_served())
        seen.append(await wait_for_async(reg.get_served, 2, "the base published again", 0.02))
        task.cancel()
        await reg.close()
        return seen

    assert asyncio.run(scenario()) == [served, None, served]


def test_the_base_model_is_not_published_over_an_adapter_of_its_id(redis_url, tmp_path):
    """An adapter registered under the base model's id before any cluster published it
    would be shadowed (its requests answered by the base model): the ingress refuses to
    start, naming both ways out, and publishes nothing."""
    import pytest

    from cluster.registry import Registry
    from deploy.demo import ensure_demo
    from lora_core.errors import AdapterAlreadyExists
    from router.admin import publish_served

    demo = ensure_demo(tmp_path / "demo")
    served = ServedBase.from_model_dir("demo-base", str(demo.model_dir), 64, 2)
    sync = Registry(redis_url)
    sync.register_adapter("demo-base", str(demo.adapters["demo-poet"]), public=True)

    async def publish() -> ServedBase | None:
        reg = AsyncRegistry(redis_url)
        try:
            await publish_served(reg, served)
        finally:
            await reg.close()

    with pytest.raises(AdapterAlreadyExists) as e:
        asyncio.run(publish())
    assert "an adapter named 'demo-base' is registered" in str(e.value)
    assert "lorafleet adapters unregister demo-base" in str(e.value)
    assert sync.get_served() is None
    sync.unregister_adapter("demo-base")
    asyncio.run(publish())
    assert sync.get_served() == served
    sync.close()


def test_republishing_does_not_shadow_an_adapter_registered_meanwhile(redis_url, tmp_path, caplog):
    """Redis restarted empty, and an adapter was registered under the base model's id
    before the next round (nothing refused it: no served record): the round publishes
    nothing and logs an error naming the adapter, every round, instead of shadowing it."""
    import logging

    from cluster.registry import Registry
    from deploy.demo import ensure_demo

    demo = ensure_demo(tmp_path / "demo")
    served = ServedBase.from_model_dir("demo-base", str(demo.model_dir), 64, 2)
    sync = Registry(redis_url)
    sync.register_adapter("demo-base", str(demo.adapters["demo-poet"]))

    async def rounds() -> None:
        reg = AsyncRegistry(redis_url)
        task = asyncio.create_task(keep_served_published(reg, served, every_s=0.02))
        # a second refusal within 10 s: it goes on after the first
        await wait_for_async(lambda: len(caplog.records) >= 2, 10, "a second refusal", 0.02)
        task.cancel()
        await reg.close()

    with caplog.at_level(logging.ERROR, logger="lorafleet.router"):
        asyncio.run(rounds())
    assert sync.get_served() is None
    assert len(caplog.records) >= 2
    assert "an adapter named 'demo-base' is registered" in caplog.records[0].getMessage()
    sync.close()


def test_serve_run_refuses_a_shadowed_adapter_before_anything_starts(redis_url, tmp_path):
    """build_app's early check: one error before deploying, instead of a traceback for
    every ingress start Serve retries; an unreachable registry is left to the ingress."""
    import pytest

    from cluster.registry import Registry
    from deploy.builder import refuse_shadowed_adapter
    from deploy.demo import ensure_demo
    from lora_core.errors import AdapterAlreadyExists
    from tests.redis_fixture import free_port

    demo = ensure_demo(tmp_path / "demo")
    sync = Registry(redis_url, "ns")
    refuse_shadowed_adapter(redis_url, "ns", "demo-base")
    sync.register_adapter("demo-base", str(demo.adapters["demo-poet"]))
    refuse_shadowed_adapter(redis_url, "other-ns", "demo-base")
    with pytest.raises(AdapterAlreadyExists, match="lorafleet adapters unregister demo-base"):
        refuse_shadowed_adapter(redis_url, "ns", "demo-base")
    refuse_shadowed_adapter(f"redis://127.0.0.1:{free_port()}/0", "ns", "demo-base")
    sync.unregister_adapter("demo-base")
    refuse_shadowed_adapter(redis_url, "ns", "demo-base")
    sync.close()

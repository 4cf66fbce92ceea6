"""RegistryPublisher against a real redis-server: lease, residency, desired state, outages,
deregistration and reaping.

The engine is a stand-in (`publishers.StubEngine`) with 2 GPU slots, so each test
sets residency exactly.
"""

import asyncio
import logging

import pytest

from cluster.registry import Registry
from deploy.demo import ensure_demo
from lora_core.errors import AdapterNotFound
from tests.integration.cluster.timing import lapse
from tests.integration.serve.publishers import locations, setup
from tests.polling import wait_for_async
from tests.redis_fixture import start_redis

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo(tmp_path_factory.mktemp("demo"))


def test_registers_and_publishes_residency_changes(redis_url, demo):
    engine, pub, refs = setup(redis_url, demo)
    poet, chef = refs["demo-poet"], refs["demo-chef"]

    async def go():
        engine.gpu, engine.cpu = [poet.key], [poet.key, chef.key]
        await pub.tick()
        assert pub.epoch == 1
        assert locations(redis_url, "demo-poet") == [("rep1", "gpu")]
        assert locations(redis_url, "demo-chef") == [("rep1", "cpu")]
        engine.gpu, engine.cpu = [chef.key], [chef.key]
        await pub.tick()
        assert locations(redis_url, "demo-poet") == []
        assert locations(redis_url, "demo-chef") == [("rep1", "gpu")]
        await pub.deregister()
        assert locations(redis_url, "demo-chef") == []
        reg = Registry(redis_url)
        assert reg.list_replicas() == [] and reg.status().replicas_total == 0
        reg.close()

    asyncio.run(go())


def test_follows_pins_and_draining(redis_url, demo):
    engine, pub, refs = setup(redis_url, demo)
    reg = Registry(redis_url)

    async def go():
        await pub.tick()
        reg.pin("demo-poet")
        await pub.tick()
        assert ("load", "demo-poet", True) in engine.calls and ("pin", "demo-poet") in engine.calls
        assert locations(redis_url, "demo-poet") == []  # published on the next tick
        await pub.tick()
        assert locations(redis_url, "demo-poet") == [("rep1", "gpu")]
        reg.unpin("demo-poet")
        await pub.tick()
        assert ("unpin", "demo-poet") in engine.calls
        engine.cpu = [refs["demo-chef"].key]
        await pub.tick()
        assert reg.unregister_adapter("demo-chef") == "draining"  # rep1 still holds it
        await pub.tick()
        assert ("unload", "demo-chef") in engine.calls

    asyncio.run(go())
    reg.close()


def test_replaced_version_is_known_newest(redis_url, demo):
    engine, pub, refs = setup(redis_url, demo)
    reg = Registry(redis_url)
    reg.register_adapter("demo-poet", str(demo.adapters["demo-coder"]), public=True, replace=True)
    reg.warm("demo-poet", 1)

    async def go():
        await pub.tick()
        assert pub.newest_version["demo-poet"] == 2
        assert ("load", "demo-poet", True) in engine.calls  # warm target, nobody holds it

    asyncio.run(go())
    reg.close()


def test_survives_a_redis_outage_and_re_registers(tmp_path, demo):
    url, stop = start_redis(tmp_path / "r1")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    engine, pub, refs = setup(url, demo, names=("demo-poet",))
    engine.gpu = engine.cpu = [refs["demo-poet"].key]

    stops = [stop]

    async def go():
        task = asyncio.create_task(pub.run())
        try:
            await asyncio.sleep(0.5)
            assert pub.healthy_registry and pub.epoch == 1
            stop()
            await asyncio.sleep(0.8)
            assert not pub.healthy_registry and not task.done()
            url2, stop2 = start_redis(tmp_path / "r2", port=port)
            stops.append(stop2)
            # A fresh Redis lost everything: the adapter must be registered again.
            reg = Registry(url2)
            reg.register_adapter("demo-poet", str(demo.adapters["demo-poet"]), public=True)
            reg.close()
            await wait_for_async(
                lambda: locations(url2, "demo-poet"), 6, "demo-poet published again", 0.1
            )
            assert pub.healthy_registry and pub.epoch == 1  # new Redis: epochs start over
            assert locations(url2, "demo-poet") == [("rep1", "gpu")]
        finally:
            task.cancel()

    try:
        asyncio.run(go())
    finally:  # a failed assertion must not leave a redis-server behind
        for stop_one in stops:
            stop_one()


def test_impossible_pin_blocks_neither_unload_nor_warm(redis_url, demo, caplog):
    names = ("demo-poet", "demo-coder", "demo-chef", "gone")
    engine, pub, refs = setup(redis_url, demo, names=names)
    reg = Registry(redis_url)  # standalone: no served max_loras, so the registry takes both pins

    async def go():
        engine.cpu = [refs["gone"].key]
        await pub.tick()
        reg.pin("demo-coder")
        reg.pin("demo-poet")  # with 2 slots this replica can keep one pin only
        reg.warm("demo-chef", 1)
        assert reg.unregister_adapter("gone") == "draining"
        with caplog.at_level(logging.WARNING, logger="lorafleet.replica"):
            await pub.tick()
            assert ("pin", "demo-coder") in engine.calls
            assert ("pin refused", "demo-poet") in engine.calls
            assert ("load", "demo-chef", True) in engine.calls  # the warm target applied
            assert ("unload", "gone") in engine.calls  # and the unload too
            await pub.tick()  # publishes that "gone" left: its unregistering finishes
            with pytest.raises(AdapterNotFound):
                reg.get_adapter("gone")
            version = reg.desired_state().version  # bumped by that removal
            for _ in range(3):
                await pub.tick()
        assert pub.desired.version < version  # still "not applied": retried every tick
        refusals = [r.getMessage() for r in caplog.records if "demo-poet" in r.getMessage()]
        # once per desired-state version (the one pinned, then the one after the removal)
        assert [m.split(" not applied")[0] for m in refusals] == [
            f"desired state {version - 1}",
            f"desired state {version}",
        ]
        assert refusals[1].endswith(
            "not applied yet: pin 'demo-poet': pinning "
            f"'{refs['demo-poet'].key}' would pin every one of the 2 slots"
        )

    asyncio.run(go())
    reg.close()


def test_unpins_before_pins_so_a_legal_pin_set_applies(redis_url, demo):
    engine, pub, refs = setup(redis_url, demo)
    reg = Registry(redis_url)

    async def go():
        await pub.tick()
        reg.pin("demo-chef")
        await pub.tick()
        reg.pin("demo-poet")
        await pub.tick()
        assert engine.pinned == ["demo-chef"] and ("pin refused", "demo-poet") in engine.calls
        reg.unpin("demo-chef")  # the registry now holds demo-poet's pin only: it must apply
        del engine.calls[:]
        await pub.tick()
        assert engine.calls[:2] == [("unpin", "demo-chef"), ("load", "demo-poet", True)]
        assert engine.calls[2] == ("pin", "demo-poet") and engine.pinned == ["demo-poet"]
        assert pub.desired.version == reg.desired_state().version

    asyncio.run(go())
    reg.close()


def test_a_lapsed_replica_is_reaped_by_a_live_replicas_publisher(redis_url, demo):
    engine, pub, refs = setup(redis_url, demo, reap_every=2)
    reg = Registry(redis_url)
    crashed = reg.register_replica("crashed", "mixed", "LoraReplica", 2, 30.0)
    reg.report_resident("crashed", crashed, refs["demo-chef"], "gpu")
    assert reg.unregister_adapter("demo-chef") == "draining"  # only "crashed" holds it

    async def go():
        await pub.tick()  # tick 1: no reap yet
        lapse(reg, "crashed")
        assert [r.replica_id for r in reg.list_replicas()] == ["crashed", "rep1"]
        await pub.tick()  # tick 2 reaps, no operator involved
        assert [r.replica_id for r in reg.list_replicas()] == ["rep1"]
        assert reg.list_adapter_names() == ["demo-poet"]  # the drained adapter finished
        await pub.tick()
        await pub.tick()  # reaping again finds nothing and fails nothing
        assert [r.replica_id for r in reg.list_replicas()] == ["rep1"]

    asyncio.run(go())
    reg.close()


def test_a_warm_copy_evicted_after_the_target_was_met_is_loaded_again(redis_url, demo):
    """`warm` keeps N copies: LRU eviction after the desired state was applied (the
    version is unchanged) must not leave the target unmet for good."""
    engine, pub, refs = setup(redis_url, demo, names=("demo-chef",), replica="warm1")
    reg = Registry(redis_url)

    async def go():
        reg.warm("demo-chef", 1)
        await pub.tick()
        assert engine.calls == [("load", "demo-chef", True)]
        await pub.tick()  # published: the target is met, nothing more to load
        assert engine.calls == [("load", "demo-chef", True)]
        engine.gpu.remove(refs["demo-chef"].key)  # evicted by traffic for other adapters
        await pub.tick()  # publishes the eviction: the registry has no GPU copy now
        await pub.tick()
        assert engine.calls == [("load", "demo-chef", True)] * 2
        assert engine.gpu == [refs["demo-chef"].key]

    asyncio.run(go())
    reg.warm("demo-chef", 0)
    reg.close()


def test_a_stale_copy_numbered_like_the_current_version_leaves_its_residency(redis_url, demo):
    """After Redis restarts empty, numbering starts over: demo-poet v1 (new weights) is
    pinned on a replica that still caches the old v1. Evicting the old copy must not drop
    the new copy's residency (routing and `adapters list` would lose a pinned holder)."""
    import redis

    engine, pub, refs = setup(redis_url, demo, names=("demo-poet",), replica="stale1")
    old = refs["demo-poet"]

    async def go():
        engine.cpu = [old.key]
        await pub.tick()
        client = redis.Redis.from_url(redis_url)
        client.flushall()  # Redis restarted empty
        client.close()
        reg = Registry(redis_url)
        new = reg.register_adapter("demo-poet", str(demo.adapters["demo-chef"]), public=True).ref
        reg.close()
        assert (new.version, new.key != old.key) == (old.version, True)
        pub.refs[new.key] = new
        engine.gpu, engine.cpu = [new.key], [old.key, new.key]
        await pub.tick()  # registers again, reports both (the stale one is ignored)
        await pub.tick()
        assert locations(redis_url, "demo-poet") == [("stale1", "gpu")]
        engine.cpu = [new.key]  # the stale copy is evicted from the CPU cache
        await pub.tick()
        assert locations(redis_url, "demo-poet") == [("stale1", "gpu")]

    asyncio.run(go())


def test_the_lease_outlives_a_tick_that_waits_for_a_slow_load(redis_url, demo):
    """A pin whose load takes 2.5 leases: the keep-alive renews the lease meanwhile, so the
    replica stays live (routable) under its first epoch. Before, the tick renewed only
    at its start, the lease lapsed during the load and the replica left routing."""
    engine, pub, refs = setup(redis_url, demo)
    reg = Registry(redis_url)
    stub_load = engine.load_adapter

    async def slow_load(ref, to_gpu=False):
        await asyncio.sleep(2.5 * pub.config.lease_ttl_s)
        await stub_load(ref, to_gpu)

    engine.load_adapter = slow_load

    async def go():
        await pub.tick()
        reg.pin("demo-poet")
        run = asyncio.create_task(pub.run())
        try:
            for _ in range(4):  # within the load, past the lease
                await asyncio.sleep(0.5 * pub.config.lease_ttl_s)
                assert [(r.replica_id, r.live) for r in reg.list_replicas()] == [("rep1", True)]
            await wait_for_async(
                lambda: ("pin", "demo-poet") in engine.calls, 30, "the slow load's pin"
            )
            assert pub.epoch == 1  # never registered again
        finally:
            run.cancel()

    asyncio.run(go())
    reg.close()

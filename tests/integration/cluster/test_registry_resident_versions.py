"""A replica holding two versions of one adapter (the old one still cached after a
replace) must keep the current version routable: reports of the old copy neither hide
the new one, nor does dropping the old copy drop the new one's location."""

from __future__ import annotations

import asyncio

from cluster.records import Location
from cluster.registry import AsyncRegistry, Registry
from replica.outputs import EngineStats
from replica.serve_registry import PublisherConfig, RegistryPublisher


def test_old_version_reports_do_not_hide_the_new_one(registry: Registry, adapters):
    v1 = registry.register_adapter("foo", str(adapters["a"])).ref
    epoch = registry.register_replica("r1", "mixed", "d", 4, 30.0)
    registry.report_resident("r1", epoch, v1, "gpu")
    v2 = registry.register_adapter("foo", str(adapters["b"]), replace=True).ref
    registry.report_resident("r1", epoch, v2, "gpu")
    here = (Location("r1", "gpu", "mixed"),)
    assert registry.locations("foo") == here
    # the old copy moves to the CPU cache: the replica reports it again
    registry.report_resident("r1", epoch, v1, "cpu")
    assert registry.locations("foo") == here
    assert [(r.gpu_adapters, r.cpu_adapters) for r in registry.list_replicas()] == [(1, 0)]
    # the old copy leaves: the new one stays where it is
    assert registry.remove_resident("r1", epoch, v1) is False
    assert registry.remove_resident("r1", epoch, v1.key) is False
    assert registry.locations("foo") == here
    assert registry.remove_resident("r1", epoch, v2.key) is True
    assert registry.locations("foo") == ()


class _Engine:
    """Just the residency a publisher reads; nothing is pinned, warmed or drained."""

    def __init__(self) -> None:
        self.gpu: tuple[str, ...] = ()

    def stats(self) -> EngineStats:
        return EngineStats(self.gpu, (), (), 4 - len(self.gpu), 4, 0, 0, 0.0, 0, 0, 0)


def test_publisher_evicting_the_old_copy_keeps_the_new_one(registry: Registry, redis_url, adapters):
    v1 = registry.register_adapter("foo", str(adapters["a"])).ref

    async def scenario() -> tuple[Location, ...]:
        areg = AsyncRegistry(redis_url, namespace="t")
        engine = _Engine()
        pub = RegistryPublisher(PublisherConfig("r1", "d"), areg, engine, {v1.key: v1})
        engine.gpu = (v1.key,)
        await pub.tick()
        v2 = await asyncio.to_thread(
            registry.register_adapter, "foo", str(adapters["b"]), replace=True
        )
        pub.refs[v2.ref.key] = v2.ref
        engine.gpu = (v1.key, v2.ref.key)  # the new version loaded beside the old one
        await pub.tick()
        engine.gpu = (v2.ref.key,)  # the old one evicted
        await pub.tick()
        await pub.tick()
        locations = await areg.locations("foo")
        await areg.close()
        return locations

    assert asyncio.run(scenario()) == (Location("r1", "gpu", "mixed"),)


def test_publisher_keeps_ticking_when_a_held_adapter_left_the_catalog(
    registry: Registry, redis_url, adapters
):
    """An adapter the catalog lost while a replica holds it (a Redis restarted empty, or
    finalized while the replica was loading it) must not stop the replica's ticks: pins,
    warm targets and drains must still be followed, and live adapters still published."""
    ghost = registry.register_adapter("ghost", str(adapters["a"])).ref
    pinned = registry.register_adapter("p", str(adapters["b"])).ref
    assert registry.unregister_adapter("ghost") == "removed"
    registry.pin("p")

    class Engine(_Engine):
        def __init__(self) -> None:
            super().__init__()
            self.pins: list[str] = []

        async def load_adapter(self, ref, to_gpu: bool = False) -> None:
            self.gpu = (*self.gpu, ref.key)

        def pin(self, ref) -> None:
            self.pins.append(ref.key)

    async def scenario() -> tuple[list[str], tuple[Location, ...]]:
        areg = AsyncRegistry(redis_url, namespace="t")
        engine = Engine()
        engine.gpu = (ghost.key,)
        refs = {ghost.key: ghost, pinned.key: pinned}
        pub = RegistryPublisher(PublisherConfig("r1", "d"), areg, engine, refs)
        await pub.tick()  # publishes what it can, then follows the pin
        await pub.tick()  # publishes the pinned adapter it loaded
        locations = await areg.locations("p")
        await areg.close()
        return engine.pins, locations

    pins, locations = asyncio.run(scenario())
    assert pins == [pinned.key]
    assert locations == (Location("r1", "gpu", "mixed"),)


def test_a_copy_with_other_content_under_the_current_version_is_not_a_location(
    registry: Registry, adapters
):
    """After Redis restarts empty, version numbers start over: a replica's copy of the old
    "foo@1" (other weights) must not be routed to as the new "foo@1"."""
    old = registry.register_adapter("foo", str(adapters["a"])).ref
    registry.client.flushdb()  # what an empty restart leaves
    new = registry.register_adapter("foo", str(adapters["b"])).ref
    assert (old.version, new.version) == (1, 1) and old.key != new.key
    epoch = registry.register_replica("r1", "mixed", "d", 4, 30.0)
    registry.report_resident("r1", epoch, old, "gpu")
    registry.report_resident("r1", epoch, old.key, "gpu")
    assert registry.locations("foo") == ()
    registry.report_resident("r1", epoch, new.key, "cpu")
    assert registry.locations("foo") == (Location("r1", "cpu", "mixed"),)
    registry.report_resident("r1", epoch, ("foo", 1), "gpu")  # no hash: trusted
    assert registry.locations("foo") == (Location("r1", "gpu", "mixed"),)

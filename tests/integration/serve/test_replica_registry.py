"""RegistryPublisher against a real redis-server: lease, residency, desired state, outages.

The engine is a stand-in exposing only what the publisher reads (stats) and calls
(load/pin/unpin/unload), so each test sets residency exactly.
"""

import asyncio

import pytest

from cluster.client import RetryPolicy
from cluster.registry import AsyncRegistry, Registry
from deploy.demo import ensure_demo
from replica.outputs import EngineStats
from replica.serve_registry import PublisherConfig, RegistryPublisher
from tests.redis_fixture import start_redis

pytestmark = pytest.mark.integration
FAST = RetryPolicy(retries=0, connect_timeout_s=0.2, socket_timeout_s=0.5)


class StubEngine:
    def __init__(self):
        self.gpu: list[str] = []
        self.cpu: list[str] = []
        self.calls: list[tuple] = []

    def stats(self) -> EngineStats:
        return EngineStats(
            tuple(self.gpu), tuple(self.cpu), (), 2 - len(self.gpu), 2, 0, 0, 0.0, 0, 0, 0
        )

    async def load_adapter(self, ref, to_gpu=False):
        self.calls.append(("load", ref.name, to_gpu))
        if to_gpu and ref.key not in self.gpu:
            self.gpu.append(ref.key)

    def pin(self, ref):
        self.calls.append(("pin", ref.name))

    def unpin(self, name):
        self.calls.append(("unpin", name))

    async def unload_adapter(self, name):
        self.calls.append(("unload", name))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo(tmp_path_factory.mktemp("demo"))


def setup(url, demo, names=("demo-poet", "demo-chef")):
    reg = Registry(url)
    refs = {n: reg.register_adapter(n, str(demo.adapters[n]), public=True).ref for n in names}
    reg.close()
    engine = StubEngine()
    areg = AsyncRegistry(url, retry=FAST)
    pub = RegistryPublisher(
        PublisherConfig("rep1", "LoraReplica", tick_s=0.05, lease_ttl_s=1.0), areg, engine, {}
    )
    for ref in refs.values():
        pub.refs[ref.key] = ref
    return engine, pub, refs


def locations(url, name):
    reg = Registry(url)
    try:
        return [(loc.replica, loc.tier) for loc in reg.locations(name)]
    finally:
        reg.close()


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

    async def go():
        task = asyncio.create_task(pub.run())
        await asyncio.sleep(0.5)
        assert pub.healthy_registry and pub.epoch == 1
        stop()
        await asyncio.sleep(0.8)
        assert not pub.healthy_registry and not task.done()
        url2, stop2 = start_redis(tmp_path / "r2", port=port)
        # A fresh Redis lost everything: the adapter must be registered again.
        reg = Registry(url2)
        reg.register_adapter("demo-poet", str(demo.adapters["demo-poet"]), public=True)
        reg.close()
        for _ in range(60):
            await asyncio.sleep(0.1)
            if locations(url2, "demo-poet"):
                break
        assert pub.healthy_registry and pub.epoch == 1  # new Redis: epochs start over
        assert locations(url2, "demo-poet") == [("rep1", "gpu")]
        task.cancel()
        stop2()

    asyncio.run(go())

"""Publishers of several replicas against one real redis-server: the autoscaling adapter
share (an adapter active on 2 replicas counts half on each), warm targets met by claims
(publishers ticking at once never load past a target), and a new replica's head start
(its first tick loads the adapter with the most requests in flight per copy, and
replicas starting together spread over the hot adapters).

Engines are `publishers.StubEngine`s; each test sets the requests in flight directly."""

from __future__ import annotations

import asyncio

import pytest

from cluster.registry import Registry
from deploy.demo import ensure_demo
from tests.integration.serve.publishers import locations, publisher, register
from tests.polling import wait_for_async

pytestmark = pytest.mark.integration
FLEET = 6


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo(tmp_path_factory.mktemp("demo"))


def fleet(url, refs, n: int):
    """Publishers of n replicas already serving (no first-tick head start)."""
    return [publisher(url, refs, replica=f"rep{i}", prefetch=False) for i in range(n)]


def test_an_adapter_active_on_two_replicas_counts_half_on_each(redis_url, demo):
    refs = register(redis_url, demo)
    (e1, p1), (e2, p2) = fleet(redis_url, refs, 2)
    # demo-poet's requests run on both replicas; demo-chef's on rep0 only. rep1 also
    # holds demo-chef in a GPU slot, idle: residency alone is no demand.
    e2.gpu = [refs["demo-chef"].key]
    for _ in range(3):
        p1.in_flight.start("demo-poet")
    p1.in_flight.start("demo-chef")
    p2.in_flight.start("demo-poet")

    async def go():
        await p1.tick()
        assert p1.adapter_share == 2.0  # rep1 has not reported yet
        await p2.tick()
        await p1.tick()
        assert (p1.adapter_share, p2.adapter_share) == (1.5, 0.5)  # 2 distinct adapters
        p2.in_flight.done("demo-poet")
        await p2.tick()
        await p1.tick()
        assert (p1.adapter_share, p2.adapter_share) == (2.0, 0.0)
        await p2.deregister()
        p2.in_flight.start("demo-chef")
        p2.epoch = None
        await p2.tick()  # registers again, then reports
        await p1.tick()
        assert (p1.adapter_share, p2.adapter_share) == (1.5, 0.5)

    asyncio.run(go())
    assert locations(redis_url, "demo-chef") == [("rep1", "gpu")]


def test_an_outage_drops_the_share_so_the_metric_falls_back(redis_url, demo):
    refs = register(redis_url, demo, names=("demo-poet",))
    ((_, pub),) = fleet(redis_url, refs, 1)
    pub.in_flight.start("demo-poet")

    async def go():
        task = asyncio.create_task(pub.run())
        await wait_for_async(lambda: pub.adapter_share == 1.0, 2, "an adapter share of 1")
        reg = Registry(redis_url)
        # Redis stops answering: for 3 s, so that a tick late by a stall still meets it
        # and times out (0.5 s), ending the pause once it did
        reg.client.execute_command("CLIENT", "PAUSE", 3000, "WRITE")  # scripts included
        try:
            # bounded within the pause: once it ends, a tick reports the share again
            await wait_for_async(lambda: pub.adapter_share is None, 2, "the share dropped")
        finally:
            reg.client.execute_command("CLIENT", "UNPAUSE")
            reg.close()
        task.cancel()
        assert pub.adapter_share is None

    asyncio.run(go())


def test_publishers_ticking_at_once_never_load_past_a_warm_target(redis_url, demo):
    refs = register(redis_url, demo)
    pubs = fleet(redis_url, refs, FLEET)
    reg = Registry(redis_url)
    reg.warm("demo-poet", 2)
    reg.warm("demo-chef", 1, "decode")  # mixed replicas take decode targets too

    async def go():
        for _ in range(5):
            await asyncio.gather(*(pub.tick() for _, pub in pubs))
        loads = [call[1] for engine, _ in pubs for call in engine.calls]
        assert sorted(loads) == ["demo-chef", "demo-poet", "demo-poet"]
        assert len(locations(redis_url, "demo-poet")) == 2
        # a copy evicted by traffic: exactly one replica loads one again
        evicted = next(e for e, _ in pubs if refs["demo-poet"].key in e.gpu)
        evicted.gpu.remove(refs["demo-poet"].key)
        for _ in range(4):
            await asyncio.gather(*(pub.tick() for _, pub in pubs))
        loads = [call[1] for engine, _ in pubs for call in engine.calls]
        assert loads.count("demo-poet") == 3 and len(locations(redis_url, "demo-poet")) == 2

    asyncio.run(go())
    reg.close()


def test_a_new_replica_loads_the_hottest_adapter_on_its_first_tick(redis_url, demo):
    refs = register(redis_url, demo, names=("demo-poet", "demo-chef", "demo-coder"))
    (_, p0), (_, p1) = fleet(redis_url, refs, 2)
    for _ in range(6):
        p0.in_flight.start("demo-poet")  # 6 in flight on 1 copy
    for _ in range(4):
        p0.in_flight.start("demo-chef")
        p1.in_flight.start("demo-chef")  # 8 on 2 copies
    p1.in_flight.start("demo-coder")

    async def go():
        await asyncio.gather(p0.tick(), p1.tick())
        engine, new = publisher(redis_url, refs, replica="new")
        await new.tick()
        # 2 slots: one for the hottest per copy, one left free for whatever comes next
        assert engine.calls == [("load", "demo-poet", True)]
        assert locations(redis_url, "demo-poet") == [("new", "gpu")]  # routable at once
        await new.tick()
        assert engine.calls == [("load", "demo-poet", True)]  # a head start, once
        off_engine, off = publisher(redis_url, refs, replica="off", prefetch=False)
        await off.tick()
        assert off_engine.calls == []

    asyncio.run(go())


def test_new_replicas_starting_together_prefetch_different_adapters(redis_url, demo):
    """demo-poet 6 in flight on 1 copy, demo-chef 4 on 1: the first starter's claim on
    demo-poet makes it 6 / 2 = 3 per copy for the second, which loads demo-chef (4)."""
    refs = register(redis_url, demo)
    (_, p0), (_, p1) = fleet(redis_url, refs, 2)
    for _ in range(6):
        p0.in_flight.start("demo-poet")
    for _ in range(4):
        p1.in_flight.start("demo-chef")
    starters = [publisher(redis_url, refs, replica=f"new{i}") for i in range(2)]

    async def go():
        await asyncio.gather(p0.tick(), p1.tick())
        await asyncio.gather(*(pub.tick() for _, pub in starters))

    asyncio.run(go())
    loads = sorted(call[1] for engine, _ in starters for call in engine.calls)
    assert loads == ["demo-chef", "demo-poet"]

"""Replicas leaving the registry on a real redis-server: deregister (graceful) and reap
(lapsed leases), including reaps racing each other and a deregistration."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.registry import AsyncRegistry, Registry
from lora_core.errors import AdapterNotFound, StaleEpoch
from tests.integration.cluster.timing import lapse
from tests.redis_fixture import dump_redis


@pytest.fixture
def reg(registry: Registry, adapters) -> Registry:
    registry.register_adapter("a", str(adapters["a"]))
    registry.register_adapter("b", str(adapters["b"]))
    return registry


def _keys_naming(reg: Registry, replica_id: str) -> list[str]:
    return sorted(k for k in reg.client.scan_iter("t:*") if replica_id in k)


def test_deregister_removes_the_whole_record(reg: Registry):
    e1 = reg.register_replica("r1", "mixed", "d", 2, 30.0)
    e2 = reg.register_replica("r2", "decode", "d", 2, 30.0)
    reg.report_resident("r1", e1, ("a", 1), "gpu")
    reg.report_resident("r1", e1, ("b", 1), "cpu")
    reg.report_resident("r2", e2, ("a", 1), "gpu")
    assert reg.unregister_adapter("b") == "draining"  # only r1 holds it
    assert reg.deregister_replica("r1", e1) is True
    assert [r.replica_id for r in reg.list_replicas()] == ["r2"]
    st = reg.status()
    assert (st.replicas_total, st.replicas_live["mixed"]) == (1, 0)
    assert [loc.replica for loc in reg.locations("a")] == ["r2"]
    with pytest.raises(AdapterNotFound):  # r1 was its last holder: unregistering finished
        reg.get_adapter("b")
    # only the fencing counter survives, so the id never gets an old epoch again
    assert _keys_naming(reg, "r1") == ["t:epoch:r1"]
    with pytest.raises(StaleEpoch, match="lapsed"):
        reg.report_resident("r1", e1, ("a", 1), "gpu")
    assert reg.register_replica("r1", "mixed", "d", 2, 30.0) == e1 + 1


def test_deregister_by_an_old_incarnation_removes_nothing(reg: Registry, redis_url):
    old = reg.register_replica("r1", "mixed", "d", 2, 30.0)
    new = reg.register_replica("r1", "mixed", "d", 2, 30.0)
    reg.report_resident("r1", new, ("a", 1), "gpu")
    before = dump_redis(redis_url)
    assert reg.deregister_replica("r1", old) is False
    assert dump_redis(redis_url) == before
    assert reg.deregister_replica("r1", new) is True
    assert reg.deregister_replica("r1", new) is True  # again: nothing left, no error
    assert reg.list_replicas() == []


def test_deregister_after_the_lease_lapsed_still_removes_the_row(reg: Registry):
    e = reg.register_replica("r1", "mixed", "d", 2, 30.0)
    reg.report_resident("r1", e, ("a", 1), "gpu")
    lapse(reg, "r1")
    assert reg.deregister_replica("r1", e) is True
    assert reg.list_replicas() == [] and _keys_naming(reg, "r1") == ["t:epoch:r1"]


def test_concurrent_reaps_and_deregisters_agree(reg: Registry, redis_url):
    lapsed = [f"dead{i}" for i in range(20)]
    for rid in lapsed:
        e = reg.register_replica(rid, "mixed", "d", 2, 30.0)
        reg.report_resident(rid, e, ("a", 1), "gpu")
    live = {f"live{i}": reg.register_replica(f"live{i}", "mixed", "d", 2, 30.0) for i in range(5)}
    assert reg.unregister_adapter("a") == "draining"
    for rid in lapsed:
        lapse(reg, rid)

    async def scenario() -> list[tuple[int, int]]:
        areg = AsyncRegistry(redis_url, namespace="t")
        try:
            reaps = [areg.reap() for _ in range(10)]
            goodbyes = [areg.deregister_replica(rid, e) for rid, e in live.items()]
            return (await asyncio.gather(*reaps, *goodbyes))[:10]
        finally:
            await areg.close()

    with ThreadPoolExecutor(10) as pool:  # 10 sync reaps race 10 async ones and 5 goodbyes
        by_threads = [pool.submit(reg.reap) for _ in range(10)]
        got = asyncio.run(scenario()) + [f.result() for f in by_threads]
    # every lapsed replica and the drained adapter were removed exactly once
    assert sum(r for r, _ in got) == len(lapsed)
    assert sum(a for _, a in got) == 1
    assert reg.list_replicas() == []
    assert reg.list_adapter_names() == ["b"]
    assert reg.reap() == (0, 0)

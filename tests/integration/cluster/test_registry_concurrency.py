"""50 concurrent writers (threads and asyncio tasks) end in one consistent state."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from cluster.records import Location
from cluster.registry import AsyncRegistry, Registry

WRITERS = 50


def test_threads_register_pin_and_report(registry: Registry, adapters):
    registry.register_adapter("shared", str(adapters["a"]))
    registry.pin("shared")
    registry.unpin("shared")
    start = registry.desired_state().version  # the counter starts at the clock (ms)

    def writer(i: int) -> tuple[int, int]:
        rec = registry.register_adapter(f"own{i}", str(adapters["small"]))
        epoch = registry.register_replica(
            f"r{i}", ("prefill", "decode", "mixed")[i % 3], "d", 4, 30.0
        )
        registry.report_resident(f"r{i}", epoch, ("shared", 1), "gpu" if i % 2 else "cpu")
        registry.report_resident(f"r{i}", epoch, rec.ref, "gpu")
        registry.pin(f"own{i}", "all")
        if i % 2:
            registry.unpin(f"own{i}")
        replaced = registry.register_adapter("hot", str(adapters["b"]), replace=True)
        return epoch, replaced.version

    with ThreadPoolExecutor(WRITERS) as pool:
        results = list(pool.map(writer, range(WRITERS)))

    assert [e for e, _ in results] == [1] * WRITERS
    # every replace got a distinct version: no lost update
    assert sorted(v for _, v in results) == list(range(1, WRITERS + 1))
    assert registry.get_adapter("hot").version == WRITERS
    shared = registry.locations("shared")
    assert len(shared) == WRITERS
    assert {loc.replica for loc in shared} == {f"r{i}" for i in range(WRITERS)}
    assert sum(loc.tier == "gpu" for loc in shared) == WRITERS // 2
    for i in (0, 17, 49):
        pool_name = ("prefill", "decode", "mixed")[i % 3]
        assert registry.locations(f"own{i}") == (Location(f"r{i}", "gpu", pool_name),)
    state = registry.desired_state()
    assert state.pins == {f"own{i}": "all" for i in range(0, WRITERS, 2)}
    # 50 pins + 25 unpins + 49 replaces each bumped the desired-state version once
    assert state.version - start == WRITERS + WRITERS // 2 + WRITERS - 1
    st = registry.status()
    assert (st.adapters, st.replicas_total, st.pins) == (WRITERS + 2, WRITERS, WRITERS // 2)
    assert sum(r.gpu_adapters + r.cpu_adapters for r in registry.list_replicas()) == 2 * WRITERS


def test_asyncio_tasks_report_and_remove(registry: Registry, redis_url, adapters):
    registry.register_adapter("x", str(adapters["a"]))
    registry.warm("x", 0)
    registry.warm("x", 1)
    start = registry.desired_state().version  # the counter starts at the clock (ms)

    async def scenario() -> None:
        reg = AsyncRegistry(redis_url, namespace="t")

        async def writer(i: int) -> None:
            epoch = await reg.register_replica(f"r{i}", "mixed", "d", 4, 30.0)
            await reg.report_resident(f"r{i}", epoch, ("x", 1), "gpu")
            await reg.warm("x", i + 1, "decode")
            if i % 5 == 0:
                assert await reg.remove_resident(f"r{i}", epoch, "x") is True

        await asyncio.gather(*(writer(i) for i in range(WRITERS)))
        locs = await reg.locations("x")
        assert {loc.replica for loc in locs} == {f"r{i}" for i in range(WRITERS) if i % 5}
        state = await reg.desired_state()
        assert state.warm["x"].pool == "decode"
        assert 1 <= state.warm["x"].replicas <= WRITERS
        assert state.version - start == WRITERS
        await reg.close()

    asyncio.run(scenario())


def test_many_more_concurrent_commands_than_connections_all_succeed(registry: Registry, redis_url):
    """An ingress resolves one key per request: 400 resolutions at once on one asyncio
    client all answer (the pool waits for a free connection; redis-py's default pool
    refused every command beyond its 100th connection with "Too many connections", a
    503 registry_unavailable while Redis was healthy), over at most 64 connections."""
    from cluster.client import ASYNC_MAX_CONNECTIONS

    registry.create_tenant("acme")
    key = registry.issue_api_key("acme")

    async def go() -> tuple[list[str | None], int]:
        reg = AsyncRegistry(redis_url, namespace="t")
        try:
            got = await asyncio.gather(*(reg.resolve_key(key) for _ in range(400)))
            pool = reg.client.connection_pool
            opened = len(pool._available_connections) + len(pool._in_use_connections)
        finally:
            await reg.close()
        return got, opened

    got, opened = asyncio.run(go())
    assert got == ["acme"] * 400
    assert opened <= ASYNC_MAX_CONNECTIONS

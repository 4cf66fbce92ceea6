"""A new replica's head start (pure: fake registry and engine): how many free GPU slots
its first tick fills with the fleet's hottest adapters, once. The ranking itself runs in
Redis (tests/integration/cluster/test_registry_demand.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from lora_core.errors import AdapterVersionUnavailable, CapacityExceeded
from lora_core.identity import AdapterRef
from replica.outputs import EngineStats
from replica.serve_protocol import check_version
from replica.serve_registry import PublisherConfig, RegistryPublisher


def ref(name: str) -> AdapterRef:
    return AdapterRef(name, 1, "ab" * 32, f"/adapters/{name}", 8, "base")


@dataclass(frozen=True)
class Hot:
    ref: AdapterRef
    per_copy: float


class FakeRegistry:
    def __init__(self, names: list[str]):
        self.hot = [Hot(ref(n), 5.0) for n in names]
        self.limits: list[int] = []

    async def hot_adapters(
        self, replica_id: str, epoch: int, limit: int, claim_s: float
    ) -> list[Hot]:
        self.limits.append(limit)
        return self.hot[:limit]


class FakeEngine:
    def __init__(self, free: int, refuse: frozenset[str] = frozenset()):
        self.free, self.refuse = free, refuse
        self.loads: list[str] = []

    def stats(self) -> EngineStats:
        return EngineStats((), (), (), self.free, 4, 0, 0, 0.0, 0, 0, 0)

    async def load_adapter(self, ref: AdapterRef, to_gpu: bool = False) -> None:
        if ref.name in self.refuse:
            raise CapacityExceeded(f"{ref.name}: every GPU slot is busy with running requests")
        self.loads.append(ref.name)


def publisher(reg: FakeRegistry, engine: FakeEngine, prefetch: bool = True) -> RegistryPublisher:
    return RegistryPublisher(PublisherConfig("new", "d", prefetch=prefetch), reg, engine, {})


@pytest.mark.parametrize(
    ("free", "limit", "loads"),
    [
        (0, None, []),  # no free slot: no round trip
        (1, 1, ["a"]),  # the only slot: a head start beats an idle slot
        (2, 1, ["a"]),  # otherwise one slot stays free for whatever comes next
        (4, 3, ["a", "b", "c"]),
    ],
)
def test_fills_all_but_one_free_slot_once(free: int, limit: int | None, loads: list[str]):
    reg, engine = FakeRegistry(["a", "b", "c", "d"]), FakeEngine(free)
    pub = publisher(reg, engine)
    for _ in range(3):
        asyncio.run(pub.desired.prefetch_once(1))
    assert reg.limits == ([] if limit is None else [limit])
    assert engine.loads == loads
    assert all(ref(n).key in pub.refs for n in loads)  # published like any copy


def test_a_refused_load_does_not_stop_the_others():
    reg, engine = FakeRegistry(["a", "b", "c"]), FakeEngine(4, refuse=frozenset({"a"}))
    asyncio.run(publisher(reg, engine).desired.prefetch_once(1))
    assert engine.loads == ["b", "c"]


def test_off_means_no_round_trip():
    reg, engine = FakeRegistry(["a"]), FakeEngine(4)
    asyncio.run(publisher(reg, engine, prefetch=False).desired.prefetch_once(1))
    assert (reg.limits, engine.loads) == ([], [])


def test_a_prefetched_version_is_the_newest_this_replica_knows():
    """A request resolved before a replace names the old version: once prefetch loaded
    the registry's current one, check_version refuses the old (re-resolve) instead of
    loading stale weights beside it."""
    reg, engine = FakeRegistry(["a"]), FakeEngine(4)
    reg.hot = [Hot(AdapterRef("a", 3, "cd" * 32, "/adapters/a-v3", 8, "base"), 5.0)]
    pub = publisher(reg, engine)
    pub.newest_version["b"] = 7
    asyncio.run(pub.desired.prefetch_once(1))
    assert pub.newest_version == {"a": 3, "b": 7}
    with pytest.raises(AdapterVersionUnavailable, match="version 1 was replaced by version 3"):
        check_version(ref("a"), pub.newest_version)

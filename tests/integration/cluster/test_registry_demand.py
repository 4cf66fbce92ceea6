"""Adapter demand on a real redis-server: replicas' active adapters (the autoscaling
share's copy counts) and claims on warm copies, including many replicas claiming at once."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.registry import AsyncRegistry, Registry
from lora_core.errors import StaleEpoch

CLAIMERS = 12


@pytest.fixture
def reg(registry: Registry, adapters) -> Registry:
    registry.register_adapter("a", str(adapters["a"]))
    registry.register_adapter("b", str(adapters["b"]))
    return registry


def replicas(reg: Registry, n: int, pool: str = "mixed", ttl_s: float = 30.0) -> list[int]:
    return [reg.register_replica(f"r{i}", pool, "d", 2, ttl_s) for i in range(n)]


def wait_lapsed(reg: Registry, replica_id: str) -> None:
    deadline = time.monotonic() + 3.0
    while any(r.live for r in reg.list_replicas() if r.replica_id == replica_id):
        assert time.monotonic() < deadline, f"{replica_id} still live"
        time.sleep(0.02)


def test_active_copies_count_live_replicas_using_an_adapter(reg: Registry):
    e = replicas(reg, 3)
    assert reg.report_active("r0", e[0], {"a": 3, "b": 1}) == {"a": 1, "b": 1}
    assert reg.report_active("r1", e[1], {"a": 5}) == {"a": 2}
    assert reg.report_active("r2", e[2], {}) == {}
    # r0's next report no longer names b: b is active nowhere, a still on r0 and r1
    assert reg.report_active("r0", e[0], {"a": 1}) == {"a": 2}
    assert reg.client.hgetall("t:active:a") == {"r0": f"1|{e[0]}", "r1": f"5|{e[1]}"}
    assert reg.client.exists("t:active:b") == 0
    assert reg.client.smembers("t:active_names") == {"a"}
    assert reg.report_active("r2", e[2], {"a": 1, "b": 2}) == {"a": 3, "b": 1}


def test_activity_of_a_replica_ends_with_its_lease_or_its_record(reg: Registry):
    fast = reg.register_replica("fast", "mixed", "d", 2, 0.2)
    e = replicas(reg, 2)
    reg.report_active("fast", fast, {"a": 1})
    reg.report_active("r0", e[0], {"a": 1, "b": 1})
    reg.report_active("r1", e[1], {"b": 1})
    assert reg.report_active("r1", e[1], {"a": 1, "b": 1}) == {"a": 3, "b": 2}
    wait_lapsed(reg, "fast")
    assert reg.report_active("r1", e[1], {"a": 1, "b": 1}) == {"a": 2, "b": 2}
    assert reg.deregister_replica("r0", e[0]) is True
    assert reg.report_active("r1", e[1], {"a": 1, "b": 1}) == {"a": 1, "b": 1}
    assert reg.reap() == (1, 0)  # "fast" lapsed
    assert set(reg.client.hgetall("t:active:a")) == {"r1"}
    # a new incarnation is active nowhere until it reports
    again = reg.register_replica("r1", "mixed", "d", 2, 30.0)
    assert reg.client.exists("t:active:a", "t:replica:r1:active") == 0
    assert reg.client.smembers("t:active_names") == set()
    with pytest.raises(StaleEpoch):
        reg.report_active("r1", e[1], {"a": 1})
    assert reg.report_active("r1", again, {"a": 1}) == {"a": 1}


def test_unregistering_an_adapter_drops_its_activity(reg: Registry):
    (e,) = replicas(reg, 1)
    reg.report_active("r0", e, {"a": 1})
    assert reg.unregister_adapter("a") == "removed"  # active but resident nowhere
    assert reg.client.exists("t:active:a") == 0 and reg.client.smembers("t:active_names") == set()


def test_concurrent_claims_never_exceed_the_warm_target(reg: Registry, redis_url):
    epochs = replicas(reg, CLAIMERS)
    reg.warm("a", 3)
    reg.warm("b", 1)

    def claim(i: int) -> list[str]:
        r = Registry(redis_url, namespace="t")
        try:
            return r.claim_warm(f"r{i}", epochs[i], ["a", "b"], 10.0)
        finally:
            r.close()

    with ThreadPoolExecutor(CLAIMERS) as pool:
        granted = list(pool.map(claim, range(CLAIMERS)))
    assert sum("a" in g for g in granted) == 3 and sum("b" in g for g in granted) == 1
    # a replica asking again while its claim lasts is granted again (a retried load)
    winners = [i for i, g in enumerate(granted) if "a" in g]
    losers = [i for i in range(CLAIMERS) if i not in winners]
    assert reg.claim_warm(f"r{winners[0]}", epochs[winners[0]], ["a"], 10.0) == ["a"]
    assert reg.claim_warm(f"r{losers[0]}", epochs[losers[0]], ["a"], 10.0) == []
    # a winner reports its copy: the claim becomes that copy, the count stays 3
    reg.report_resident(f"r{winners[0]}", epochs[winners[0]], ("a", 1), "gpu")
    assert reg.client.hexists("t:warm_claims:a", f"r{winners[0]}") == 0
    assert reg.claim_warm(f"r{losers[0]}", epochs[losers[0]], ["a"], 10.0) == []
    assert reg.claim_warm(f"r{winners[0]}", epochs[winners[0]], ["a"], 10.0) == []


def test_asyncio_claimers_and_a_copy_in_place(reg: Registry, redis_url):
    epochs = replicas(reg, CLAIMERS)
    reg.report_resident("r0", epochs[0], ("a", 1), "gpu")
    reg.warm("a", 2)

    async def scenario() -> list[list[str]]:
        r = AsyncRegistry(redis_url, namespace="t")
        try:
            return await asyncio.gather(
                *(r.claim_warm(f"r{i}", epochs[i], ["a"], 10.0) for i in range(CLAIMERS))
            )
        finally:
            await r.close()

    granted = asyncio.run(scenario())
    assert granted[0] == []  # holds a copy already
    assert sum(g == ["a"] for g in granted) == 1  # one more copy makes the target


def test_claims_expire_and_lapse(reg: Registry):
    fast = reg.register_replica("fast", "mixed", "d", 2, 0.2)
    e = replicas(reg, 2)
    reg.warm("a", 1)
    assert reg.claim_warm("r0", e[0], ["a"], 0.1) == ["a"]
    assert reg.claim_warm("r1", e[1], ["a"], 5.0) == []
    time.sleep(0.15)
    assert reg.claim_warm("r1", e[1], ["a"], 5.0) == ["a"]  # r0's claim expired
    reg.warm("b", 1)
    assert reg.claim_warm("fast", fast, ["b"], 30.0) == ["b"]
    assert reg.claim_warm("r0", e[0], ["b"], 5.0) == []
    wait_lapsed(reg, "fast")  # crashed while loading: its claim ends with its lease
    assert reg.claim_warm("r0", e[0], ["b"], 5.0) == ["b"]


def test_claims_follow_the_targets_pools(reg: Registry):
    pre = reg.register_replica("pre", "prefill", "d", 2, 30.0)
    dec = reg.register_replica("dec", "decode", "d", 2, 30.0)
    mix = reg.register_replica("mix", "mixed", "d", 2, 30.0)
    reg.report_resident("pre", pre, ("a", 1), "gpu")
    reg.warm("a", 1, "decode")
    assert reg.claim_warm("pre", pre, ["a"], 5.0) == []  # prefill takes no decode target
    # the prefill copy does not count for a decode target: a decode replica claims one
    assert reg.claim_warm("dec", dec, ["a"], 5.0) == ["a"]
    assert reg.claim_warm("mix", mix, ["a"], 5.0) == []
    # no target, or an unknown name: nothing to claim
    assert reg.claim_warm("mix", mix, ["b", "nope"], 5.0) == []


def test_a_lapsed_replica_cannot_claim(reg: Registry):
    fast = reg.register_replica("fast", "mixed", "d", 2, 0.2)
    reg.warm("a", 1)
    wait_lapsed(reg, "fast")
    with pytest.raises(StaleEpoch, match="lapsed"):
        reg.claim_warm("fast", fast, ["a"], 5.0)


def test_hot_adapters_rank_demand_per_copy(reg: Registry, adapters):
    reg.register_adapter("c", str(adapters["small"]))
    e = replicas(reg, 4)
    reg.report_active("r0", e[0], {"a": 6, "b": 2, "c": 1})
    reg.report_active("r1", e[1], {"a": 2})
    reg.report_resident("r2", e[2], ("b", 1), "gpu")  # an idle GPU copy still serves b
    # a: 8 on 2 copies = 4; b: 2 on 2 copies (r0 active, r2 GPU) = 1; c: 1 on 1 = 1
    hot = reg.hot_adapters("r3", 5)
    assert [(h.ref.name, h.in_flight, h.copies, h.per_copy) for h in hot] == [
        ("a", 8, 2, 4.0),
        ("b", 2, 2, 1.0),
        ("c", 1, 1, 1.0),
    ]
    assert hot[0].ref == reg.get_adapter("a").ref
    assert [h.ref.name for h in reg.hot_adapters("r3", 1)] == ["a"]
    assert reg.hot_adapters("r3", 0) == []
    # what a replica serves or holds in a GPU slot is not offered to it
    assert [h.ref.name for h in reg.hot_adapters("r1", 5)] == ["b", "c"]
    assert [h.ref.name for h in reg.hot_adapters("r2", 5)] == ["a", "c"]
    assert reg.unregister_adapter("a") == "removed"  # a draining or removed adapter: none
    reg.report_active("r0", e[0], {"b": 2, "c": 1})
    assert reg.unregister_adapter("c") == "removed"
    assert [h.ref.name for h in reg.hot_adapters("r3", 5)] == ["b"]


def test_hot_adapters_skip_lapsed_replicas_and_idle_adapters(reg: Registry):
    fast = reg.register_replica("fast", "mixed", "d", 2, 0.2)
    (e,) = replicas(reg, 1)
    reg.report_active("fast", fast, {"a": 9})
    reg.report_active("r0", e, {"b": 1})
    assert [h.ref.name for h in reg.hot_adapters("new", 5)] == ["a", "b"]
    wait_lapsed(reg, "fast")
    reg.report_active("r0", e, {})
    assert reg.hot_adapters("new", 5) == []

"""Adapter demand on a real redis-server: replicas' active adapters (the autoscaling
share's copy counts), claims on warm copies and the hot adapters new replicas prefetch
under claims, including many replicas claiming at once."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.registry import AsyncRegistry, Registry
from lora_core.errors import StaleEpoch
from tests.integration.cluster.timing import lapse, redis_now_us

CLAIMERS = 12


@pytest.fixture
def reg(registry: Registry, adapters) -> Registry:
    registry.register_adapter("a", str(adapters["a"]))
    registry.register_adapter("b", str(adapters["b"]))
    return registry


def replicas(reg: Registry, n: int, pool: str = "mixed", ttl_s: float = 30.0) -> list[int]:
    return [reg.register_replica(f"r{i}", pool, "d", 2, ttl_s) for i in range(n)]


def test_active_copies_count_live_replicas_using_an_adapter(reg: Registry):
    e = replicas(reg, 3)
    assert reg.report_active("r0", e[0], {"a": 3, "b": 1}) == {"a": 1, "b": 1}
    assert reg.report_active("r1", e[1], {"a": 5}) == {"a": 2}
    assert reg.report_active("r2", e[2], {}) == {}
    # r0's next report no longer names b: b is active nowhere, a still on r0 and r1
    assert reg.report_active("r0", e[0], {"a": 1}) == {"a": 2}
    assert reg.client.hgetall("t:active:a") == {
        "r0": f"1|mixed|d|{e[0]}",
        "r1": f"5|mixed|d|{e[1]}",
    }
    assert reg.client.exists("t:active:b") == 0
    assert reg.client.smembers("t:active_names") == {"a"}
    assert reg.report_active("r2", e[2], {"a": 1, "b": 2}) == {"a": 3, "b": 1}


def test_activity_of_a_replica_ends_with_its_lease_or_its_record(reg: Registry):
    fast = reg.register_replica("fast", "mixed", "d", 2, 30.0)
    e = replicas(reg, 2)
    reg.report_active("fast", fast, {"a": 1})
    reg.report_active("r0", e[0], {"a": 1, "b": 1})
    reg.report_active("r1", e[1], {"b": 1})
    assert reg.report_active("r1", e[1], {"a": 1, "b": 1}) == {"a": 3, "b": 2}
    lapse(reg, "fast")
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


def test_active_copies_count_only_the_reporting_replicas_deployment(reg: Registry):
    """The autoscaler sums shares per deployment: an adapter active on one replica of a
    prefill deployment and one of a decode deployment is a whole adapter in each."""
    pre = reg.register_replica("pre", "prefill", "prefill-d", 2, 30.0)
    dec = reg.register_replica("dec", "decode", "decode-d", 2, 30.0)
    dec2 = reg.register_replica("dec2", "decode", "decode-d", 2, 30.0)
    assert reg.report_active("pre", pre, {"a": 1}) == {"a": 1}
    assert reg.report_active("dec", dec, {"a": 1}) == {"a": 1}
    assert reg.report_active("dec2", dec2, {"a": 1}) == {"a": 2}
    assert reg.report_active("pre", pre, {"a": 1}) == {"a": 1}


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
    fast = reg.register_replica("fast", "mixed", "d", 2, 30.0)
    e = replicas(reg, 2)
    reg.warm("a", 1)
    start = redis_now_us(reg)
    assert reg.claim_warm("r0", e[0], ["a"], 0.1) == ["a"]
    second = reg.claim_warm("r1", e[1], ["a"], 5.0)
    if redis_now_us(reg) - start < 100_000:  # r0's claim held (a stall past it lets r1 in)
        assert second == []
    time.sleep(0.15)
    assert reg.claim_warm("r1", e[1], ["a"], 5.0) == ["a"]  # r0's claim expired
    reg.warm("b", 1)
    assert reg.claim_warm("fast", fast, ["b"], 30.0) == ["b"]
    assert reg.claim_warm("r0", e[0], ["b"], 5.0) == []
    lapse(reg, "fast")  # crashed while loading: its claim ends with its lease
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
    fast = reg.register_replica("fast", "mixed", "d", 2, 30.0)
    reg.warm("a", 1)
    lapse(reg, "fast")
    with pytest.raises(StaleEpoch, match="lapsed"):
        reg.claim_warm("fast", fast, ["a"], 5.0)


def hot(reg: Registry, replica: str, epoch: int, limit: int = 5) -> list[str]:
    """hot_adapters' names for replica, then its claims dropped (so they do not count as
    copies for the next caller: the ranking tests look at one caller at a time)."""
    names = [h.ref.name for h in reg.hot_adapters(replica, epoch, limit, 30.0)]
    claims = reg.client.keys("t:prefetch_claims:*")
    if claims:
        reg.client.delete(*claims)
    return names


def test_hot_adapters_rank_demand_per_copy(reg: Registry, adapters):
    reg.register_adapter("c", str(adapters["small"]))
    e = replicas(reg, 4)
    reg.report_active("r0", e[0], {"a": 6, "b": 2, "c": 1})
    reg.report_active("r1", e[1], {"a": 2})
    reg.report_resident("r2", e[2], ("b", 1), "gpu")  # an idle GPU copy still serves b
    # a: 8 on 2 copies = 4; b: 2 on 2 copies (r0 active, r2 GPU) = 1; c: 1 on 1 = 1
    rows = reg.hot_adapters("r3", e[3], 5, 30.0)
    assert [(h.ref.name, h.in_flight, h.copies, h.per_copy) for h in rows] == [
        ("a", 8, 2, 4.0),
        ("b", 2, 2, 1.0),
        ("c", 1, 1, 1.0),
    ]
    assert rows[0].ref == reg.get_adapter("a").ref
    # what it returned, r3 claimed; asked again (a retry), its own claims are no copies
    assert set(reg.client.hgetall("t:prefetch_claims:a")) == {"r3"}
    assert hot(reg, "r3", e[3]) == ["a", "b", "c"]
    assert hot(reg, "r3", e[3], 1) == ["a"]
    assert hot(reg, "r3", e[3], 0) == []
    # what a replica serves or holds in a GPU slot is not offered to it
    assert hot(reg, "r1", e[1]) == ["b", "c"]
    assert hot(reg, "r2", e[2]) == ["a", "c"]
    assert reg.unregister_adapter("a") == "removed"  # a draining or removed adapter: none
    reg.report_active("r0", e[0], {"b": 2, "c": 1})
    assert reg.unregister_adapter("c") == "removed"
    assert hot(reg, "r3", e[3]) == ["b"]


def test_hot_adapters_skip_lapsed_replicas_and_idle_adapters(reg: Registry):
    fast = reg.register_replica("fast", "mixed", "d", 2, 30.0)
    e = replicas(reg, 2)
    reg.report_active("fast", fast, {"a": 9})
    reg.report_active("r0", e[0], {"b": 1})
    assert hot(reg, "r1", e[1]) == ["a", "b"]
    lapse(reg, "fast")
    reg.report_active("r0", e[0], {})
    assert hot(reg, "r1", e[1]) == []
    with pytest.raises(StaleEpoch, match="lapsed"):
        reg.hot_adapters("fast", fast, 5, 30.0)


def test_replicas_starting_at_once_spread_over_the_hot_adapters(reg: Registry, redis_url, adapters):
    """Each caller counts the others' prefetch claims as copies, in one script, so
    concurrent starters fill the fleet by demand per copy instead of all loading the top
    adapter: a (12 in flight on 1 copy), b (7 on 1), c (5 on 1) and 6 starters taking
    one each, always the most per copy -> a 3 more copies (12 / 4 = 3), b 2 more
    (7 / 3), c 1 more (5 / 2)."""
    reg.register_adapter("c", str(adapters["small"]))
    e = replicas(reg, 3)
    for i, (name, n) in enumerate({"a": 12, "b": 7, "c": 5}.items()):
        reg.report_active(f"r{i}", e[i], {name: n})
    starters = [reg.register_replica(f"new{i}", "mixed", "d", 2, 30.0) for i in range(6)]

    def start(i: int) -> list[str]:
        r = Registry(redis_url, namespace="t")
        try:
            return [h.ref.name for h in r.hot_adapters(f"new{i}", starters[i], 1, 10.0)]
        finally:
            r.close()

    with ThreadPoolExecutor(len(starters)) as pool:
        picks = [name for names in pool.map(start, range(len(starters))) for name in names]
    assert sorted(picks) == ["a", "a", "a", "b", "b", "c"]
    # a claim ends with the copy it announced (the copy counts from then on instead)
    holder = next(i for i in range(6) if reg.client.hexists("t:prefetch_claims:c", f"new{i}"))
    reg.report_resident(f"new{holder}", starters[holder], ("c", 1), "gpu")
    assert reg.client.hexists("t:prefetch_claims:c", f"new{holder}") == 0


def test_prefetch_claims_expire_and_lapse(reg: Registry):
    (e,) = replicas(reg, 1)
    reg.report_active("r0", e, {"a": 4, "b": 3})
    fast = reg.register_replica("fast", "mixed", "d", 2, 30.0)
    slow = reg.register_replica("slow", "mixed", "d", 2, 30.0)
    late = reg.register_replica("late", "mixed", "d", 2, 30.0)
    # a: 4 per copy, b: 3; fast claims a, so for slow a is 4 / 2 = 2 < 3
    assert [h.ref.name for h in reg.hot_adapters("fast", fast, 1, 30.0)] == ["a"]
    assert [h.ref.name for h in reg.hot_adapters("slow", slow, 1, 0.05)] == ["b"]
    lapse(reg, "fast")  # crashed before its load: its claim no longer counts
    time.sleep(0.06)  # slow's claim expired
    assert [(h.ref.name, h.copies) for h in reg.hot_adapters("late", late, 2, 30.0)] == [
        ("a", 1),
        ("b", 1),
    ]


@pytest.mark.parametrize(
    ("pool", "expected"),
    [
        # prefill: a 6 on pre-a (+ mixed c 1); b's decode demand is not its to serve
        ("prefill", [("a", 6, 1), ("c", 1, 1)]),
        # decode: b 4 on dec-b; a's GPU copy on pre-a is no decode copy, but its
        # demand is not decode demand either: a is not offered at all
        ("decode", [("b", 4, 1), ("c", 1, 1)]),
        # mixed runs both phases: every replica's demand and copies count
        ("mixed", [("a", 6, 2), ("b", 4, 2), ("c", 1, 1)]),
    ],
)
def test_hot_adapters_count_demand_and_copies_in_overlapping_pools(
    reg: Registry, adapters, pool: str, expected: list[tuple[str, int, int]]
):
    reg.register_adapter("c", str(adapters["small"]))
    pre = reg.register_replica("pre-a", "prefill", "p", 2, 30.0)
    dec = reg.register_replica("dec-b", "decode", "d", 2, 30.0)
    dec_copy = reg.register_replica("dec-a", "decode", "d", 2, 30.0)
    pre_copy = reg.register_replica("pre-b", "prefill", "p", 2, 30.0)
    mix = reg.register_replica("mix-c", "mixed", "m", 2, 30.0)
    new = reg.register_replica("new", pool, "x", 2, 30.0)
    reg.report_active("pre-a", pre, {"a": 6})
    reg.report_active("dec-b", dec, {"b": 4})
    reg.report_active("mix-c", mix, {"c": 1})
    reg.report_resident("dec-a", dec_copy, ("a", 1), "gpu")  # idle decode copy of a
    reg.report_resident("pre-b", pre_copy, ("b", 1), "gpu")  # idle prefill copy of b
    rows = reg.hot_adapters("new", new, 5, 30.0)
    assert [(h.ref.name, h.in_flight, h.copies) for h in rows] == expected


def test_prefetch_claims_in_another_pool_are_no_copies(reg: Registry):
    (e,) = replicas(reg, 1)
    reg.report_active("r0", e, {"a": 4, "b": 3})
    dec = reg.register_replica("dec", "decode", "d", 2, 30.0)
    pre = reg.register_replica("pre", "prefill", "d", 2, 30.0)
    pre2 = reg.register_replica("pre2", "prefill", "d", 2, 30.0)
    assert [h.ref.name for h in reg.hot_adapters("dec", dec, 1, 30.0)] == ["a"]
    # dec's claim on a is a decode copy: to a prefill starter a is still 4 per copy
    assert [h.ref.name for h in reg.hot_adapters("pre", pre, 1, 30.0)] == ["a"]
    # pre's claim is a prefill copy: for pre2 a is 4 / 2 (r0 mixed, pre), b 3 / 1
    assert [h.ref.name for h in reg.hot_adapters("pre2", pre2, 1, 30.0)] == ["b"]


def test_activity_written_by_an_older_replica_reads_as_mixed(reg: Registry):
    """Mid rolling upgrade an old replica's report is a bare count: it still counts as
    demand and a copy everywhere, and as a copy in no deployment's share."""
    old, cur, new = replicas(reg, 3)
    reg.client.hset("t:active:a", "r0", f"3|{old}")
    reg.client.sadd("t:active_names", "a")
    reg.client.sadd("t:replica:r0:active", "a")
    assert reg.report_active("r1", cur, {"a": 1}) == {"a": 1}
    assert [(h.ref.name, h.in_flight, h.copies) for h in reg.hot_adapters("r2", new, 5, 1.0)] == [
        ("a", 4, 2)
    ]


def test_hot_adapters_offer_the_current_version_and_count_only_its_copies(reg: Registry, adapters):
    """Mid replace: r0 still holds version 1 in a GPU slot (idle), r1 runs requests by
    name. A starter is offered version 2, and the old copy is no copy of it."""
    e = replicas(reg, 3)
    reg.report_resident("r0", e[0], reg.get_adapter("a").ref, "gpu")
    v2 = reg.register_adapter("a", str(adapters["b"]), replace=True).ref
    reg.report_active("r1", e[1], {"a": 4})
    rows = reg.hot_adapters("r2", e[2], 5, 1.0)
    assert [(h.ref, h.in_flight, h.copies) for h in rows] == [(v2, 4, 1)]
    # the replica holding only the old version may load the new one too
    assert [h.ref for h in reg.hot_adapters("r0", e[0], 5, 1.0)] == [v2]


def test_warm_and_prefetch_claims_count_as_each_others_copies(reg: Registry):
    """A copy about to be loaded under either kind of claim counts for the other kind:
    a warm target is met by a starter's prefetch claim in the target's pool, and a warm
    claim is a copy in the hot ranking (and not offered again to its claimer)."""
    e = replicas(reg, 4)
    reg.report_active("r0", e[0], {"a": 4, "b": 3})
    assert [h.ref.name for h in reg.hot_adapters("r1", e[1], 1, 30.0)] == ["a"]
    reg.warm("a", 2)  # r0 serves a but holds no GPU copy: 0 copies + r1's prefetch claim
    assert reg.claim_warm("r2", e[2], ["a"], 30.0) == ["a"]
    assert reg.claim_warm("r3", e[3], ["a"], 30.0) == []  # r1 (prefetch) + r2 (warm) = 2
    # a claimer's own prefetch claim is granted as its warm claim, with no second entry
    assert reg.claim_warm("r1", e[1], ["a"], 30.0) == ["a"]
    assert reg.client.hexists("t:warm_claims:a", "r1") == 0
    # r2's warm claim is a copy of a for a new starter: a 4 / 3 (r0, r1, r2) < b 3 / 1
    new = reg.register_replica("new", "mixed", "d", 2, 30.0)
    rows = reg.hot_adapters("new", new, 2, 30.0)
    assert [(h.ref.name, h.copies) for h in rows] == [("b", 1), ("a", 3)]
    # and r2 is not offered the copy it already claimed for the warm target
    assert [h.ref.name for h in reg.hot_adapters("r2", e[2], 5, 30.0)] == ["b"]


def test_prefetch_claims_outside_the_warm_targets_pool_do_not_meet_it(reg: Registry):
    (e,) = replicas(reg, 1)
    reg.report_active("r0", e, {"a": 4})
    dec = reg.register_replica("dec", "decode", "d", 2, 30.0)
    pre = reg.register_replica("pre", "prefill", "d", 2, 30.0)
    assert [h.ref.name for h in reg.hot_adapters("dec", dec, 1, 30.0)] == ["a"]
    reg.warm("a", 1, "prefill")
    assert reg.claim_warm("pre", pre, ["a"], 30.0) == ["a"]  # dec's copy is no prefill copy

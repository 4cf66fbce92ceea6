import random

import pytest

from lora_core.errors import InvalidRequest
from router.ranking import AffinityMemory, RankingConfig, ReplicaLoad, rank_replicas

K = "tenant-a@1:0123456789abcdef"
CFG = RankingConfig(overload_queue_len=8, hot_queue_len=4, affinity_ttl_s=30.0, stats_lag_s=5.0)


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def rank(replicas, key=K, remembered=None, registry=None, seed=0):
    return rank_replicas(key, replicas, CFG, random.Random(seed), remembered, registry)


def test_docstring_example_tiers():
    a = ReplicaLoad("a", gpu_adapters=frozenset({K}), queue_len=5, free_slots=1)
    b = ReplicaLoad("b", queue_len=0, free_slots=2)
    c = ReplicaLoad("c", cpu_adapters=frozenset({K}), queue_len=1, free_slots=1)
    assert rank([a, b, c]) == [["a"], ["c"], ["b"]]


def test_docstring_example_full_cpu_holder_yields_to_a_free_slot():
    a = ReplicaLoad("a", gpu_adapters=frozenset({K}), queue_len=5, free_slots=1)
    b = ReplicaLoad("b", queue_len=0, free_slots=2)
    c = ReplicaLoad("c", cpu_adapters=frozenset({K}), queue_len=1, free_slots=0)
    assert rank([a, b, c]) == [["a"], ["b"], ["c"]]


def test_adapters_move_to_a_replica_added_for_them():
    """The QA case: one replica holds A and B in its 2 slots and C in its CPU cache,
    swapping C in and out; the autoscaler adds an empty replica for the adapter demand.
    C goes to the new replica, A and B stay where they are."""
    a, b, c = (f"{n}@1:0123456789abcdef" for n in "ABC")
    old = ReplicaLoad("old", gpu_adapters=frozenset({a, b}), cpu_adapters=frozenset({a, b, c}),
                      free_slots=0, queue_len=3)  # fmt: skip
    new = ReplicaLoad("new", free_slots=2)
    assert rank([old, new], key=c)[0] == ["new"]
    assert rank([old, new], key=a)[0] == ["old"]
    # Nowhere a free slot: the CPU copy still beats a disk read.
    full = ReplicaLoad("full", gpu_adapters=frozenset({a}), free_slots=0)
    assert rank([old, full], key=c)[0] == ["old"]


def test_all_holders_hot_next_replica_joins_tier0():
    a = ReplicaLoad("a", gpu_adapters=frozenset({K}), queue_len=5, free_slots=1)
    b = ReplicaLoad("b", queue_len=0, free_slots=2)
    c = ReplicaLoad("c", cpu_adapters=frozenset({K}), queue_len=6, free_slots=1)
    assert rank([a, b, c]) == [["b", "a"], ["c"]]


def test_cold_adapter_stays_on_its_holder_below_hot_threshold():
    a = ReplicaLoad("a", gpu_adapters=frozenset({K}), queue_len=3)
    b = ReplicaLoad("b", queue_len=0, free_slots=2)
    assert rank([a, b])[0] == ["a"]


def test_overloaded_holder_is_skipped_until_the_any_tier():
    a = ReplicaLoad("a", gpu_adapters=frozenset({K}), queue_len=8)
    b = ReplicaLoad("b", queue_len=2, free_slots=1)
    assert rank([a, b]) == [["b"], ["a"]]


def test_kv_full_counts_as_overloaded():
    a = ReplicaLoad("a", gpu_adapters=frozenset({K}), queue_len=0, kv_usage=0.99)
    b = ReplicaLoad("b", queue_len=0, free_slots=1)
    assert rank([a, b]) == [["b"], ["a"]]


@pytest.mark.parametrize(
    "replicas, expected_tier2",
    [
        # most free slots wins
        ([ReplicaLoad("x", free_slots=1), ReplicaLoad("y", free_slots=2)], ["y"]),
        # no free slots anywhere: fewest adapters wins
        (
            [
                ReplicaLoad("x", gpu_adapters=frozenset({"p", "q"})),
                ReplicaLoad("y", gpu_adapters=frozenset({"p"})),
            ],
            ["y"],
        ),
    ],
)
def test_spare_tier_prefers_free_slots_then_fewest_adapters(replicas, expected_tier2):
    assert rank(replicas)[0] == expected_tier2


def test_power_of_two_inside_a_tier_orders_by_queue():
    holders = [ReplicaLoad(f"r{i}", gpu_adapters=frozenset({K}), queue_len=i) for i in range(5)]
    for seed in range(20):
        tiers = rank(holders, seed=seed)
        first = tiers[0]
        assert len(first) == 2
        q = [int(rid[1:]) for rid in first]
        assert q == sorted(q)
        flat = [rid for t in tiers for rid in t]
        assert len(flat) == len(set(flat)) == 4  # two tiers of two: holders, then any


def test_power_of_two_samples_uniformly_enough():
    holders = [ReplicaLoad(f"r{i}", gpu_adapters=frozenset({K})) for i in range(4)]
    seen = {rid for seed in range(50) for rid in rank(holders, seed=seed)[0]}
    assert seen == {"r0", "r1", "r2", "r3"}


def test_base_model_request_ignores_adapters():
    a = ReplicaLoad("a", gpu_adapters=frozenset({K}), queue_len=3)
    b = ReplicaLoad("b", queue_len=1)
    c = ReplicaLoad("c", queue_len=9)
    assert rank([a, b, c], key=None) == [["b", "a"], ["c"]]


def test_registry_residency_counts_as_holding():
    a = ReplicaLoad("a", queue_len=1, free_slots=2)
    b = ReplicaLoad("b", queue_len=0, free_slots=2)
    assert rank([a, b], registry={"a": "gpu"})[0] == ["a"]
    assert rank([a, b], registry={"a": "cpu"}) == [["a"], ["b"]]


def test_no_replicas_no_tiers():
    assert rank([]) == []


def test_memory_bridges_until_stats_catch_up():
    clock = FakeClock(1000.0)
    memory = AffinityMemory(ttl_s=30.0, clock=clock)
    memory.record(K, "a")
    a_old_stats = ReplicaLoad("a", free_slots=2, queue_len=1, stats_time=999.0)
    b = ReplicaLoad("b", free_slots=2, queue_len=0, stats_time=999.0)
    assert rank([a_old_stats, b], remembered=memory.holders(K))[0] == ["a"]
    # Stats taken well after the decision, without the adapter: the stats win.
    clock.t = 1010.0
    a_new_stats = ReplicaLoad("a", free_slots=2, queue_len=1, stats_time=1009.0)
    # Neither holds K any more: both are spares, K's home first, one per tier.
    tiers = rank([a_new_stats, b], remembered=memory.holders(K))
    assert sorted(tiers) == [["a"], ["b"]]


@pytest.mark.parametrize("evidence", ["stats", "registry"])
def test_memory_yields_once_the_adapter_is_seen_evicted_to_cpu(evidence):
    """Routed to b a moment ago, but b has since loaded and evicted it (CPU cache): the
    GPU holder a alone is tier 0, so repeated requests stay on a (no reload on b)."""
    clock = FakeClock(1000.0)
    memory = AffinityMemory(ttl_s=30.0, clock=clock)
    memory.record(K, "b")
    a = ReplicaLoad("a", gpu_adapters=frozenset({K}), free_slots=0, queue_len=1, stats_time=999.5)
    b_cpu = frozenset({K}) if evidence == "stats" else frozenset()
    b = ReplicaLoad("b", cpu_adapters=b_cpu, free_slots=0, queue_len=0, stats_time=999.5)
    registry = {"a": "gpu", "b": "cpu"} if evidence == "registry" else None
    for seed in range(20):
        tiers = rank([a, b], remembered=memory.holders(K), registry=registry, seed=seed)
        assert tiers == [["a"], ["b"]]


def test_memory_yields_to_idle_stats_taken_after_the_routing():
    """Routed to b at t=1000, b's stats at 1001 show it idle without the adapter (loaded
    and evicted from both tiers meanwhile): a, the GPU holder, is the only tier-0 pick."""
    clock = FakeClock(1000.0)
    memory = AffinityMemory(ttl_s=30.0, clock=clock)
    memory.record(K, "b")
    clock.t = 1002.0
    a = ReplicaLoad("a", gpu_adapters=frozenset({K}), free_slots=0, queue_len=1, stats_time=1001.0)
    b_idle = ReplicaLoad("b", free_slots=0, queue_len=0, stats_time=1001.0)
    for seed in range(20):
        assert rank([a, b_idle], remembered=memory.holders(K), seed=seed)[0] == ["a"]
    # Still busy with what was routed there: memory keeps bridging until stats show it.
    b_busy = ReplicaLoad("b", free_slots=0, queue_len=2, stats_time=1001.0)
    assert sorted(rank([a, b_busy], remembered=memory.holders(K))[0]) == ["a", "b"]


def test_memory_expires_after_ttl_and_forgets_dead_replicas():
    clock = FakeClock(0.0)
    memory = AffinityMemory(ttl_s=30.0, clock=clock)
    memory.record(K, "a")
    memory.record(K, "b")
    clock.t = 29.0
    assert memory.holders(K) == {"a": 0.0, "b": 0.0}
    memory.forget_replica("b")
    assert memory.holders(K) == {"a": 0.0}
    clock.t = 31.0
    assert memory.holders(K) == {}


def test_spread_set_grows_only_while_hot():
    clock = FakeClock(0.0)
    memory = AffinityMemory(ttl_s=30.0, clock=clock)
    a = ReplicaLoad("a", gpu_adapters=frozenset({K}), queue_len=6, free_slots=0)
    b = ReplicaLoad("b", queue_len=0, free_slots=1)
    c = ReplicaLoad("c", queue_len=1, free_slots=1)
    first = rank([a, b, c], remembered=memory.holders(K))[0]
    assert first == ["b", "a"]
    memory.record(K, "b")
    # b is now a (cool) holder: nobody else joins.
    tiers = rank([a, b, c], remembered=memory.holders(K))
    assert tiers[0] == ["b", "a"]
    assert tiers[1] == ["c"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"overload_queue_len": 0},
        {"hot_queue_len": 0},
        {"overload_queue_len": 4, "hot_queue_len": 5},
        {"overload_kv_usage": 0.0},
        {"affinity_ttl_s": 0.0},
    ],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(InvalidRequest):
        RankingConfig(**kwargs)


def test_cold_adapter_goes_to_its_home_whatever_the_rng():
    # queue lengths 0..1 share a bucket (hot_queue_len 4 // 2 = 2): they do not matter
    spares = [
        ReplicaLoad(f"r{i}", free_slots=0, gpu_adapters=frozenset({"x", "y"}), queue_len=i % 2)
        for i in range(4)
    ]
    homes = {}
    for key in [f"k{j}" for j in range(40)]:
        firsts = {rank_replicas(key, spares, CFG, random.Random(seed))[0][0] for seed in range(5)}
        assert len(firsts) == 1  # deterministic
        homes[key] = firsts.pop()
        # the order does not depend on the input order either
        assert rank_replicas(key, spares[::-1], CFG, random.Random(0))[0] == [homes[key]]
    assert set(homes.values()) == {"r0", "r1", "r2", "r3"}  # keys spread over replicas


def test_home_is_only_a_preference_inside_the_best_room_group():
    full = ReplicaLoad("full", gpu_adapters=frozenset({"x", "y"}), free_slots=0)
    empty = ReplicaLoad("empty", free_slots=2)
    for key in [f"k{j}" for j in range(10)]:
        assert rank_replicas(key, [full, empty], CFG, random.Random(0)) == [["empty"], ["full"]]


def test_home_yields_to_a_clearly_less_busy_spare():
    # CFG.hot_queue_len 4 -> queue buckets of 2: 0-1 tie (home wins), 4 vs 0 does not.
    for key in [f"k{j}" for j in range(20)]:
        a = ReplicaLoad("a", gpu_adapters=frozenset({"x"}), queue_len=0)
        b = ReplicaLoad("b", gpu_adapters=frozenset({"x"}), queue_len=1)
        home = rank_replicas(key, [a, b], CFG, random.Random(0))[0][0]
        busy = ReplicaLoad(home, gpu_adapters=frozenset({"x"}), queue_len=4)
        other = ({"a", "b"} - {home}).pop()
        idle = ReplicaLoad(other, gpu_adapters=frozenset({"x"}), queue_len=0)
        assert rank_replicas(key, [busy, idle], CFG, random.Random(0))[0] == [other]


def _group_first(key, replicas, group, seed=0):
    return rank_replicas(key, replicas, CFG, random.Random(seed), None, None, group)[0]


@pytest.mark.parametrize("key", [None, K])
def test_the_choices_of_one_request_go_to_one_replica(key):
    """Base-model choices (one tier of 4 replicas) and an adapter's (two holders): every
    choice of a group ranks the same replica alone first, whatever the random draw and
    as the queue grows within a bucket; groups spread over the replicas."""
    holds = frozenset({K}) if key else frozenset()
    loads = [ReplicaLoad(f"r{i}", gpu_adapters=holds if i < 2 else frozenset()) for i in range(4)]
    firsts = {}
    for g in [f"req-{j}" for j in range(40)]:
        (first,) = _group_first(key, loads, g)
        assert all(_group_first(key, loads[::-1], g, seed) == [first] for seed in range(5))
        grown = [
            ReplicaLoad(r.replica_id, r.gpu_adapters, queue_len=1 if r.replica_id == first else 0)
            for r in loads
        ]
        assert _group_first(key, grown, g) == [first]  # queue 1: the same bucket as 0
        firsts[g] = first
    assert set(firsts.values()) == ({"r0", "r1"} if key else {"r0", "r1", "r2", "r3"})
    # without a group: power of two, the shorter queue first
    assert len(rank_replicas(key, loads, CFG, random.Random(0))[0]) == 2


def test_a_group_leaves_its_replica_once_it_is_clearly_busier():
    loads = [ReplicaLoad("a"), ReplicaLoad("b")]
    for g in [f"req-{j}" for j in range(20)]:
        (first,) = _group_first(None, loads, g)
        other = ({"a", "b"} - {first}).pop()
        busy = [ReplicaLoad(first, queue_len=4), ReplicaLoad(other)]  # buckets of 2: 2 apart
        assert rank_replicas(None, busy, CFG, random.Random(0), group=g) == [[other], [first]]


def test_equal_queues_tie_in_random_order():
    """Serve sends to the first of the shortest probed queues in a rank: a fixed order of
    two equally loaded replicas sent every burst of base requests to one of them."""
    loads = [ReplicaLoad("a"), ReplicaLoad("b")]
    firsts = {rank_replicas(None, loads, CFG, random.Random(seed))[0][0] for seed in range(20)}
    assert firsts == {"a", "b"}

"""The LoRA autoscaling policy's decisions (pure; tests/integration/serve/test_autoscaling
runs it inside Serve's own wrapper and on a live cluster)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from cluster.autoscaling import (
    FleetSignals,
    LoraAutoscalingPolicy,
    decide,
    fleet_signals,
)
from lora_core.errors import InvalidRequest
from replica.autoscaling_metrics import adapter_share
from router.ranking import RankingConfig, ReplicaLoad, rank_replicas


def signals(replicas=1, ongoing=0.0, active=0.0, slots_each=2, kv=0.0, waiting=0.0):
    return FleetSignals(replicas, ongoing, active, slots_each * replicas, kv, waiting)


@pytest.mark.parametrize(
    "s, current, want, reason",
    [
        # 40 requests at 8 per replica: 5 replicas, whatever the adapters.
        (signals(replicas=2, ongoing=40, active=2), 2, 5.0, "load"),
        # 2 requests (load 0.25) but 2 adapters for 1 slot: the fleet thrashes, grow to 2.
        (signals(ongoing=2, active=2, slots_each=1), 1, 2.0, "adapters"),
        # 6 adapters over 2 replicas of 2 slots: 3 replicas' worth of slots.
        (signals(replicas=2, ongoing=6, active=6), 2, 3.0, "adapters"),
        # KV nearly full while requests wait: 2 * 0.99 / 0.9.
        (signals(replicas=2, ongoing=4, active=1, kv=0.99, waiting=3), 2, 2.2, "kv"),
        # Full KV with nothing waiting is not a reason to grow.
        (signals(replicas=2, ongoing=4, active=3, kv=0.99, waiting=0), 2, 1.5, "adapters"),
        # Idle: every demand is 0, so Serve's min_replicas decides.
        (signals(replicas=3), 3, 0.0, "load"),
    ],
)
def test_decide_takes_the_largest_demand(s, current, want, reason):
    d = decide(s, current, target_ongoing_requests=8, target_slot_use=1.0, kv_target=0.9)
    assert d.desired == pytest.approx(want) and d.reason == reason
    assert d.desired == max(d.demands.values())


def test_target_slot_use_grows_the_fleet_before_every_slot_is_needed():
    s = signals(ongoing=1, active=2, slots_each=4)
    assert decide(s, 1, 8, 1.0, 0.9).desired == pytest.approx(0.5)
    assert decide(s, 1, 8, 0.25, 0.9).desired == pytest.approx(2.0)


class Config:
    def __init__(self, target: float) -> None:
        self.target = target

    def get_target_ongoing_requests(self) -> float:
        return self.target


class Ctx:
    def __init__(self, current, metrics, ongoing, target=1, cfg_target=8.0):
        self.current_num_replicas = current
        self.target_num_replicas = target
        self.total_num_requests = ongoing
        self.aggregated_metrics = metrics
        self.config = Config(cfg_target)


def per_replica(**by_metric: list[float]) -> dict[str, dict[str, float]]:
    return {m: {f"r{i}": v for i, v in enumerate(vs)} for m, vs in by_metric.items()}


def test_fleet_signals_sum_over_replicas_that_reported():
    metrics = per_replica(
        active_adapters=[2, 3, 7], max_loras=[2, 2], kv_usage=[0.5, 0.7, 0.9], waiting=[1, 0]
    )
    s = fleet_signals(Ctx(3, metrics, ongoing=12))
    # r2 has not reported max_loras yet: it is left out of every figure.
    assert s == FleetSignals(2, 12.0, 5.0, 4.0, pytest.approx(0.6), 1.0)


def test_adapter_shares_count_a_spread_adapter_once():
    # r0 and r1 both serve "a" (share 0.5 each) and r1 also "b": 2 distinct adapters.
    # r2 runs an older version that reports no share: its 3 active adapters count.
    metrics = per_replica(active_adapters=[1, 2, 3], adapter_share=[0.5, 1.5], max_loras=[2, 2, 2])
    assert fleet_signals(Ctx(3, metrics, ongoing=3)).active_adapters == 5.0


def route(workload: dict[str, int], replicas: int, slots: int) -> list[Counter[str]]:
    """Per-replica in-flight requests per adapter after the affinity router
    (`router.ranking`) placed workload (adapter -> requests in flight), one request of
    each adapter in turn, on a fleet of replicas with slots GPU adapter slots each."""
    loads = {f"r{i}": ReplicaLoad(f"r{i}", free_slots=slots) for i in range(replicas)}
    active: dict[str, Counter[str]] = {rid: Counter() for rid in loads}
    config, rng = RankingConfig(hot_queue_len=4, overload_queue_len=64), random.Random(0)
    for turn in range(max(workload.values())):
        for name in sorted(n for n, count in workload.items() if count > turn):
            rid = rank_replicas(name, list(loads.values()), config, rng)[0][0]
            active[rid][name] += 1
            gpu = frozenset(active[rid])
            free, queue = max(0, slots - len(gpu)), sum(active[rid].values())
            loads[rid] = ReplicaLoad(rid, gpu, free_slots=free, queue_len=queue)
    return list(active.values())


def summed_distinct(active: list[Counter[str]]) -> float:
    """The adapter signal before shares: each replica's distinct adapters, summed."""
    return float(sum(len(a) for a in active))


def summed_shares(active: list[Counter[str]]) -> float:
    """Each replica's adapter_share (copies: replicas where the adapter is active), summed."""
    copies = Counter(name for a in active for name in a)
    return sum(adapter_share(a, copies) for a in active)


def test_spread_copies_make_the_summed_signal_grow_with_the_fleet_but_not_the_shares():
    """A fixed workload: one hot adapter (40 requests in flight, 10x the router's hot
    queue length) and three cold ones, 2 slots per replica, 32 requests per replica, grow
    once 75% of the slots are needed. The router spreads the hot adapter over every
    replica, so the summed distinct adapters are 3 + replicas: each scale-up raises the
    demand that caused it and the fleet creeps from 3 to 6 replicas on a workload that
    never changed. The shares stay at the 4 distinct adapters (2.67 replicas), so the
    fleet holds at 3."""
    workload, slots, use = {"hot": 40, "c0": 2, "c1": 2, "c2": 2}, 2, 0.75
    fleets = range(1, 7)
    assert [summed_distinct(route(workload, n, slots)) for n in fleets] == [n + 3 for n in fleets]
    assert [summed_shares(route(workload, n, slots)) for n in fleets] == pytest.approx([4.0] * 6)

    def run_policy(signal, start: int, ticks: int = 6) -> list[int]:
        fleet = [start]
        for _ in range(ticks):
            n = fleet[-1]
            s = FleetSignals(n, 46.0, signal(route(workload, n, slots)), slots * n, 0.0, 0.0)
            d = decide(s, n, target_ongoing_requests=32, target_slot_use=use, kv_target=0.9)
            fleet.append(min(8, max(1, math.ceil(d.desired))))
        return fleet

    assert run_policy(summed_distinct, 3) == [3, 4, 5, 6, 6, 6, 6]
    assert run_policy(summed_shares, 3) == [3] * 7
    assert run_policy(summed_shares, 6) == [6, 3, 3, 3, 3, 3, 3]  # and back from too many


def test_no_custom_metrics_yet_falls_back_to_load():
    policy = LoraAutoscalingPolicy()
    for metrics in (None, {}):
        desired, state = policy(Ctx(2, metrics, ongoing=24))
        assert desired == pytest.approx(3.0) and state["lorafleet_reason"] == "load"


def test_zero_replicas_keeps_serves_target():
    assert LoraAutoscalingPolicy()(Ctx(0, None, ongoing=5, target=2)) == (2, {})


@pytest.mark.parametrize("kwargs", [{"target_slot_use": 0}, {"kv_target": 1.5}])
def test_bad_policy_kwargs_are_refused(kwargs):
    with pytest.raises(InvalidRequest, match=next(iter(kwargs))):
        LoraAutoscalingPolicy(**kwargs)


def test_replicas_report_every_metric_the_policy_reads():
    from replica.autoscaling_metrics import METRICS, autoscaling_metrics
    from replica.outputs import EngineStats

    stats = EngineStats(("a",), ("a", "b"), (), 1, 2, 3, 4, 0.25, 5, 0, 3)
    reported = autoscaling_metrics(stats, 1.5)
    assert tuple(reported) == METRICS
    assert reported == {
        "active_adapters": 3.0,
        "adapter_share": 1.5,
        "max_loras": 2.0,
        "kv_usage": 0.25,
        "waiting": 4.0,
    }
    # no share known (no registry, or it is unreachable): the replica's own count
    assert autoscaling_metrics(stats)["adapter_share"] == 3.0


def test_adapter_share_example():
    assert adapter_share({"a": 5, "b": 1}, {"a": 4, "b": 1}) == 1.25
    assert adapter_share({"a": 1}, {}) == 1.0  # not counted anywhere yet: this one alone
    assert adapter_share({}, {"a": 3}) == 0.0

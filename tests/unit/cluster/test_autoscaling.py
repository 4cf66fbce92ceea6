"""The LoRA autoscaling policy's decisions (pure; tests/integration/serve/test_autoscaling
runs it inside Serve's own wrapper and on a live cluster)."""

from __future__ import annotations

import pytest

from cluster.autoscaling import (
    FleetSignals,
    LoraAutoscalingPolicy,
    decide,
    fleet_signals,
)
from lora_core.errors import InvalidRequest


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
    reported = autoscaling_metrics(stats)
    assert tuple(reported) == METRICS
    assert reported == {"active_adapters": 3.0, "max_loras": 2.0, "kv_usage": 0.25, "waiting": 4.0}

"""The custom autoscaling metrics a replica reports (`LoraReplica.record_autoscaling_stats`).

Serve averages each over look_back_period_s and hands them, per replica, to the policy
on its controller (`cluster.autoscaling`, which reads them by these names). Torch-free
and Ray-free, so `cluster` can import the names: the contract lives with its producer.
"""

from __future__ import annotations

from replica.outputs import EngineStats

ACTIVE_ADAPTERS = "active_adapters"
MAX_LORAS = "max_loras"
KV_USAGE = "kv_usage"
WAITING = "waiting"
METRICS = (ACTIVE_ADAPTERS, MAX_LORAS, KV_USAGE, WAITING)


def autoscaling_metrics(stats: EngineStats) -> dict[str, float]:
    """EngineStats as the metrics named in METRICS."""
    return {
        ACTIVE_ADAPTERS: float(stats.active_adapters),
        MAX_LORAS: float(stats.max_loras),
        KV_USAGE: float(stats.kv_usage),
        WAITING: float(stats.num_waiting),
    }

"""Replica gauges exported through Ray's metrics (Prometheus: `ray_lorafleet_*`).

Updated from engine stats each time Serve polls routing stats, so dashboards see the
same numbers the router does. Serve adds deployment / replica / application tags.
"""

from __future__ import annotations

from ray.serve import metrics

from replica.outputs import EngineStats

GAUGES = {
    "adapter_loads": "GPU slot loads since the replica started",
    "gpu_adapters": "adapters resident in GPU slots",
    "cpu_adapters": "adapters in the CPU cache",
    "free_slots": "GPU adapter slots holding nothing",
    "queue_len": "requests running + waiting in the engine",
    "kv_usage": "fraction of KV blocks in use",
}


class ReplicaGauges:
    def __init__(self) -> None:
        self.gauges = {
            name: metrics.Gauge(f"lorafleet_{name}", description=desc)
            for name, desc in GAUGES.items()
        }

    def update(self, stats: EngineStats) -> None:
        values = {
            "adapter_loads": stats.adapter_loads,
            "gpu_adapters": len(stats.gpu_adapters),
            "cpu_adapters": len(stats.cpu_adapters),
            "free_slots": stats.free_slots,
            "queue_len": stats.num_running + stats.num_waiting,
            "kv_usage": stats.kv_usage,
        }
        for name, value in values.items():
            self.gauges[name].set(value)

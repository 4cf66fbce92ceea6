"""LoRA-aware replica autoscaling: the policy Serve's controller calls every tick.

Serve's default policy scales on ongoing requests alone. A LoRA fleet runs out of a
second resource first: GPU adapter slots. When the adapters that running and queued
requests need outnumber the slots, replicas swap adapters in and out (each swap a
CPU -> GPU copy, and requests wait for a slot) while the request count still looks
healthy, so the fleet stays small exactly when it thrashes. This policy takes the
largest of three demands:

    load     = ongoing requests / target_ongoing_requests
    adapters = distinct active adapters / (max_loras * target_slot_use)
    kv       = replicas * mean kv_usage / kv_target      (only while requests wait)

"distinct active adapters": adapters that running and queued requests use, counted once
however many replicas they run on. Each replica reports its share (`adapter_share`: for
every adapter its requests use, 1 / the number of live replicas where that adapter is
active, from the registry every publisher tick), and the shares sum to that count. A plain
sum of each replica's distinct adapters would count an adapter spread to k replicas k
times; the router spreads hot adapters further as the fleet grows, so that sum grows with
the fleet at a fixed workload and a load near the boundary feeds itself (more replicas ->
more copies -> more demand -> more replicas). The copies the router adds for load need
slots too, but they come with requests, which the load demand already counts. A replica
that reports no share (an older version, or no registry) counts its distinct adapters.

Serve wraps the returned figure with min/max_replicas, the up/downscale delays and
the scaling factors (`ray.serve.autoscaling_policy._apply_autoscaling_config`). This
module stays free of Ray: the policy reads the context by attribute, and replicas
report the metrics below from `LoraReplica.record_autoscaling_stats`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from lora_core.errors import InvalidRequest
from replica.autoscaling_metrics import (
    ACTIVE_ADAPTERS,
    ADAPTER_SHARE,
    KV_USAGE,
    MAX_LORAS,
    METRICS,
    WAITING,
)

# The policy runs inside Serve's controller, whose handlers hang on the "ray.serve" logger:
# a child of it lands in the controller's log (logs/serve/controller_*.log).
log = logging.getLogger("ray.serve.lorafleet.autoscaling")


class ScalingContext(Protocol):
    """The part of Serve's AutoscalingContext the policy reads."""

    current_num_replicas: int
    target_num_replicas: int
    total_num_requests: float
    aggregated_metrics: Mapping[str, Mapping[Any, float]] | None
    config: Any  # AutoscalingConfig: get_target_ongoing_requests()


@dataclass(frozen=True)
class FleetSignals:
    """What the replicas report, summed or averaged over the running ones.

    replicas: running replicas that reported metrics.
    ongoing: running + queued requests of the deployment (Serve's own count).
    active_adapters: distinct adapters the fleet's requests need (sum of the replicas'
        shares, see the module docstring).
    slots: sum over replicas of GPU adapter slots (max_loras).
    kv_usage: mean fraction of KV blocks in use.
    waiting: requests waiting in replica engines (not yet in a batch).
    """

    replicas: int
    ongoing: float
    active_adapters: float
    slots: float
    kv_usage: float
    waiting: float


@dataclass(frozen=True)
class Decision:
    """desired: replicas wanted before Serve's bounds and delays; reason: the signal
    that set it ("load", "adapters" or "kv"); demands: each signal's figure."""

    desired: float
    reason: str
    demands: dict[str, float]


def decide(
    s: FleetSignals,
    current: int,
    target_ongoing_requests: float,
    target_slot_use: float,
    kv_target: float,
) -> Decision:
    """The replicas the fleet needs for these signals (see the module docstring)."""
    demands = {"load": s.ongoing / target_ongoing_requests, "adapters": 0.0, "kv": 0.0}
    if s.replicas > 0 and s.slots > 0:
        # Slots per replica come from the reports, so a mixed fleet is averaged.
        slots_per_replica = s.slots / s.replicas
        demands["adapters"] = s.active_adapters / (slots_per_replica * target_slot_use)
    if s.waiting > 0:
        demands["kv"] = current * s.kv_usage / kv_target
    reason = max(demands, key=lambda k: demands[k])
    return Decision(desired=demands[reason], reason=reason, demands=demands)


def fleet_signals(ctx: ScalingContext) -> FleetSignals:
    """FleetSignals from Serve's context: custom metrics are per replica, averaged by
    Serve over look_back_period_s; replicas that have not reported yet are skipped, and a
    replica's adapter share falls back to its active adapters when it reports none."""
    metrics = ctx.aggregated_metrics or {}
    per = {name: dict(metrics.get(name) or {}) for name in METRICS}
    reported = set(per[MAX_LORAS])
    n = len(reported)

    def total(name: str) -> float:
        return float(sum(v for r, v in per[name].items() if r in reported))

    share, active = per[ADAPTER_SHARE], per[ACTIVE_ADAPTERS]
    adapters = sum(share.get(r, active.get(r, 0.0)) for r in reported)
    return FleetSignals(
        replicas=n,
        ongoing=float(ctx.total_num_requests),
        active_adapters=float(adapters),
        slots=total(MAX_LORAS),
        kv_usage=total(KV_USAGE) / n if n else 0.0,
        waiting=total(WAITING),
    )


class LoraAutoscalingPolicy:
    """Serve's `autoscaling_config.policy.policy_function` (a class: Serve builds it
    once with `policy_kwargs` and calls it every control-loop tick).

    target_slot_use: fraction of the fleet's GPU adapter slots that active adapters may
        fill before the fleet grows (1.0 = grow only once they are all needed).
    kv_target: mean KV-cache use above which the fleet grows while requests wait.
    """

    def __init__(self, target_slot_use: float = 1.0, kv_target: float = 0.9) -> None:
        for name, value in (("target_slot_use", target_slot_use), ("kv_target", kv_target)):
            if not 0.0 < value <= 1.0:
                raise InvalidRequest(f"{name}={value}; allowed: 0 < {name} <= 1")
        self.target_slot_use = target_slot_use
        self.kv_target = kv_target
        self._last_logged: tuple[int, int, str] | None = None

    def __call__(self, ctx: ScalingContext) -> tuple[float, dict[str, Any]]:
        current = ctx.current_num_replicas
        if current == 0:
            return ctx.target_num_replicas, {}
        d = decide(
            fleet_signals(ctx),
            current,
            ctx.config.get_target_ongoing_requests(),
            self.target_slot_use,
            self.kv_target,
        )
        want = (current, math.ceil(d.desired), d.reason)
        if want != self._last_logged:
            # Serve ticks every 0.1 s; log when the wish changes, not on every tick.
            self._last_logged = want
            # the replicas wanted as a whole number: a desired 1.001 asks for 2, which
            # "%.2f" alone would print as 1.00
            log.info(
                "lorafleet autoscaling: %d replicas, want %d (%s; desired %.3f; %s)",
                *want,
                d.desired,
                ", ".join(f"{k} {v:.2f}" for k, v in d.demands.items()),
            )
        return d.desired, {"lorafleet_reason": d.reason}

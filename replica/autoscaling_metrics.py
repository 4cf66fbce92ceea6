"""The custom autoscaling metrics a replica reports (`LoraReplica.record_autoscaling_stats`).

Serve averages each over look_back_period_s and hands them, per replica, to the policy
on its controller (`cluster.autoscaling`, which reads them by these names). Torch-free
and Ray-free, so `cluster` can import the names: the contract lives with its producer.

ACTIVE_ADAPTERS: distinct adapters among the replica's running and waiting requests.
ADAPTER_SHARE: this replica's share of the fleet's distinct active adapters: the sum,
    over the adapters its requests use, of 1 / the number of live replicas of its
    deployment where that adapter is active (`adapter_share`; the counts come from the
    registry every publisher tick). Summed over the deployment's replicas (what the
    policy sees) it is the number of distinct active adapters,
    however far the router spread them. A replica without counts (no registry, or
    unreachable) reports ACTIVE_ADAPTERS here, which errs toward more replicas.
MAX_LORAS: GPU adapter slots. KV_USAGE: fraction of KV blocks in use.
WAITING: requests waiting in the engine (not yet in a batch).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from replica.outputs import EngineStats

ACTIVE_ADAPTERS = "active_adapters"
ADAPTER_SHARE = "adapter_share"
MAX_LORAS = "max_loras"
KV_USAGE = "kv_usage"
WAITING = "waiting"
METRICS = (ACTIVE_ADAPTERS, ADAPTER_SHARE, MAX_LORAS, KV_USAGE, WAITING)


def autoscaling_metrics(stats: EngineStats, adapter_share: float | None = None) -> dict[str, float]:
    """EngineStats and the registry-derived share (None: unknown) as the METRICS."""
    share = float(stats.active_adapters) if adapter_share is None else adapter_share
    return {
        ACTIVE_ADAPTERS: float(stats.active_adapters),
        ADAPTER_SHARE: share,
        MAX_LORAS: float(stats.max_loras),
        KV_USAGE: float(stats.kv_usage),
        WAITING: float(stats.num_waiting),
    }


def adapter_share(in_flight: Mapping[str, int], copies: Mapping[str, int]) -> float:
    """Sum over the adapters in in_flight of 1 / copies[name] (live replicas where name is
    active, this one included; a missing or 0 count means this one alone).

    Example: in_flight {"a": 5, "b": 1}, copies {"a": 4, "b": 1} -> 0.25 + 1 = 1.25; the
    three other replicas where "a" is active add 0.25 each, so "a" counts once in all.
    """
    return sum(1.0 / max(1, copies.get(name, 1)) for name in in_flight)


class InFlight:
    """Requests in flight on this replica per adapter name (from arrival to the last
    output). Plain dict arithmetic on the event loop: nothing on the request path waits.

    Example: start("a"); start("a"); start("b"); done("a") -> counts() == {"a": 1, "b": 1}.
    """

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def start(self, name: str) -> None:
        self._counts[name] += 1

    def done(self, name: str) -> None:
        self._counts[name] -= 1
        if self._counts[name] <= 0:
            del self._counts[name]

    def counts(self) -> dict[str, int]:
        """Adapter name -> requests in flight (names with none are left out)."""
        return dict(self._counts)

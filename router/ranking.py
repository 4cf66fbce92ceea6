"""LoRA-affinity ranking of replicas (pure: no Ray, no Redis; clock and RNG injected).

Tiers, best first, for a request naming adapter key K:
  0. replicas holding K in a GPU slot that are not overloaded
     (+ one extra replica when every holder is hot: hot adapters spread);
  1. replicas holding K in the CPU cache, not overloaded, with a free GPU slot;
  2. among the other non-overloaded replicas with the most free slots / fewest
     adapters, the adapter's rendezvous-hash "home" alone, then the rest;
  3. replicas holding K in the CPU cache with every GPU slot taken (K would evict
     another adapter), not overloaded;
  4. any replica not offered yet.
Tiers 2 and 3 swap when no other replica has a free slot either: then a CPU copy
beats a disk read. A CPU-cache holder with no free slot would swap adapters on every
step while a replica with free slots (e.g. one the autoscaler just added for adapter
demand) stays idle, so the free slot comes first.
Inside a tier, power-of-two choices: two random members, the shorter queue first. The
choices of one request (the same `group`) take their two by rendezvous hash of the group
instead (queue lengths in buckets first, as for a cold adapter's home), one after the
other, so they land together on one replica, where its scheduler computes their shared
prompt once, unless that replica is clearly busier than the others.
The caller (Serve's router loop) tries each tier in order and skips replicas whose
queue is full, so there is never a fixed wait for a matching replica.

"Holds K" merges three sources, because each lags in its own way: the replica's
routing stats (periodic), the registry's residency (from the request's resolution),
and `AffinityMemory`, this router's own recent decisions, which bridges the time
until a fresh load shows up in stats.

Worked example (overload 8, hot 4): replicas a(q=5, gpu={K}), b(q=0, 2 free slots),
c(q=1, cpu={K}, 1 free slot). Holders {a, c} are not all hot (c has q=1 < 4), so no
spreading: tier0 = [a], tier1 = [c], tier2 = [b]. With c at q=6 as well, b joins tier0:
[b, a]. With c's slots all taken, b comes before c: [a], [b], [c].
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lora_core.errors import InvalidRequest

GPU = "gpu"
CPU = "cpu"


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows about one replica.

    replica_id: Serve's replica unique id (the same id the replica registers under).
    gpu_adapters / cpu_adapters: AdapterRef.key of adapters in GPU slots / CPU cache.
    free_slots: GPU adapter slots holding nothing.
    queue_len: requests running + waiting on the replica.
    kv_usage: fraction of KV blocks in use (0..1).
    stats_time: wall-clock time the replica took its stats (0 = no stats yet).
    """

    replica_id: str
    gpu_adapters: frozenset[str] = frozenset()
    cpu_adapters: frozenset[str] = frozenset()
    free_slots: int = 0
    queue_len: int = 0
    kv_usage: float = 0.0
    stats_time: float = 0.0


@dataclass(frozen=True)
class RankingConfig:
    """Thresholds of the ranking.

    overload_queue_len: a replica with at least this many queued requests, or with
        kv_usage >= overload_kv_usage, is skipped in the affinity tiers.
    overload_kv_usage: KV fraction at which a replica counts as overloaded.
    hot_queue_len: when every holder of an adapter has at least this many queued
        requests, the best other replica joins tier 0 (the adapter spreads).
    affinity_ttl_s: how long a routing decision counts as "replica holds adapter".
    stats_lag_s: a decision this much older than a replica's stats is superseded by
        them (the stats would show the adapter if it had been loaded).
    """

    overload_queue_len: int = 32
    overload_kv_usage: float = 0.95
    hot_queue_len: int = 8
    affinity_ttl_s: float = 30.0
    stats_lag_s: float = 5.0

    def __post_init__(self) -> None:
        if self.overload_queue_len < 1:
            raise InvalidRequest(f"overload_queue_len={self.overload_queue_len}; allowed: >= 1")
        if not 1 <= self.hot_queue_len <= self.overload_queue_len:
            raise InvalidRequest(
                f"hot_queue_len={self.hot_queue_len}; allowed: 1 <= hot_queue_len <= "
                f"overload_queue_len ({self.overload_queue_len})"
            )
        if not 0.0 < self.overload_kv_usage <= 1.0:
            raise InvalidRequest(f"overload_kv_usage={self.overload_kv_usage}; allowed: (0, 1]")
        if self.affinity_ttl_s <= 0 or self.stats_lag_s < 0:
            raise InvalidRequest("affinity_ttl_s must be > 0 and stats_lag_s >= 0")


@dataclass
class AffinityMemory:
    """The router's recent decisions: adapter key -> {replica_id: time last routed there}.

    Example: record("k", "r1") at t=10 -> holders("k") == {"r1": 10.0} until t=10+ttl.
    """

    ttl_s: float = 30.0
    clock: Callable[[], float] = time.time
    _routed: dict[str, dict[str, float]] = field(default_factory=dict)

    def record(self, adapter_key: str, replica_id: str) -> None:
        self._routed.setdefault(adapter_key, {})[replica_id] = self.clock()

    def holders(self, adapter_key: str) -> dict[str, float]:
        """Replicas this router sent `adapter_key` to within the TTL, with the time."""
        now = self.clock()
        routed = self._routed.get(adapter_key, {})
        live = {rid: t for rid, t in routed.items() if now - t <= self.ttl_s}
        if live:
            self._routed[adapter_key] = live
        else:
            self._routed.pop(adapter_key, None)
        return live

    def forget_replica(self, replica_id: str) -> None:
        for routed in self._routed.values():
            routed.pop(replica_id, None)


def rank_replicas(
    adapter_key: str | None,
    replicas: Sequence[ReplicaLoad],
    config: RankingConfig,
    rng: random.Random,
    remembered: Mapping[str, float] | None = None,
    registry_tiers: Mapping[str, str] | None = None,
    group: str | None = None,
) -> list[list[str]]:
    """Rank `replicas` for one request; returns tiers of replica ids, best first.

    adapter_key: AdapterRef.key of the request's adapter, or None for the base model.
    remembered: AffinityMemory.holders(adapter_key).
    registry_tiers: replica_id -> "gpu" | "cpu" residency from the registry.
    group: shared by the choices of one request (None: a request of its own).
    Each returned list holds at most two ids (power of two), shorter queue first;
    empty tiers are left out, and no id appears twice.
    """
    if not replicas:
        return []
    free = [r for r in replicas if not _overloaded(r, config)]
    if adapter_key is None:
        tiers = [free]
    else:
        tiers = _affinity_tiers(adapter_key, free, config, remembered or {}, registry_tiers or {})
    out: list[list[str]] = []
    offered: set[str] = set()
    bucket = max(1, config.hot_queue_len // 2)
    for tier in tiers:
        _offer(tier, out, offered, rng, group, bucket)
    _offer(list(replicas), out, offered, rng, group, bucket)
    return out


def _affinity_tiers(
    key: str,
    free: list[ReplicaLoad],
    config: RankingConfig,
    remembered: Mapping[str, float],
    registry_tiers: Mapping[str, str],
) -> list[list[ReplicaLoad]]:
    gpu = [r for r in free if _holds_on_gpu(r, key, config, remembered, registry_tiers)]
    gpu_ids = {r.replica_id for r in gpu}
    cpu = [
        r
        for r in free
        if r.replica_id not in gpu_ids
        and (key in r.cpu_adapters or registry_tiers.get(r.replica_id) == CPU)
    ]
    holders = gpu + cpu
    others = [r for r in free if r not in holders]
    spare = _home_first(key, _best_spare(others), max(1, config.hot_queue_len // 2))
    if spare and spare[0].free_slots > 0:
        cpu_room = [r for r in cpu if r.free_slots > 0]
        cpu_full = [r for r in cpu if r.free_slots == 0]
    else:
        cpu_room, cpu_full = cpu, []
    if holders and spare and all(r.queue_len >= config.hot_queue_len for r in holders):
        return [gpu + spare[:1], cpu_room, spare[1:], cpu_full]
    return [gpu, cpu_room, spare[:1], spare[1:], cpu_full]


def _home_first(key: str, spare: list[ReplicaLoad], bucket: int) -> list[ReplicaLoad]:
    """Spares by queue length in buckets of `bucket`, then by rendezvous hash of
    (key, replica): a cold adapter starts on its "home" replica unless the home is
    clearly busier, so the adapter set partitions across replicas instead of every
    replica cycling through every adapter, without piling load on one replica. Also
    orders a tier for the choices of one request (key: their group)."""

    def order(r: ReplicaLoad) -> tuple[int, bytes]:
        home = hashlib.blake2b(f"{key}|{r.replica_id}".encode()).digest()
        return (r.queue_len // bucket, bytes(255 - b for b in home))

    return sorted(spare, key=order)


def _holds_on_gpu(
    r: ReplicaLoad,
    key: str,
    config: RankingConfig,
    remembered: Mapping[str, float],
    registry_tiers: Mapping[str, str],
) -> bool:
    if key in r.gpu_adapters or registry_tiers.get(r.replica_id) == GPU:
        return True
    if key in r.cpu_adapters or registry_tiers.get(r.replica_id) == CPU:
        # Seen in the CPU cache since: whatever was routed there earlier has been
        # loaded and evicted again, so memory of that routing no longer means "in GPU".
        return False
    routed_at = remembered.get(r.replica_id)
    if routed_at is None:
        return False
    if r.stats_time > routed_at and r.queue_len == 0:
        # Idle in stats taken after that routing: whatever it loaded would show by now.
        return False
    return routed_at >= r.stats_time - config.stats_lag_s


def _best_spare(others: list[ReplicaLoad]) -> list[ReplicaLoad]:
    """Replicas with the most free slots, then the fewest adapters; shortest queue first."""
    if not others:
        return []

    def room(r: ReplicaLoad) -> tuple[int, int]:
        return (-r.free_slots, len(r.gpu_adapters))

    best = min(room(r) for r in others)
    return sorted((r for r in others if room(r) == best), key=lambda r: r.queue_len)


def _overloaded(r: ReplicaLoad, config: RankingConfig) -> bool:
    return r.queue_len >= config.overload_queue_len or r.kv_usage >= config.overload_kv_usage


def _offer(
    tier: list[ReplicaLoad],
    out: list[list[str]],
    offered: set[str],
    rng: random.Random,
    group: str | None,
    bucket: int,
) -> None:
    """Append a power-of-two pair drawn from the not-yet-offered members of `tier`. For a
    request of a group: the group's first two by rendezvous hash, each a rank of its own
    (Serve sends to the shortest queue within a rank, which would split the group)."""
    fresh = [r for r in tier if r.replica_id not in offered]
    if not fresh:
        return
    if group is not None:
        for r in _home_first(group, fresh, bucket)[:2]:
            out.append([r.replica_id])
            offered.add(r.replica_id)
        return
    # drawn even from two, so equal queues tie in random order (Serve sends to the first
    # of the shortest probed queues: a fixed order sent every burst to one replica)
    pair = rng.sample(fresh, min(2, len(fresh)))
    pair.sort(key=lambda r: r.queue_len)
    out.append([r.replica_id for r in pair])
    offered.update(r.replica_id for r in pair)

"""The LoRA-affinity Serve `RequestRouter` (thin: the policy is `router.ranking`).

Configured on the replica deployment via
`RequestRouterConfig(request_router_class="router.request_router:LoraAffinityRouter")`.
It reads each replica's routing stats (`replica.deployment.stats_dict`), Serve's
own queue-length cache, and the registry residency that the ingress attached to the
request (`GenerateCall.residency`), and remembers its own recent decisions.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from replica.serve_protocol import GenerateCall
from router.ranking import AffinityMemory, RankingConfig, ReplicaLoad, rank_replicas


def load_of(replica_id: str, stats: dict[str, Any], cached_queue_len: int | None) -> ReplicaLoad:
    """A ReplicaLoad from routing stats; Serve's queue-length cache, when fresher, wins."""
    queue = int(stats.get("queue_len", 0))
    if cached_queue_len is not None:
        queue = max(queue, cached_queue_len)
    return ReplicaLoad(
        replica_id=replica_id,
        gpu_adapters=frozenset(stats.get("gpu", ())),
        cpu_adapters=frozenset(stats.get("cpu", ())),
        free_slots=int(stats.get("free_slots", 0)),
        queue_len=queue,
        kv_usage=float(stats.get("kv_usage", 0.0)),
        stats_time=float(stats.get("time", 0.0)),
    )


def call_of(pending: PendingRequest | None) -> GenerateCall | None:
    if pending is None:
        return None
    for arg in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(arg, GenerateCall):
            return arg
    return None


class LoraAffinityRouter(RequestRouter):
    """Routes each GenerateCall by `rank_replicas`; other calls by power of two."""

    def initialize_state(
        self,
        overload_queue_len: int = 32,
        hot_queue_len: int = 8,
        affinity_ttl_s: float = 30.0,
        seed: int | None = None,
    ) -> None:
        self.ranking = RankingConfig(
            overload_queue_len=overload_queue_len,
            hot_queue_len=hot_queue_len,
            affinity_ttl_s=affinity_ttl_s,
        )
        self.memory = AffinityMemory(ttl_s=affinity_ttl_s)
        self.rng = random.Random(seed)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Serve calls initialize_state again with request_router_kwargs right after.
        self.initialize_state()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Every tier is offered in one go; when all are full, back off before retrying.
            pending_request.routing_context.should_backoff = True
        call = call_of(pending_request)
        key = call.adapter_key if call else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = [
            load_of(rid, r.routing_stats or {}, self.replica_queue_len_cache.get(r.replica_id))
            for rid, r in by_id.items()
        ]
        remembered = self.memory.holders(key) if key else None
        tiers = rank_replicas(
            key,
            loads,
            self.ranking,
            self.rng,
            remembered,
            dict(call.residency) if call else None,
            call.group if call else None,
        )
        return [[by_id[rid] for rid in tier] for tier in tiers]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        call = call_of(pending_request)
        if call is not None and call.adapter_key is not None:
            self.memory.record(call.adapter_key, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.memory.forget_replica(replica_id.unique_id)

"""The replica deployment: a thin Ray Serve shell around `AsyncEngine`.

- `generate` streams RequestOutputs for one GenerateCall (a consumer that stops
  iterating, or a cancelled request, aborts it in the engine).
- `check_health` looks at local state only: a Redis outage must not fail every
  replica of the cluster at once.
- `record_routing_stats` feeds the LoRA-affinity request router (and the
  `ray_lorafleet_*` gauges of `replica.serve_metrics`).
- `record_autoscaling_stats` feeds `cluster.autoscaling.LoraAutoscalingPolicy` (adapter
  slot demand as this replica's share of the fleet's active adapters, KV use, queued
  requests) when the deployment autoscales; `InFlight` counts requests per adapter for it.
- A background `RegistryPublisher` holds the registry lease and publishes residency.
- Shutdown: Serve stops routing here and waits for in-flight requests
  (graceful_shutdown_timeout_s); `__del__` then deregisters and stops the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from lora_core.errors import InvalidRequest
from lora_core.identity import AdapterRef
from lora_core.serve_logging import install_log_filters
from replica.autoscaling_metrics import InFlight, autoscaling_metrics
from replica.config import EngineConfig
from replica.outputs import EngineStats, RequestOutput
from replica.serve_metrics import DEFAULT_MAX_MODELS, ReplicaGauges, RequestCounters
from replica.serve_protocol import GenerateCall, check_version
from replica.serve_registry import PublisherConfig, RegistryPublisher

log = logging.getLogger("lorafleet.replica")


@dataclass(frozen=True)
class ReplicaSettings:
    """Everything one replica needs, validated by the builder.

    engine: the engine configuration.
    redis_url: the registry ("" = run without a registry).
    namespace: the registry namespace.
    pool: prefill | decode | mixed.
    served_model_name: the base model's id in requests and metrics ("" = the model
        directory's name).
    registry_tick_s / lease_ttl_s: heartbeat period and lease lifetime.
    metrics_max_models: adapters the request counters name before they count the rest
        under model="(other)" (`replica.serve_metrics.ModelLabels`).
    log_filters: filters added to Ray Serve's logger in the replica's process. Serve logs
        every error a replica raises as ERROR with its traceback ("Request failed."); the
        builder passes `router.serve_logs.ClientErrorFilter`, so a client's error found
        only here (a request that does not fit the KV cache, every slot busy) logs one
        INFO line, as the ingress logs it.
    """

    engine: EngineConfig
    redis_url: str = field(default="", repr=False)  # may hold a password: kept out of reprs
    namespace: str = "lorafleet"
    pool: str = "mixed"
    served_model_name: str = ""
    registry_tick_s: float = 1.0
    lease_ttl_s: float = 5.0
    metrics_max_models: int = DEFAULT_MAX_MODELS
    log_filters: tuple[logging.Filter, ...] = ()

    def __post_init__(self) -> None:
        if self.registry_tick_s <= 0 or self.lease_ttl_s <= self.registry_tick_s:
            raise InvalidRequest(
                f"registry_tick_s={self.registry_tick_s}, lease_ttl_s={self.lease_ttl_s}; "
                "allowed: 0 < registry_tick_s < lease_ttl_s"
            )


def stats_dict(stats: EngineStats, now: float) -> dict[str, Any]:
    """EngineStats as Serve routing stats (read back by router.request_router.load_of)."""
    return {
        "gpu": list(stats.gpu_adapters),
        "cpu": list(stats.cpu_adapters),
        "free_slots": stats.free_slots,
        "max_loras": stats.max_loras,
        "queue_len": stats.num_running + stats.num_waiting,
        "kv_usage": stats.kv_usage,
        "adapter_loads": stats.adapter_loads,
        "prefix_hit_tokens": stats.prefix_hit_tokens,
        "computed_tokens": stats.computed_tokens,
        "time": now,
    }


class LoraReplica:
    """One serving replica (see the module docstring)."""

    async def __init__(self, settings: ReplicaSettings):
        from replica.async_engine import AsyncEngine

        self.settings = settings
        install_log_filters(settings.log_filters)
        self.refs: dict[str, AdapterRef] = {}
        self.newest: dict[str, int] = {}
        self.in_flight = InFlight()
        self.publisher: RegistryPublisher | None = None
        self._task: asyncio.Task | None = None
        self.engine = None
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = AsyncEngine(settings.engine)
        self.base_name = settings.served_model_name or self.engine.model_name
        self.gauges = ReplicaGauges()
        self.counters = RequestCounters(self.base_name, settings.metrics_max_models)
        if settings.redis_url:
            self._start_publisher(settings)

    def _start_publisher(self, settings: ReplicaSettings) -> None:
        from cluster.registry import AsyncRegistry

        registry = AsyncRegistry(settings.redis_url, settings.namespace)
        config = PublisherConfig(
            replica_id=self.replica_id,
            deployment=serve.get_replica_context().deployment,
            pool=settings.pool,
            tick_s=settings.registry_tick_s,
            lease_ttl_s=settings.lease_ttl_s,
        )
        self.publisher = RegistryPublisher(
            config,
            registry,
            self.engine,
            self.refs,
            in_flight=self.in_flight,
            newest_version=self.newest,
        )
        self._task = asyncio.get_running_loop().create_task(self.publisher.run())

    async def generate(self, call: GenerateCall) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (engine errors raise before the first)."""
        if call.adapter is not None:
            check_version(call.adapter, self.newest)
            self.refs[call.adapter.key] = call.adapter
        params, adapter = call.params, call.adapter
        ids = list(call.prompt_token_ids)
        model = adapter.name if adapter is not None else self.base_name
        last, reason = None, "error"
        if adapter is not None:
            self.in_flight.start(adapter.name)
        try:
            outputs = self.engine.generate(
                call.request_id, ids, params, adapter, call.cache_salt, call.group
            )
            async for out in outputs:
                last = out
                yield out
            reason = last.finish_reason if last is not None else "error"
        except (GeneratorExit, asyncio.CancelledError):
            reason = "abort"
            raise
        finally:
            if adapter is not None:
                self.in_flight.done(adapter.name)
            self.counters.record(model, reason, last)

    async def load_adapter(self, ref: AdapterRef, to_gpu: bool = False) -> str:
        """Validate and load `ref` here (admin / benchmarks); returns its key."""
        self.refs[ref.key] = ref
        await self.engine.load_adapter(ref, to_gpu=to_gpu)
        return ref.key

    async def unload_adapter(self, name: str) -> None:
        await self.engine.unload_adapter(name)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def replica_info(self) -> dict[str, Any]:
        """Who this is (tests and `lorafleet status` map Serve replicas to registry ids)."""
        return {
            "replica_id": self.replica_id,
            "stats": stats_dict(self.engine.stats(), time.time()),
        }

    async def record_routing_stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        self.gauges.update(stats)
        return stats_dict(stats, time.time())

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The custom metrics `cluster.autoscaling` reads (Serve averages them over
        look_back_period_s and hands them to the policy on the controller)."""
        share = self.publisher.adapter_share if self.publisher is not None else None
        return autoscaling_metrics(self.engine.stats(), share)

    async def check_health(self) -> None:
        """Local only: the engine must answer and have all its parts (tensor-parallel
        workers); the registry's state is not consulted."""
        self.engine.stats()
        self.engine.engine.check_health()
        if self._task is not None and self._task.done() and not self._task.cancelled():
            raise RuntimeError(f"registry publisher stopped: {self._task.exception()!r}")

    async def __del__(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # let the cancel land first: a tick still in flight could otherwise register
            # this replica again right after it deregistered
            await asyncio.wait([self._task], timeout=2.0)
        if self.publisher is not None:
            try:
                await asyncio.wait_for(self.publisher.deregister(), timeout=2.0)
            except Exception as e:
                log.warning(
                    "deregistering %s failed (%s); its lease will lapse", self.replica_id, e
                )
        if self.engine is not None:
            self.engine.shutdown()


ReplicaDeployment = serve.deployment(
    LoraReplica,
    name="LoraReplica",
    graceful_shutdown_timeout_s=30.0,
    graceful_shutdown_wait_loop_s=0.5,
    health_check_period_s=5.0,
)

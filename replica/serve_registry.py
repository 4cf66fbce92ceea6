"""A replica's side of the registry: lease, residency publishing, pin/warm following.

Runs as one background task per replica. Every tick it renews the lease (registering
again, with a new epoch, when the lease was lost), publishes the difference between
what the engine holds and what it last published, and applies desired-state changes
(pins, warm targets, draining adapters). Any registry error is logged and retried on
the next tick: a Redis outage never stops serving and never fails health checks,
it only makes this replica's registry entries go stale until Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from lora_core.errors import LoraFleetError, StaleEpoch
from lora_core.identity import AdapterRef
from replica.outputs import EngineStats

log = logging.getLogger("lorafleet.replica")


@dataclass(frozen=True)
class PublisherConfig:
    """replica_id: Serve's replica unique id. pool: prefill | decode | mixed.
    deployment: the Serve deployment name. tick_s: seconds between ticks.
    lease_ttl_s: lease lifetime (several ticks, so one slow tick does not drop it)."""

    replica_id: str
    deployment: str
    pool: str = "mixed"
    tick_s: float = 1.0
    lease_ttl_s: float = 5.0


def residency(stats: EngineStats) -> dict[str, str]:
    """AdapterRef.key -> "gpu" | "cpu" (a GPU-resident adapter is also in the CPU cache)."""
    out = {key: "cpu" for key in stats.cpu_adapters}
    out.update({key: "gpu" for key in stats.gpu_adapters})
    return out


class Registry(Protocol):
    """The part of `cluster.registry.AsyncRegistry` a replica uses."""

    async def register_replica(
        self, replica_id: str, pool: str, deployment: str, slot_capacity: int, ttl_s: float
    ) -> int: ...
    async def heartbeat(self, replica_id: str, epoch: int, ttl_s: float) -> bool: ...
    async def report_resident(
        self, replica_id: str, epoch: int, adapter: AdapterRef, tier: str
    ) -> None: ...
    async def remove_resident(self, replica_id: str, epoch: int, adapter: str) -> bool: ...
    async def desired_state(self) -> Any: ...
    async def locations(self, name: str) -> Any: ...


class Engine(Protocol):
    """The part of `replica.async_engine.AsyncEngine` the publisher drives."""

    def stats(self) -> EngineStats: ...
    async def load_adapter(self, ref: AdapterRef, to_gpu: bool = False) -> None: ...
    async def unload_adapter(self, name: str) -> None: ...
    def pin(self, ref: AdapterRef) -> None: ...
    def unpin(self, name: str) -> None: ...


@dataclass
class RegistryPublisher:
    """Keeps the registry's view of one replica in step with its engine.

    registry: a `cluster.registry.AsyncRegistry`.
    engine: the replica's AsyncEngine.
    refs: AdapterRef by key for every adapter the replica has seen (filled by the
        deployment as requests arrive; the engine's stats carry keys only).
    """

    config: PublisherConfig
    registry: Registry
    engine: Engine
    refs: dict[str, AdapterRef]
    epoch: int | None = None
    healthy_registry: bool = False
    published: dict[str, str] = field(default_factory=dict)
    desired_version: int = -1
    pinned: set[str] = field(default_factory=set)
    newest_version: dict[str, int] = field(default_factory=dict)

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
                self._set_registry_health(True)
            except asyncio.CancelledError:
                raise
            except StaleEpoch:
                self.epoch = None  # fenced off: register again as a new incarnation
            except Exception as e:
                self._set_registry_health(False, e)
            await asyncio.sleep(self.config.tick_s)

    def _set_registry_health(self, ok: bool, err: Exception | None = None) -> None:
        if ok != self.healthy_registry:
            if ok:
                log.info("registry reachable again; replica %s in sync", self.config.replica_id)
            else:
                log.warning("registry unreachable (%s); serving on, will retry", err)
        self.healthy_registry = ok

    async def tick(self) -> None:
        reg, cfg = self.registry, self.config
        if self.epoch is None or not await reg.heartbeat(
            cfg.replica_id, self.epoch, cfg.lease_ttl_s
        ):
            stats = self.engine.stats()
            self.epoch = await reg.register_replica(
                cfg.replica_id, cfg.pool, cfg.deployment, stats.max_loras, cfg.lease_ttl_s
            )
            self.published = {}
        await self.publish(self.engine.stats())
        await self.follow_desired()

    async def publish(self, stats: EngineStats) -> None:
        now = residency(stats)
        reg, rid = self.registry, self.config.replica_id
        for key, tier in now.items():
            if self.published.get(key) != tier and key in self.refs:
                await reg.report_resident(rid, self.epoch, self.refs[key], tier)
                self.published[key] = tier
        for key in [k for k in self.published if k not in now]:
            ref = self.refs.get(key)
            if ref is not None:
                await reg.remove_resident(rid, self.epoch, ref.name)
            del self.published[key]

    async def follow_desired(self) -> None:
        state = await self.registry.desired_state()
        if state.version == self.desired_version:
            return
        for name, ref in state.refs.items():
            self.refs[ref.key] = ref
            self.newest_version[name] = max(ref.version, self.newest_version.get(name, 0))
        try:
            await self._apply_pins(state)
            await self._apply_warm(state)
            for name in state.draining:
                await self.engine.unload_adapter(name)
                self.pinned.discard(name)
        except LoraFleetError as e:
            # The engine refused (no evictable slot, bad adapter): retry next tick.
            log.warning("desired state %d not applied yet: %s", state.version, e)
            return
        self.desired_version = state.version

    async def _apply_pins(self, state) -> None:
        for name in state.pins:
            ref = state.refs.get(name)
            if ref is not None and name not in self.pinned:
                await self.engine.load_adapter(ref, to_gpu=True)
                self.engine.pin(ref)
                self.pinned.add(name)
        for name in [n for n in self.pinned if n not in state.pins]:
            self.engine.unpin(name)
            self.pinned.discard(name)

    async def _apply_warm(self, state) -> None:
        held = residency(self.engine.stats())
        for name, target in state.warm.items():
            ref = state.refs.get(name)
            if ref is None or held.get(ref.key) == "gpu":
                continue
            locations = await self.registry.locations(name)
            on_gpu = sum(1 for loc in locations if loc.tier == "gpu")
            if on_gpu < target.replicas:
                await self.engine.load_adapter(ref, to_gpu=True)

    async def deregister(self) -> None:
        """Best effort on shutdown: drop residency so routers stop sending here at once."""
        if self.epoch is None:
            return
        for key in list(self.published):
            ref = self.refs.get(key)
            if ref is not None:
                await self.registry.remove_resident(self.config.replica_id, self.epoch, ref.name)
        self.published = {}

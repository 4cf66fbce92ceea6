"""A replica's side of the registry: lease, residency publishing, demand reports.

Runs as one background task per replica. Every tick it renews the lease (registering
again, with a new epoch, when the lease was lost), publishes the difference between what
the engine holds and what it last published, reports the adapters its requests use (and
reads back on how many replicas each is active: the autoscaling `adapter_share`), and
has its `replica.desired_state.DesiredFollower` apply desired-state changes (pins, warm
targets through atomic claims, draining adapters; on the first tick, the fleet's hottest
adapters into free GPU slots: `PublisherConfig.prefetch`), and every `reap_every` ticks it reaps replicas whose lease
lapsed (crashed ones), so no operator has to. Beside the ticks a keep-alive task renews
the lease every tick on its own: a tick that waits for adapter loads (pins, warm targets,
prefetch) can take longer than the lease, which then lapsed and took the replica out of
routing while it was still serving. Any registry error is logged and retried
on the next tick: a Redis outage never stops serving and never fails health checks, it
only makes this replica's registry entries go stale until Redis is back. On shutdown
`deregister` removes this replica's record at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol

from lora_core.aio import raise_if_cancelled
from lora_core.errors import AdapterNotFound, StaleEpoch
from lora_core.identity import AdapterRef
from replica.autoscaling_metrics import InFlight, adapter_share
from replica.desired_state import DesiredFollower, DesiredRegistry, Engine, residency
from replica.outputs import EngineStats

log = logging.getLogger("lorafleet.replica")


@dataclass(frozen=True)
class PublisherConfig:
    """replica_id: Serve's replica unique id. pool: prefill | decode | mixed.
    deployment: the Serve deployment name. tick_s: seconds between ticks.
    lease_ttl_s: lease lifetime (several ticks, so one slow tick does not drop it).
    reap_every: ticks between reaps of lapsed replicas (>= 1; every live replica reaps,
        so a crashed one leaves the registry within about lease_ttl_s + reap_every ticks).
    warm_claim_s: how long a claim on a warm copy keeps other replicas from loading one
        (it ends earlier when this replica reports the copy, or its lease lapses); a load
        that takes longer may let one more replica load a copy. Prefetch claims last as
        long (while one lasts, other starting replicas count it as a copy).
    prefetch: on its first tick, after pins and warm targets, load the fleet's adapters
        with the most requests in flight per copy into free GPU slots (all but one of
        them, at least one), so a replica the autoscaler adds takes load at once instead
        of when traffic happens to find it.
    """

    replica_id: str
    deployment: str
    pool: str = "mixed"
    tick_s: float = 1.0
    lease_ttl_s: float = 5.0
    reap_every: int = 10
    warm_claim_s: float = 10.0
    prefetch: bool = True

    def __post_init__(self) -> None:
        if self.reap_every < 1:
            raise ValueError(f"reap_every={self.reap_every}; allowed: >= 1 (ticks)")
        if not 0.01 <= self.warm_claim_s <= 3600:
            raise ValueError(f"warm_claim_s={self.warm_claim_s}; allowed: 0.01 .. 3600 seconds")


class Registry(DesiredRegistry, Protocol):
    """The part of `cluster.registry.AsyncRegistry` a replica uses."""

    async def register_replica(
        self, replica_id: str, pool: str, deployment: str, slot_capacity: int, ttl_s: float
    ) -> int: ...
    async def heartbeat(self, replica_id: str, epoch: int, ttl_s: float) -> bool: ...
    async def report_resident(
        self, replica_id: str, epoch: int, adapter: AdapterRef, tier: str
    ) -> None: ...
    async def remove_resident(self, replica_id: str, epoch: int, adapter: str) -> bool: ...
    async def report_active(
        self, replica_id: str, epoch: int, in_flight: dict[str, int]
    ) -> dict[str, int]: ...
    async def reap(self) -> tuple[int, int]: ...
    async def deregister_replica(self, replica_id: str, epoch: int) -> bool: ...


@dataclass
class RegistryPublisher:
    """Keeps the registry's view of one replica in step with its engine.

    registry: a `cluster.registry.AsyncRegistry`.
    engine: the replica's AsyncEngine.
    refs: AdapterRef by key for every adapter the replica has seen (filled by the
        deployment as requests arrive; the engine's stats carry keys only).
    in_flight: the replica's requests in flight per adapter (kept by the deployment).
    newest_version: adapter name -> newest version seen, shared with the deployment's
        `check_version` and the follower (pass the deployment's dict at construction).
    desired: the follower of pins, warm targets and draining (built from the above).
    adapter_share: this replica's `autoscaling_metrics.adapter_share` as of the last
        tick; None while the registry could not say (the metric then falls back).
    """

    config: PublisherConfig
    registry: Registry
    engine: Engine
    refs: dict[str, AdapterRef]
    in_flight: InFlight = field(default_factory=InFlight)
    newest_version: dict[str, int] = field(default_factory=dict)
    epoch: int | None = None
    last_epoch: int = 0
    healthy_registry: bool = False
    published: dict[str, str] = field(default_factory=dict)
    ticks: int = 0
    adapter_share: float | None = None
    active_reported: bool = False
    lease_lost: bool = False
    """The keep-alive found this registration's lease gone (the next tick registers again)."""
    registrations: int = 0
    """Registrations begun so far: the keep-alive's answer applies only to the
    registration it asked about (a Redis restarted empty hands out epoch 1 again, so
    epochs can repeat), and it asks nothing while one is being made."""
    registering: bool = False
    desired: DesiredFollower = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.config
        self.desired = DesiredFollower(
            cfg.replica_id,
            cfg.pool,
            self.registry,
            self.engine,
            self.refs,
            self.newest_version,
            publish=lambda: self.publish(self.engine.stats()),
            warm_claim_s=cfg.warm_claim_s,
            prefetch=cfg.prefetch,
        )

    async def run(self) -> None:
        keep_alive = asyncio.create_task(self.keep_alive())
        try:
            while True:
                raise_if_cancelled()
                try:
                    await self.tick()
                    self._set_registry_health(True)
                except asyncio.CancelledError:
                    raise
                except StaleEpoch:
                    self.epoch = None  # fenced off: register again as a new incarnation
                    self.adapter_share = None
                except Exception as e:
                    self._set_registry_health(False, e)
                    self.adapter_share = None
                await asyncio.sleep(self.config.tick_s)
        finally:
            keep_alive.cancel()

    async def keep_alive(self) -> None:
        """Renew the lease every tick_s, whatever the ticks are waiting for. Errors are
        left to the ticks to report (they meet the same registry)."""
        cfg = self.config
        while True:
            raise_if_cancelled()
            await asyncio.sleep(cfg.tick_s)
            epoch, registration = self.epoch, self.registrations
            if epoch is None or self.lease_lost or self.registering:
                continue
            try:
                alive = await self.registry.heartbeat(cfg.replica_id, epoch, cfg.lease_ttl_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the tick logs registry health
                continue
            if not alive and registration == self.registrations:
                self.lease_lost = True

    def _set_registry_health(self, ok: bool, err: Exception | None = None) -> None:
        if ok != self.healthy_registry:
            if ok:
                log.info("registry reachable again; replica %s in sync", self.config.replica_id)
            else:
                log.warning("registry unreachable (%s); serving on, will retry", err)
        self.healthy_registry = ok

    async def tick(self) -> None:
        reg, cfg = self.registry, self.config
        if (
            self.epoch is None
            or self.lease_lost
            or not await reg.heartbeat(cfg.replica_id, self.epoch, cfg.lease_ttl_s)
        ):
            self.lease_lost = False
            self.registrations += 1
            self.registering = True
            try:
                stats = self.engine.stats()
                self.epoch = await reg.register_replica(
                    cfg.replica_id, cfg.pool, cfg.deployment, stats.max_loras, cfg.lease_ttl_s
                )
            finally:
                self.registering = False
            if self.epoch <= self.last_epoch:
                # Epochs only grow while Redis keeps its data: a smaller one means it
                # restarted empty (or from an older snapshot), and adapter and desired-state
                # versions restart with it, so what was seen before must not refuse them.
                self.desired.forget_versions()
            self.last_epoch = self.epoch
            self.published = {}
            self.active_reported = False  # a registration clears what was reported
        await self.publish(self.engine.stats())
        await self.report_active()
        await self.desired.follow(self.epoch)
        await self.desired.prefetch_once(self.epoch)
        await self._reap_now_and_then()

    async def _reap_now_and_then(self) -> None:
        # Every live replica reaps (reap is atomic and idempotent), so the registry needs
        # no singleton janitor: as long as one replica lives, dead rows go away.
        self.ticks += 1
        if self.ticks % self.config.reap_every:
            return
        replicas, adapters = await self.registry.reap()
        if replicas or adapters:
            log.info("reaped %d lapsed replicas and %d drained adapters", replicas, adapters)

    async def publish(self, stats: EngineStats) -> None:
        now = residency(stats)
        reg, rid = self.registry, self.config.replica_id
        for key, tier in now.items():
            if self.published.get(key) != tier and key in self.refs:
                try:
                    await reg.report_resident(rid, self.epoch, self.refs[key], tier)
                except AdapterNotFound:
                    # gone from the catalog while held here (a Redis restarted empty, a
                    # removal racing a load): nothing to publish, and no reason to stop
                    # the tick; retried next tick in case the name is registered again
                    continue
                self.published[key] = tier
        for key in [k for k in self.published if k not in now]:
            ref = self.refs.get(key)
            if ref is not None:
                # by key: the name alone would also drop a newer version held here
                await reg.remove_resident(rid, self.epoch, ref.key)
            del self.published[key]

    async def report_active(self) -> None:
        """Report the adapters this replica's requests use and set adapter_share from how
        many live replicas each is active on (one round trip; none while idle twice)."""
        counts = self.in_flight.counts()
        if not counts and not self.active_reported:
            self.adapter_share = 0.0
            return
        copies = await self.registry.report_active(self.config.replica_id, self.epoch, counts)
        self.active_reported = bool(counts)
        self.adapter_share = adapter_share(counts, copies)

    async def deregister(self) -> None:
        """On shutdown: remove this replica's registry record (residency, lease, the row
        `replicas list` shows) in one step, so routers stop sending here at once and no
        dead row is left behind. Best effort: when it fails the lease lapses and a live
        replica's reap removes the row."""
        if self.epoch is None:
            return
        if not await self.registry.deregister_replica(self.config.replica_id, self.epoch):
            log.info("replica %s: a newer registration owns its record", self.config.replica_id)
        self.epoch = None
        self.published = {}

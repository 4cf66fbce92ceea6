"""A replica's side of the registry: lease, residency publishing, pin/warm following.

Runs as one background task per replica. Every tick it renews the lease (registering
again, with a new epoch, when the lease was lost), publishes the difference between what
the engine holds and what it last published, reports the adapters its requests use (and
reads back on how many replicas each is active: the autoscaling `adapter_share`), and
applies desired-state changes (pins, warm targets through atomic claims, draining
adapters); its first tick also loads the fleet's hottest adapters into free GPU slots
(`PublisherConfig.prefetch`), and every `reap_every` ticks it reaps replicas whose lease
lapsed (crashed ones), so no operator has to. Any registry error is logged and retried
on the next tick: a Redis outage never stops serving and never fails health checks, it
only makes this replica's registry entries go stale until Redis is back. On shutdown
`deregister` removes this replica's record at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from lora_core.errors import AdapterNotFound, LoraFleetError, RegistryUnavailable, StaleEpoch
from lora_core.identity import AdapterRef
from replica.autoscaling_metrics import InFlight, adapter_share
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
        that takes longer may let one more replica load a copy.
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


def residency(stats: EngineStats) -> dict[str, str]:
    """AdapterRef.key -> "gpu" | "cpu" (a GPU-resident adapter is also in the CPU cache)."""
    out = {key: "cpu" for key in stats.cpu_adapters}
    out.update({key: "gpu" for key in stats.gpu_adapters})
    return out


class WarmTarget(Protocol):
    """`cluster.records.WarmTarget`: replicas wanted GPU-resident, in the pools it binds."""

    @property
    def replicas(self) -> int: ...
    def binds(self, replica_pool: str) -> bool: ...


class HotAdapter(Protocol):
    """`cluster.records.HotAdapter`: an adapter in demand across the fleet."""

    @property
    def ref(self) -> AdapterRef: ...
    @property
    def per_copy(self) -> float: ...


class DesiredState(Protocol):
    """The part of `cluster.records.DesiredState` the publisher reads (replica must not
    import cluster, so the pool rule stays there: pins_for / warm_for a replica pool)."""

    @property
    def version(self) -> int: ...
    @property
    def draining(self) -> frozenset[str]: ...
    @property
    def refs(self) -> dict[str, AdapterRef]: ...
    def pins_for(self, replica_pool: str) -> dict[str, str]: ...
    def warm_for(self, replica_pool: str) -> dict[str, WarmTarget]: ...


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
    async def desired_state(self) -> DesiredState: ...
    async def report_active(
        self, replica_id: str, epoch: int, in_flight: dict[str, int]
    ) -> dict[str, int]: ...
    async def claim_warm(
        self, replica_id: str, epoch: int, names: list[str], claim_s: float
    ) -> list[str]: ...
    async def hot_adapters(self, replica_id: str, limit: int) -> list[HotAdapter]: ...
    async def reap(self) -> tuple[int, int]: ...
    async def deregister_replica(self, replica_id: str, epoch: int) -> bool: ...


class Engine(Protocol):
    """The part of `replica.async_engine.AsyncEngine` the publisher drives."""

    def stats(self) -> EngineStats: ...
    async def load_adapter(self, ref: AdapterRef, to_gpu: bool = False) -> None: ...
    async def unload_adapter(self, name: str) -> None: ...
    def pin(self, ref: AdapterRef) -> None: ...
    def unpin(self, name: str) -> None: ...


@dataclass
class OncePerVersion:
    """Remembers which failures were logged for one desired-state version, so a refusal
    that repeats every tick (a pin this replica cannot take) is logged once, and once
    more after the desired state changes.

    Example: fresh(3, ["x"]) -> ["x"]; fresh(3, ["x", "y"]) -> ["y"]; fresh(4, ["x"]) -> ["x"].
    """

    version: int = -1
    seen: set[str] = field(default_factory=set)

    def fresh(self, version: int, failures: list[str]) -> list[str]:
        """The failures not yet returned for version, in order (now marked as seen)."""
        if version != self.version:
            self.version, self.seen = version, set()
        out = [f for f in dict.fromkeys(failures) if f not in self.seen]
        self.seen.update(out)
        return out


async def attempt(failures: list[str], what: str, step: Awaitable[None]) -> bool:
    """Await step; True when it succeeded. A refusal (any LoraFleetError but a registry
    outage, which fails the whole tick) is appended to failures as "what: why" instead
    of raised, so one refused step does not keep the others from running."""
    try:
        await step
    except RegistryUnavailable:
        raise
    except LoraFleetError as e:
        failures.append(f"{what}: {e}")
        return False
    return True


@dataclass
class RegistryPublisher:
    """Keeps the registry's view of one replica in step with its engine.

    registry: a `cluster.registry.AsyncRegistry`.
    engine: the replica's AsyncEngine.
    refs: AdapterRef by key for every adapter the replica has seen (filled by the
        deployment as requests arrive; the engine's stats carry keys only).
    in_flight: the replica's requests in flight per adapter (kept by the deployment).
    adapter_share: this replica's `autoscaling_metrics.adapter_share` as of the last
        tick; None while the registry could not say (the metric then falls back).
    """

    config: PublisherConfig
    registry: Registry
    engine: Engine
    refs: dict[str, AdapterRef]
    epoch: int | None = None
    last_epoch: int = 0
    healthy_registry: bool = False
    published: dict[str, str] = field(default_factory=dict)
    desired_version: int = -1
    pinned: dict[str, str] = field(default_factory=dict)  # name -> AdapterRef.key pinned
    newest_version: dict[str, int] = field(default_factory=dict)
    logged: OncePerVersion = field(default_factory=OncePerVersion)
    ticks: int = 0
    in_flight: InFlight = field(default_factory=InFlight)
    adapter_share: float | None = None
    active_reported: bool = False
    prefetched: bool = False

    async def run(self) -> None:
        while True:
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
            if self.epoch <= self.last_epoch:
                # Epochs only grow while Redis keeps its data: a smaller one means it
                # restarted empty (or from an older snapshot), and adapter and desired-state
                # versions restart with it, so what was seen before must not refuse them.
                self.newest_version.clear()
                self.desired_version = -1
            self.last_epoch = self.epoch
            self.published = {}
            self.active_reported = False  # a registration clears what was reported
        await self.publish(self.engine.stats())
        await self.report_active()
        await self.follow_desired()
        await self._prefetch_once()
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

    async def _prefetch_once(self) -> None:
        """The first tick's head start (PublisherConfig.prefetch): one round trip for the
        hottest adapters this replica does not serve, loaded into free GPU slots (each an
        ordinary LRU resident), then published so routers see the copies at once."""
        if self.prefetched or not self.config.prefetch:
            return
        free = self.engine.stats().free_slots
        room = free - 1 if free > 1 else free
        hot = await self.registry.hot_adapters(self.config.replica_id, room) if room else []
        self.prefetched = True  # once per start, whatever the loads do
        failures: list[str] = []
        loaded = []
        for h in hot:
            self.refs[h.ref.key] = h.ref
            step = self.engine.load_adapter(h.ref, to_gpu=True)
            if await attempt(failures, f"prefetch {h.ref.name!r}", step):
                loaded.append(f"{h.ref.name} ({h.per_copy:.1f} in flight per copy)")
        for failure in failures:
            log.info("replica %s: %s", self.config.replica_id, failure)
        if loaded:
            log.info("replica %s prefetched %s", self.config.replica_id, ", ".join(loaded))
            await self.publish(self.engine.stats())

    async def follow_desired(self) -> None:
        state = await self.registry.desired_state()
        if state.version == self.desired_version:
            failures: list[str] = []
            await self._unload(self._comebacks(state), failures)
            # A warm copy is an ordinary LRU resident: traffic can evict it after the target
            # was met, so the target is checked again on every tick, not once per version.
            await self._apply_warm(state, failures)
            self._log(state.version, failures)
            return
        for name, ref in state.refs.items():
            self.refs[ref.key] = ref
            self.newest_version[name] = max(ref.version, self.newest_version.get(name, 0))
        # Unpins before pins, so a legal final pin set never waits on a slot an old pin
        # holds; every step runs even when an earlier one was refused, so a pin this
        # replica cannot take never blocks an unload or a warm target.
        failures: list[str] = []
        await self._apply_unpins(state, failures)
        await self._apply_pins(state, failures)
        await self._apply_warm(state, failures)
        await self._unload(state.draining, failures)
        if failures:
            self._log(state.version, failures)
            return  # desired_version stays behind, so the next tick tries again
        self.desired_version = state.version

    def _log(self, version: int, failures: list[str]) -> None:
        for failure in self.logged.fresh(version, failures):
            log.warning("desired state %d not applied yet: %s", version, failure)

    async def _apply_unpins(self, state: DesiredState, failures: list[str]) -> None:
        # A pin that no longer binds this replica's pool, or whose adapter was replaced
        # (the new version is pinned next), lets go of its slot first.
        pins = state.pins_for(self.config.pool)
        for name, key in sorted(self.pinned.items()):
            ref = state.refs.get(name)
            if name in pins and (ref is None or ref.key == key):
                continue
            if await attempt(failures, f"unpin {name!r}", self._unpin(name)):
                del self.pinned[name]

    async def _unpin(self, name: str) -> None:
        try:
            self.engine.unpin(name)
        except AdapterNotFound:
            pass  # no longer held here (unloaded): nothing is left to unpin

    async def _apply_pins(self, state: DesiredState, failures: list[str]) -> None:
        for name in sorted(state.pins_for(self.config.pool)):
            ref = state.refs.get(name)
            if ref is not None and name not in self.pinned:
                if await attempt(failures, f"pin {name!r}", self._pin(ref)):
                    self.pinned[name] = ref.key

    async def _pin(self, ref: AdapterRef) -> None:
        await self.engine.load_adapter(ref, to_gpu=True)
        self.engine.pin(ref)

    async def _apply_warm(self, state: DesiredState, failures: list[str]) -> None:
        held = residency(self.engine.stats())
        wanted = {
            name: state.refs[name]
            for name in state.warm_for(self.config.pool)
            if name in state.refs and held.get(state.refs[name].key) != "gpu"
        }
        if not wanted:
            return
        # One claim for every target not held here: the registry counts live GPU copies in
        # each target's pools plus other replicas' claims atomically, so replicas that
        # tick together never load past a target (each checking copies, then loading,
        # could all see "one short" at once).
        granted = await self.registry.claim_warm(
            self.config.replica_id, self.epoch, sorted(wanted), self.config.warm_claim_s
        )
        loaded = False
        for name in granted:
            step = self.engine.load_adapter(wanted[name], to_gpu=True)
            loaded |= await attempt(failures, f"warm {name!r}", step)
        if loaded:
            await self.publish(self.engine.stats())  # reported copies end their claims now

    def _comebacks(self, state: DesiredState) -> set[str]:
        """Draining adapters held here again after their unload: a request resolved just
        before the unregister can reach this replica after the drain freed the adapter and
        load it again, and nothing would free it but LRU eviction."""
        stats = self.engine.stats()
        held = {
            self.refs[key].name
            for key in (*stats.gpu_adapters, *stats.cpu_adapters)
            if key in self.refs and key not in stats.draining
        }
        return held & state.draining

    async def _unload(self, names: Iterable[str], failures: list[str]) -> None:
        for name in sorted(names):
            if await attempt(failures, f"unload {name!r}", self._unload_one(name)):
                self.pinned.pop(name, None)

    async def _unload_one(self, name: str) -> None:
        try:
            await self.engine.unload_adapter(name)
        except AdapterNotFound:
            pass  # never held here, or already unloaded

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

"""A replica's following of the registry's desired state: pins, warm targets (loaded
only under atomic claims) and draining adapters, and the first tick's prefetch of the
fleet's hottest adapters.

`DesiredFollower` is driven by `replica.serve_registry.RegistryPublisher` once per tick
(after the lease and residency are in step). It touches the engine only through pin /
unpin / load / unload and never raises for a refusal that the next tick may get past
(a pin this replica cannot take, a load refused for capacity): those are logged once
per desired-state version and retried. A registry outage fails the whole tick.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from lora_core.errors import AdapterNotFound, LoraFleetError, RegistryUnavailable
from lora_core.identity import AdapterRef
from replica.outputs import EngineStats

log = logging.getLogger("lorafleet.replica")


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
    """The part of `cluster.records.DesiredState` the follower reads (replica must not
    import cluster, so the pool rule stays there: pins_for / warm_for a replica pool)."""

    @property
    def version(self) -> int: ...
    @property
    def draining(self) -> frozenset[str]: ...
    @property
    def refs(self) -> dict[str, AdapterRef]: ...
    def pins_for(self, replica_pool: str) -> dict[str, str]: ...
    def warm_for(self, replica_pool: str) -> dict[str, WarmTarget]: ...


class DesiredRegistry(Protocol):
    """The part of `cluster.registry.AsyncRegistry` the follower uses."""

    async def desired_state(self) -> DesiredState: ...
    async def claim_warm(
        self, replica_id: str, epoch: int, names: list[str], claim_s: float
    ) -> list[str]: ...
    async def hot_adapters(
        self, replica_id: str, epoch: int, limit: int, claim_s: float
    ) -> list[HotAdapter]: ...


class Engine(Protocol):
    """The part of `replica.async_engine.AsyncEngine` the publisher and follower drive."""

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
class DesiredFollower:
    """Applies the registry's desired state to one replica's engine.

    replica_id, pool: the replica's (see `serve_registry.PublisherConfig`).
    warm_claim_s: how long a claim on a warm or prefetched copy lasts
        (`PublisherConfig.warm_claim_s`).
    prefetch: whether the first prefetch_once loads the fleet's hottest adapters.
    refs: AdapterRef by key, shared with the publisher (every ref the follower learns
        goes there, so the publisher can report the copies it loads).
    newest_version: adapter name -> newest version seen, shared with the deployment's
        `check_version` (so stale requests are refused once a newer version is known).
    publish: reports the engine's residency now (the publisher's publish), awaited after
        loads so the registry counts the new copies at once.
    version: the desired-state version fully applied here (-1: none yet).
    pinned: adapter name -> AdapterRef.key pinned here.
    """

    replica_id: str
    pool: str
    registry: DesiredRegistry
    engine: Engine
    refs: dict[str, AdapterRef]
    newest_version: dict[str, int]
    publish: Callable[[], Awaitable[None]]
    warm_claim_s: float = 10.0
    prefetch: bool = True
    version: int = -1
    pinned: dict[str, str] = field(default_factory=dict)
    logged: OncePerVersion = field(default_factory=OncePerVersion)
    prefetched: bool = False

    def forget_versions(self) -> None:
        """Redis restarted empty: adapter and desired-state versions restart with it, so
        what was seen before must not refuse them."""
        self.newest_version.clear()
        self.version = -1

    async def follow(self, epoch: int) -> None:
        """Apply the desired state (unpins, pins, warm targets, draining), or on an
        unchanged version only what may have drifted (warm copies, comebacks)."""
        state = await self.registry.desired_state()
        failures: list[str] = []
        if state.version == self.version:
            await self._unload(self._comebacks(state), failures)
            # A warm copy is an ordinary LRU resident: traffic can evict it after the target
            # was met, so the target is checked again on every tick, not once per version.
            await self._apply_warm(state, epoch, failures)
            self._log(state.version, failures)
            return
        for name, ref in state.refs.items():
            self.refs[ref.key] = ref
            self.newest_version[name] = max(ref.version, self.newest_version.get(name, 0))
        # Unpins before pins, so a legal final pin set never waits on a slot an old pin
        # holds; every step runs even when an earlier one was refused, so a pin this
        # replica cannot take never blocks an unload or a warm target.
        await self._apply_unpins(state, failures)
        await self._apply_pins(state, failures)
        await self._apply_warm(state, epoch, failures)
        await self._unload(state.draining, failures)
        if failures:
            self._log(state.version, failures)
            return  # version stays behind, so the next tick tries again
        self.version = state.version

    async def prefetch_once(self, epoch: int) -> None:
        """The first tick's head start (`prefetch`): one round trip for the hottest
        adapters this replica does not serve, loaded into free GPU slots (each an
        ordinary LRU resident), then published so routers see the copies at once."""
        if self.prefetched or not self.prefetch:
            return
        free = self.engine.stats().free_slots
        room = free - 1 if free > 1 else free
        hot = []
        if room:
            # the registry claims what it returns, so replicas starting together spread
            hot = await self.registry.hot_adapters(self.replica_id, epoch, room, self.warm_claim_s)
        self.prefetched = True  # once per start, whatever the loads do
        failures: list[str] = []
        loaded = []
        for h in hot:
            self.refs[h.ref.key] = h.ref
            # the registry's current version: requests still naming an older one are
            # refused here from now on (check_version), as after a desired-state read
            self.newest_version[h.ref.name] = max(
                h.ref.version, self.newest_version.get(h.ref.name, 0)
            )
            step = self.engine.load_adapter(h.ref, to_gpu=True)
            if await attempt(failures, f"prefetch {h.ref.name!r}", step):
                loaded.append(f"{h.ref.name} ({h.per_copy:.1f} in flight per copy)")
        for failure in failures:
            log.info("replica %s: %s", self.replica_id, failure)
        if loaded:
            log.info("replica %s prefetched %s", self.replica_id, ", ".join(loaded))
            await self.publish()

    def _log(self, version: int, failures: list[str]) -> None:
        for failure in self.logged.fresh(version, failures):
            log.warning("desired state %d not applied yet: %s", version, failure)

    async def _apply_unpins(self, state: DesiredState, failures: list[str]) -> None:
        # A pin that no longer binds this replica's pool, or whose adapter was replaced
        # (the new version is pinned next), lets go of its slot first.
        pins = state.pins_for(self.pool)
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
        for name in sorted(state.pins_for(self.pool)):
            ref = state.refs.get(name)
            if ref is not None and name not in self.pinned:
                if await attempt(failures, f"pin {name!r}", self._pin(ref)):
                    self.pinned[name] = ref.key

    async def _pin(self, ref: AdapterRef) -> None:
        await self.engine.load_adapter(ref, to_gpu=True)
        self.engine.pin(ref)

    async def _apply_warm(self, state: DesiredState, epoch: int, failures: list[str]) -> None:
        held = residency(self.engine.stats())
        wanted = {
            name: state.refs[name]
            for name in state.warm_for(self.pool)
            if name in state.refs and held.get(state.refs[name].key) != "gpu"
        }
        if not wanted:
            return
        # One claim for every target not held here: the registry counts live GPU copies in
        # each target's pools plus other replicas' claims atomically, so replicas that
        # tick together never load past a target (each checking copies, then loading,
        # could all see "one short" at once).
        granted = await self.registry.claim_warm(
            self.replica_id, epoch, sorted(wanted), self.warm_claim_s
        )
        loaded = False
        for name in granted:
            step = self.engine.load_adapter(wanted[name], to_gpu=True)
            loaded |= await attempt(failures, f"warm {name!r}", step)
        if loaded:
            await self.publish()  # reported copies end their claims now

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

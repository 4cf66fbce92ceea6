"""The registry's fleet methods: replicas and their leases, residency, pins and warm
targets, the desired state. Mixed into `cluster.registry._Api`; Registry and
AsyncRegistry supply `_run` (one Redis round trip per method, sync or asyncio)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from cluster import ops
from cluster.keys import check_name
from cluster.records import (
    PIN_POOLS,
    REPLICA_POOLS,
    TIERS,
    DesiredState,
    HotAdapter,
    Location,
    RegistryStatus,
    ReplicaInfo,
    check_choice,
)
from lora_core.identity import AdapterRef

T = TypeVar("T")
Reply = T | Awaitable[T]
AdapterVersion = AdapterRef | str | tuple[str, int]  # a str is an AdapterRef.key


def _ttl_ms(ttl_s: float) -> int:
    if not 0.01 <= ttl_s <= 3600:
        raise ValueError(f"ttl_s={ttl_s}; allowed: 0.01 .. 3600 seconds")
    return int(ttl_s * 1000)


def _name_version(adapter: AdapterVersion) -> tuple[str, int, str]:
    """(name, version, ref key) of an AdapterRef, an AdapterRef.key string, or (name, version)."""
    if isinstance(adapter, AdapterRef):
        return adapter.name, adapter.version, adapter.key
    if isinstance(adapter, str):
        name, _, rest = adapter.partition("@")
        version = rest.split(":", 1)[0]
        if not name or not version.isdigit():
            raise ValueError(f"adapter={adapter!r}; allowed: an AdapterRef.key 'name@version:hash'")
        return name, int(version), adapter
    name, version = adapter
    return name, int(version), ""


class FleetApi:
    """Replica, residency and desired-state methods of the registry (see module doc)."""

    def _run(self, plan: ops.Plan[T]) -> Reply[T]:
        raise NotImplementedError

    def _run_built(self, build: Callable[[], ops.Plan[T]]) -> Reply[T]:
        """Run the plan build() returns, where build does blocking I/O (file reads) first:
        the asyncio registry calls it in a worker thread."""
        raise NotImplementedError

    # -- replicas, leases, residency ------------------------------------------------

    def register_replica(
        self, replica_id: str, pool: str, deployment: str, slot_capacity: int, ttl_s: float
    ) -> Reply[int]:
        """(Re-)register a replica: INCR its epoch, take the lease for ttl_s, and clear
        what an earlier incarnation reported. Returns the new epoch (fencing token)."""
        check_name("replica", replica_id)
        check_choice("pool", pool, REPLICA_POOLS)
        if slot_capacity < 0:
            raise ValueError(f"slot_capacity={slot_capacity}; allowed: >= 0")
        args = (replica_id, pool, deployment, slot_capacity, _ttl_ms(ttl_s), time.time())
        return self._run(ops.script("register_replica", args, lambda r: int(r[0]), replica_id))

    def heartbeat(self, replica_id: str, epoch: int, ttl_s: float) -> Reply[bool]:
        """Renew the lease. False: it lapsed (re-register). StaleEpoch: superseded."""
        return self._run(ops.heartbeat(replica_id, epoch, _ttl_ms(ttl_s)))

    def report_resident(
        self, replica_id: str, epoch: int, adapter: AdapterVersion, tier: str
    ) -> Reply[None]:
        """Record that replica holds adapter (an AdapterRef, its key "name@version:hash",
        or (name, version)) in tier ("gpu" | "cpu"); a later report of the same adapter
        replaces the earlier one (one entry per replica and name; a report of an older
        version than the one recorded is ignored, so the newest stays routable, and so is
        a key whose content hash is not the registered version's). StaleEpoch unless
        (replica_id, epoch) holds the lease; AdapterNotFound for an unknown name."""
        check_choice("tier", tier, TIERS)
        name, version, ref_key = _name_version(adapter)
        args = (replica_id, epoch, name, version, tier, ref_key)
        return self._run(ops.fenced_write("report_resident", args, replica_id, epoch, name))

    def remove_resident(
        self, replica_id: str, epoch: int, adapter: AdapterVersion | str
    ) -> Reply[bool]:
        """Forget replica's copy of adapter (as in report_resident; a bare name without
        '@' means any version; a ref or key removes only an entry of that content, so a
        stale copy numbered like the current version cannot drop it). True if removed.
        Finishes unregistering a draining adapter once no live replica holds it."""
        if isinstance(adapter, str) and "@" not in adapter:
            name, version, ref_key = adapter, "", ""
        else:
            name, num, ref_key = _name_version(adapter)
            version = str(num)
        args = (replica_id, epoch, name, version, ref_key)
        plan = ops.fenced_write("remove_resident", args, replica_id, epoch, name)
        return self._run(ops.Plan(plan.script, plan.args, lambda raw: plan.parse(raw)[0] == 1))

    def report_active(
        self, replica_id: str, epoch: int, in_flight: Mapping[str, int]
    ) -> Reply[dict[str, int]]:
        """Record the adapters replica's requests use now (name -> requests in flight;
        names left out are no longer active there) and return, for each of them, on how
        many live replicas of replica's deployment it is active now, this one included
        (>= 1): the autoscaler sums adapter shares per deployment, so replicas of another
        deployment (another pool) do not count. One round trip for all names;
        StaleEpoch unless (replica_id, epoch) holds the lease."""
        names = sorted(in_flight)
        for name in names:
            check_name("adapter", name)
        args = (replica_id, epoch, *(x for n in names for x in (n, int(in_flight[n]))))
        plan = ops.fenced_write("report_active", args, replica_id, epoch, "")
        return self._run(
            ops.Plan(plan.script, plan.args, lambda raw: ops.counts(names, plan.parse(raw)))
        )

    def claim_warm(
        self, replica_id: str, epoch: int, names: Sequence[str], claim_s: float
    ) -> Reply[list[str]]:
        """Which of names (warm targets replica does not hold in a GPU slot) replica should
        load now: a name is granted, with a claim lasting claim_s, while its live GPU
        copies in the target's pools plus other replicas' live claims (warm claims, and
        prefetch claims of replicas in the target's pools) are below the target. Atomic,
        so replicas claiming at once never exceed a target; a claim ends when replica
        reports the copy, after claim_s, or when its lease lapses. An unexpired claim of
        replica's own (warm or prefetch) is granted again (a retried load), not
        extended. One round trip for all names; StaleEpoch unless replica holds the lease."""
        args = (replica_id, epoch, _ttl_ms(claim_s), *sorted(names))
        plan = ops.fenced_write("claim_warm", args, replica_id, epoch, "")
        return self._run(ops.Plan(plan.script, plan.args, lambda raw: ops.names(plan.parse(raw))))

    def hot_adapters(
        self, replica_id: str, epoch: int, limit: int, claim_s: float
    ) -> Reply[list[HotAdapter]]:
        """Up to limit adapters in demand that replica neither serves nor holds in a GPU
        slot nor claimed for a warm copy, the most requests in flight per copy first
        (ties by name; other replicas' live warm claims count as copies): what a new
        replica loads before traffic finds it. Requests and copies count only on
        replicas whose pool overlaps replica's (equal, or either mixed), so a prefill
        replica ranks by prefill demand and copies. Each one returned is claimed by replica
        for claim_s (ended early when replica reports the copy, or its lease lapses), and
        other replicas' claims count as copies, so replicas starting at once spread over
        the hot adapters. Reads every active adapter's entries, so call it once per
        replica start, not every tick. One round trip; StaleEpoch unless replica holds
        the lease."""
        if limit < 0:
            raise ValueError(f"limit={limit}; allowed: >= 0")
        args = (replica_id, epoch, limit, _ttl_ms(claim_s))
        plan = ops.fenced_write("hot_adapters", args, replica_id, epoch, "")
        return self._run(ops.Plan(plan.script, plan.args, lambda raw: ops.hot(plan.parse(raw))))

    def locations(self, name: str) -> Reply[tuple[Location, ...]]:
        """Live replicas holding name's current version: sorted (replica, tier, pool)."""
        return self._run(ops.script("locations", (name,), ops.locations, name))

    def list_replicas(self) -> Reply[list[ReplicaInfo]]:
        """Every registered replica (live or not), sorted by id."""
        return self._run(ops.script("list_replicas", (), ops.replicas, ""))

    def deregister_replica(self, replica_id: str, epoch: int) -> Reply[bool]:
        """A stopping replica's goodbye: remove its record, residency and lease in one
        step (routers stop sending there, `replicas list` no longer shows it) and finish
        unregistering draining adapters only it held. False, with nothing removed, when
        a newer registration of replica_id exists."""
        return self._run(ops.deregister_replica(replica_id, epoch))

    def reap(self) -> Reply[tuple[int, int]]:
        """Forget replicas whose lease lapsed and finish drained adapters.
        Returns (replicas removed, adapters removed). Idempotent and atomic, so safe to
        run from anywhere, concurrently (every live replica runs it periodically)."""
        return self._run(ops.script("reap", (), lambda r: (int(r[0]), int(r[1])), ""))

    # -- desired state ---------------------------------------------------------------

    def pin(self, name: str, pool: str = "all") -> Reply[None]:
        """Every replica of pool ("all" | "prefill" | "decode") loads name into a GPU slot
        and keeps it there.

        PinRefused, with nothing written, when the pins would reach the served base's
        max_loras: each replica must keep one evictable GPU slot, and pins of every pool
        count (mixed replicas take them all, see `records.pin_applies`). Not checked
        while no deployment published max_loras (`set_served`)."""
        check_choice("pool", pool, PIN_POOLS)
        return self._run(ops.pin(name, pool))

    def unpin(self, name: str) -> Reply[bool]:
        """Remove name's pin; True if it was pinned. AdapterNotFound for an unknown name."""
        return self._run(ops.script("pin", (name, ""), lambda r: r[0] == 1, name))

    def warm(self, name: str, replicas: int, pool: str = "all") -> Reply[None]:
        """Desire `replicas` GPU-resident copies of name in pool (0 clears the target)."""
        check_choice("pool", pool, PIN_POOLS)
        if not 0 <= replicas <= 100_000:
            raise ValueError(f"replicas={replicas}; allowed: 0 .. 100000")
        return self._run(ops.script("warm", (name, replicas, pool), lambda _: None, name))

    def desired_state(self) -> Reply[DesiredState]:
        """The full desired state (the periodic reconcile; hints only say "re-read")."""
        return self._run(ops.script("desired_state", (), ops.desired, ""))

    def status(self) -> Reply[RegistryStatus]:
        return self._run(ops.script("status", (), ops.status, ""))

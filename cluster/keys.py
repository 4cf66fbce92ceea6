"""The Redis key layout of the registry: the only module that spells a key.

Every key lives under one namespace prefix `ns` (default "lorafleet"), so several
clusters (or test runs) can share one Redis. `ns` must not contain ':' or spaces.

Adapter catalog
    {ns}:adapters                 set    names of every registered adapter
    {ns}:adapter:{name}           hash   name, version, content_hash, path, rank, base_model,
                                         target_modules (JSON list), owner, public ("0"/"1"),
                                         created (unix s), state ("active" | "draining")
    {ns}:version:{name}           string last version handed out for name (INCR; survives
                                         unregister so a re-registered name never reuses one)
    {ns}:grants:{name}            set    tenants granted access to adapter name

Tenants and API keys
    {ns}:tenants                  set    tenant names
    {ns}:tenant:{tenant}          hash   name, created, requests_per_minute (the tenant's
                                         own rate limit; absent: none of its own)
    {ns}:tenant:{tenant}:keys     set    sha256 hex of each key issued to tenant
    {ns}:tenant:{tenant}:key_created
                                  hash   sha256 hex -> unix s the key was issued (keys issued
                                         before this field existed have no entry)
    {ns}:apikey:{sha256}          string tenant owning the key (the key itself is never stored)

    {ns}:rate:{tenant}            string the tenant's theoretical arrival time (GCRA; unix
                                         microseconds, Redis's clock), written by the
                                         ingress only while a limit applies; expires when
                                         that time passes (an idle tenant has none)

    A key's id (what `tenants keys` shows and `tenants revoke-key` takes) is the first
    12 hex characters of its sha256: not secret, and derivable for every stored key.

Base models
    {ns}:served                   string JSON of cluster.records.ServedBase: the base model
                                         this cluster serves (id, shapes, max adapter
                                         rank, GPU adapter slots), stored by the
                                         deployment at start; `register` checks every
                                         adapter against it, `pin` the slots
    {ns}:base:{model_id}          string JSON of lora_core.base_shape.BaseShape, for
                                         `register --base-model` outside a cluster

Replicas, leases and residency
    {ns}:replicas                 set    registered replica ids, live or not (liveness is
                                         only ever the lease below); a replica leaves it
                                         when it deregisters, or when `reap` (run by
                                         live replicas, or the CLI) finds its lease lapsed
    {ns}:replica:{id}             hash   id, pool, deployment, slot_capacity, epoch, registered
    {ns}:epoch:{id}               string fencing counter: INCR on every registration (kept
                                         after deregister / reap, so epochs never repeat)
    {ns}:lease:{id}               string the epoch holding the lease, with a PX TTL; absent or
                                         a different epoch means the replica is not live
    {ns}:resident:{name}          hash   replica id -> "tier|version|epoch|pool|ref_key"
    {ns}:replica:{id}:adapters    set    adapter names the replica reported (for cleanup)

Adapter demand (written by replicas every registry tick, read by replicas)
    {ns}:active:{name}            hash   replica id -> "in-flight requests|pool|deployment|
                                         epoch": replicas whose requests use name now
                                         (live ones count)
    {ns}:replica:{id}:active      set    adapter names the replica reported active
    {ns}:active_names             set    names with any entry in active:{name}
    {ns}:warm_claims:{name}       hash   replica id -> "expires (unix ms)|epoch": a
                                         replica loading one of name's warm copies; PX
                                         TTL of the latest claim (`claim_warm`); a copy
                                         for `hot_adapters`
    {ns}:prefetch_claims:{name}   hash   replica id -> "expires (unix ms)|epoch": a new
                                         replica loading name as a head start; counted
                                         as a copy when others rank (`hot_adapters`)
                                         and toward warm targets (`claim_warm`)

Desired state
    {ns}:pins                     hash   adapter name -> pool ("all" | "prefill" | "decode")
    {ns}:warm                     hash   adapter name -> "replicas|pool"
    {ns}:draining                 set    names of adapters being unregistered
    {ns}:desired                  string desired-state version, INCR on every pin/warm/
                                         drain change; created at the clock in ms (never
                                         0), so a flushed or restarted Redis never hands
                                         out a version it handed out before
    {ns}:hints                    pub/sub channel: JSON {"version", "adapter", "change"}
                                         published after each desired-state change

Lua scripts get `ns` as ARGV and build the per-replica keys (`lease:{id}`,
`replica:{id}`) themselves, which is fine on a standalone Redis (the only
deployment lorafleet supports) but not on Redis Cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAMESPACE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-/]{1,128}$")


def check_name(kind: str, name: str) -> str:
    """Return name if it is a valid adapter/tenant/replica name, else raise ValueError.

    Allowed: 1-128 chars of letters, digits, '_', '.', '-', '/' (no ':', '|' or spaces,
    which the key layout and residency encoding use as separators).
    """
    if not _NAME.match(name):
        raise ValueError(
            f"{kind} name {name!r} is invalid; allowed: 1-128 characters of "
            "letters, digits, '_', '.', '-', '/'"
        )
    return name


@dataclass(frozen=True, slots=True)
class Keys:
    """Builds every key under one namespace (see the module docstring for the layout)."""

    ns: str = "lorafleet"

    def __post_init__(self) -> None:
        if not _NAMESPACE.match(self.ns):
            raise ValueError(
                f"namespace {self.ns!r} is invalid; allowed: 1-64 characters of "
                "letters, digits, '_', '.', '-'"
            )

    @property
    def adapters(self) -> str:
        return f"{self.ns}:adapters"

    def adapter(self, name: str) -> str:
        return f"{self.ns}:adapter:{name}"

    def version(self, name: str) -> str:
        return f"{self.ns}:version:{name}"

    def grants(self, name: str) -> str:
        return f"{self.ns}:grants:{name}"

    @property
    def tenants(self) -> str:
        return f"{self.ns}:tenants"

    def tenant(self, tenant: str) -> str:
        return f"{self.ns}:tenant:{tenant}"

    def tenant_keys(self, tenant: str) -> str:
        return f"{self.ns}:tenant:{tenant}:keys"

    def tenant_key_created(self, tenant: str) -> str:
        return f"{self.ns}:tenant:{tenant}:key_created"

    def rate(self, tenant: str) -> str:
        return f"{self.ns}:rate:{tenant}"

    def apikey(self, key_hash: str) -> str:
        return f"{self.ns}:apikey:{key_hash}"

    def base(self, model_id: str) -> str:
        return f"{self.ns}:base:{model_id}"

    @property
    def served(self) -> str:
        return f"{self.ns}:served"

    @property
    def replicas(self) -> str:
        return f"{self.ns}:replicas"

    def replica(self, replica_id: str) -> str:
        return f"{self.ns}:replica:{replica_id}"

    def epoch(self, replica_id: str) -> str:
        return f"{self.ns}:epoch:{replica_id}"

    def lease(self, replica_id: str) -> str:
        return f"{self.ns}:lease:{replica_id}"

    def resident(self, name: str) -> str:
        return f"{self.ns}:resident:{name}"

    def replica_adapters(self, replica_id: str) -> str:
        return f"{self.ns}:replica:{replica_id}:adapters"

    def active(self, name: str) -> str:
        return f"{self.ns}:active:{name}"

    def replica_active(self, replica_id: str) -> str:
        return f"{self.ns}:replica:{replica_id}:active"

    @property
    def active_names(self) -> str:
        return f"{self.ns}:active_names"

    def warm_claims(self, name: str) -> str:
        return f"{self.ns}:warm_claims:{name}"

    def prefetch_claims(self, name: str) -> str:
        return f"{self.ns}:prefetch_claims:{name}"

    @property
    def pins(self) -> str:
        return f"{self.ns}:pins"

    @property
    def warm(self) -> str:
        return f"{self.ns}:warm"

    @property
    def draining(self) -> str:
        return f"{self.ns}:draining"

    @property
    def desired(self) -> str:
        return f"{self.ns}:desired"

    @property
    def hints(self) -> str:
        return f"{self.ns}:hints"

    @property
    def pattern(self) -> str:
        """SCAN pattern matching every key of this namespace."""
        return f"{self.ns}:*"

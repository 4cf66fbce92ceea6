"""Typed values the registry returns (torch-free, immutable)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from lora_core.base_shape import BaseShape
from lora_core.identity import AdapterRef

Tier = Literal["gpu", "cpu"]
ReplicaPool = Literal["prefill", "decode", "mixed"]
PinPool = Literal["all", "prefill", "decode"]
TIERS: tuple[str, ...] = ("gpu", "cpu")
REPLICA_POOLS: tuple[str, ...] = ("prefill", "decode", "mixed")
PIN_POOLS: tuple[str, ...] = ("all", "prefill", "decode")
KEY_ID_LEN = 12
_KEY_ID = re.compile(r"^[0-9a-f]{6,64}$")


def check_choice(field: str, value: str, allowed: tuple[str, ...]) -> str:
    """Return value if it is one of allowed, else raise ValueError naming both."""
    if value not in allowed:
        raise ValueError(f"{field}={value!r}; allowed: {', '.join(allowed)}")
    return value


def pin_applies(pin_pool: str, replica_pool: str) -> bool:
    """Whether a pin/warm target for pin_pool binds a replica of replica_pool.

    "all" binds every replica; "prefill"/"decode" bind that pool and mixed replicas
    (which run both phases).
    """
    return pin_pool == "all" or replica_pool in (pin_pool, "mixed")


def key_id(key_hash: str) -> str:
    """The id of an API key: the first KEY_ID_LEN hex chars of its sha256 (not secret).

    Example: key_id("3f2a9c1b7d04e5...") == "3f2a9c1b7d04"; a key holder gets the same
    with `printf %s "$KEY" | sha256sum | cut -c1-12`.
    """
    return key_hash[:KEY_ID_LEN]


def check_key_id(text: str) -> str:
    """text lower-cased if it can name a key (a prefix of a key's sha256), else ValueError."""
    prefix = text.strip().lower()
    if not _KEY_ID.match(prefix):
        raise ValueError(
            f"key id {text!r} is invalid; allowed: 6-64 hex characters, the id shown by "
            "`tenants key` / `tenants keys` or a prefix of it"
        )
    return prefix


def check_requests_per_minute(value: object) -> int:
    """value if it can be a tenant's request rate limit, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"requests_per_minute={value!r}; allowed: an integer >= 0 (0 = no limit of the "
            "tenant's own: the cluster's tenant_requests_per_minute applies)"
        )
    return value


class Location(NamedTuple):
    """Where one adapter is resident: on replica, in tier, and that replica's pool."""

    replica: str
    tier: str
    pool: str


@dataclass(frozen=True, slots=True)
class AdapterRecord:
    """One registered adapter as stored in `{ns}:adapter:{name}`.

    version: >= 1, bumped on every (re-)registration of name.
    content_hash: sha256 hex of adapter_config.json + weights.
    target_modules: PEFT module names the adapter touches, sorted.
    owner: tenant that registered it ("" for none); the owner may always use it.
    public: any tenant (any valid key) may use it.
    created: unix seconds of this version's registration.
    state: "active", or "draining" after unregister (new requests refused).
    """

    name: str
    version: int
    content_hash: str
    path: str
    rank: int
    base_model: str
    target_modules: tuple[str, ...]
    owner: str
    public: bool
    created: float
    state: str

    @property
    def ref(self) -> AdapterRef:
        """The immutable request-path reference to this version."""
        return AdapterRef(
            name=self.name,
            version=self.version,
            content_hash=self.content_hash,
            path=self.path,
            rank=self.rank,
            base_model=self.base_model,
        )

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> AdapterRecord:
        """Decode the stored hash (all values are strings)."""
        return cls(
            name=h["name"],
            version=int(h["version"]),
            content_hash=h["content_hash"],
            path=h["path"],
            rank=int(h["rank"]),
            base_model=h.get("base_model", ""),
            target_modules=tuple(json.loads(h.get("target_modules", "[]"))),
            owner=h.get("owner", ""),
            public=h.get("public") == "1",
            created=float(h.get("created", "0")),
            state=h.get("state", "active"),
        )


@dataclass(frozen=True, slots=True)
class ServedBase:
    """The base model a cluster serves, as its deployment published it at start.

    model_id: the base model's id in requests' `model` (no adapter may take it).
    shape: its projections' shapes (every adapter must fit them).
    max_lora_rank: the largest adapter rank its replicas take.
    max_loras: GPU adapter slots per replica (pins must leave one of them evictable);
        None when the deployment did not publish it (records of older versions), and
        then pins are not checked against it.
    """

    model_id: str
    shape: BaseShape
    max_lora_rank: int
    max_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras}; allowed: >= 1, or None (unknown)")

    def to_json(self) -> str:
        return json.dumps(
            {
                "model_id": self.model_id,
                "shape": dataclasses.asdict(self.shape),
                "max_lora_rank": self.max_lora_rank,
                "max_loras": self.max_loras,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: str) -> ServedBase:
        d = json.loads(raw)
        slots = d.get("max_loras")  # absent from records published before pins were checked
        return cls(
            d["model_id"],
            BaseShape.from_record(d["shape"]),
            int(d["max_lora_rank"]),
            int(slots) if slots is not None else None,
        )

    @classmethod
    def from_model_dir(
        cls, model_id: str, model_dir: str, max_lora_rank: int, max_loras: int | None = None
    ) -> ServedBase:
        """The ServedBase of the HF model directory model_dir (its config.json)."""
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return cls(model_id, BaseShape.from_hf_config(cfg), max_lora_rank, max_loras)


@dataclass(frozen=True, slots=True)
class HotAdapter:
    """An adapter in demand across the fleet (`hot_adapters`): ref, its requests in flight
    on live replicas, and copies (live replicas where it is active or GPU-resident, or
    that claimed it to prefetch), both counted in the asking replica's pools."""

    ref: AdapterRef
    in_flight: int
    copies: int

    @property
    def per_copy(self) -> float:
        """Requests in flight per copy (the ranking key)."""
        return self.in_flight / max(1, self.copies)


@dataclass(frozen=True, slots=True)
class WarmTarget:
    """Desired number of GPU-resident copies of an adapter in pool."""

    replicas: int
    pool: str

    def binds(self, replica_pool: str) -> bool:
        """Whether a replica of replica_pool takes part (and its copies count)."""
        return pin_applies(self.pool, replica_pool)


@dataclass(frozen=True, slots=True)
class AdapterListing:
    """An adapter with its desired state and live locations (what `adapters list` shows)."""

    record: AdapterRecord
    pin: str | None
    warm: WarmTarget | None
    locations: tuple[Location, ...]

    def to_json(self) -> dict[str, object]:
        r = self.record
        return {
            "name": r.name,
            "version": r.version,
            "content_hash": r.content_hash,
            "path": r.path,
            "base_model": r.base_model,
            "rank": r.rank,
            "target_modules": list(r.target_modules),
            "owner": r.owner,
            "public": r.public,
            "created": r.created,
            "state": r.state,
            "pinned": self.pin is not None,
            "pin_pool": self.pin,
            "warm_replicas": self.warm.replicas if self.warm else 0,
            "warm_pool": self.warm.pool if self.warm else None,
            "locations": [loc._asdict() for loc in self.locations],
        }


@dataclass(frozen=True, slots=True)
class ApiKeyInfo:
    """One API key of a tenant, as `tenants keys` lists it (never the key itself).

    key_id: first KEY_ID_LEN hex chars of the key's sha256.
    created: unix seconds it was issued; None for keys issued before that was recorded.
    """

    key_id: str
    created: float | None

    def to_json(self) -> dict[str, object]:
        return {"key_id": self.key_id, "created": self.created}


@dataclass(frozen=True, slots=True, order=True)
class TenantInfo:
    """One tenant, as `tenants list` shows it.

    requests_per_minute: its own request rate limit; 0 for none (the cluster's
    tenant_requests_per_minute applies then, itself 0 for no limit).
    """

    name: str
    requests_per_minute: int

    def to_json(self) -> dict[str, object]:
        return {"tenant": self.name, "requests_per_minute": self.requests_per_minute}


@dataclass(frozen=True, slots=True)
class ResolvedRequest:
    """Answer of the request-path lookup.

    tenant: the key's tenant, or None when resolved without a key (auth off).
    locations: live replicas holding exactly ref's version.
    """

    ref: AdapterRef
    tenant: str | None
    locations: tuple[Location, ...]


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """One registered replica. live: its lease is held by its current epoch."""

    replica_id: str
    pool: str
    deployment: str
    slot_capacity: int
    epoch: int
    live: bool
    registered: float
    gpu_adapters: int
    cpu_adapters: int

    def to_json(self) -> dict[str, object]:
        return {
            "replica": self.replica_id,
            "pool": self.pool,
            "deployment": self.deployment,
            "slot_capacity": self.slot_capacity,
            "epoch": self.epoch,
            "live": self.live,
            "registered": self.registered,
            "gpu_adapters": self.gpu_adapters,
            "cpu_adapters": self.cpu_adapters,
        }


@dataclass(frozen=True, slots=True)
class DesiredState:
    """What replicas should hold, read in full (the periodic reconcile).

    version: bumped on every pin/warm/drain/replace change (compare to skip no-ops).
    pins: adapter name -> pin pool. warm: adapter name -> target.
    draining: adapters to unload once idle.
    refs: current AdapterRef of every pinned or warm adapter.
    """

    version: int
    pins: dict[str, str]
    warm: dict[str, WarmTarget]
    draining: frozenset[str]
    refs: dict[str, AdapterRef]

    def pins_for(self, replica_pool: str) -> dict[str, str]:
        """The pins that bind a replica of replica_pool (`pin_applies`)."""
        return {n: p for n, p in self.pins.items() if pin_applies(p, replica_pool)}

    def warm_for(self, replica_pool: str) -> dict[str, WarmTarget]:
        """The warm targets a replica of replica_pool helps meet."""
        return {n: t for n, t in self.warm.items() if t.binds(replica_pool)}


@dataclass(frozen=True, slots=True)
class Hint:
    """A pub/sub nudge: desired state changed (re-read it; hints may be lost)."""

    version: int
    adapter: str
    change: str


@dataclass(frozen=True, slots=True)
class RegistryStatus:
    """Cluster-wide counts for `lorafleet status`."""

    adapters: int
    draining: int
    tenants: int
    pins: int
    warm: int
    desired_version: int
    replicas_total: int
    replicas_live: dict[str, int]

    def to_json(self) -> dict[str, object]:
        return {
            "adapters": self.adapters,
            "draining": self.draining,
            "tenants": self.tenants,
            "pins": self.pins,
            "warm": self.warm,
            "desired_version": self.desired_version,
            "replicas_total": self.replicas_total,
            "replicas_live": dict(self.replicas_live),
        }

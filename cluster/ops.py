"""Registry operations as I/O-free plans: one Redis round trip each.

A `Plan` says what to send (a Lua script from `cluster.scripts`, or one plain
command) and how to turn the reply into a value or a typed error. `Registry` and
`AsyncRegistry` execute the same plans with a sync or an asyncio client, so the
logic exists once.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from cluster.keys import Keys
from cluster.records import (
    AdapterListing,
    AdapterRecord,
    ApiKeyInfo,
    DesiredState,
    HotAdapter,
    Location,
    RegistryStatus,
    ReplicaInfo,
    ResolvedRequest,
    ServedBase,
    TenantInfo,
    WarmTarget,
    key_id,
)
from lora_core.base_shape import BaseShape
from lora_core.errors import (
    AdapterAlreadyExists,
    AdapterDraining,
    AdapterNotFound,
    InvalidRequest,
    PinRefused,
    StaleEpoch,
    Unauthorized,
)
from lora_core.identity import AdapterRef

T = TypeVar("T")
Arg = str | int | float


@dataclass(frozen=True, slots=True)
class Plan(Generic[T]):
    """One round trip. script: a name in SCRIPTS (args are ARGV after the namespace),
    or None for a plain command (args[0] is the command). parse: reply -> value."""

    script: str | None
    args: tuple[Arg, ...]
    parse: Callable[[Any], T]


def _list(x: Any) -> list[Any]:
    # cjson encodes an empty Lua table as {}, so empty arrays arrive as dicts
    return x if isinstance(x, list) else []


def _locations(raw: Any) -> tuple[Location, ...]:
    return tuple(sorted(Location(r[0], r[1], r[2]) for r in _list(raw)))


def _warm(raw: str) -> WarmTarget | None:
    if not raw:
        return None
    n, pool = raw.split("|", 1)
    return WarmTarget(int(n), pool)


def _status(name: str, reply: list[Any]) -> list[Any]:
    """Raise the typed error a non-"ok" script status stands for; return the rest."""
    status, rest = reply[0], reply[1:]
    if status == "ok":
        return rest
    if status == "not_found":
        raise AdapterNotFound(name)
    if status == "draining":
        raise AdapterDraining(name)
    if status == "unauthorized":
        raise Unauthorized("missing or unknown API key; allowed: a key issued by `tenants key`")
    if status == "no_tenant":
        raise InvalidRequest(
            f"tenant {rest[0]!r} does not exist; allowed: a tenant that `tenants list` shows "
            "(`tenants create` makes one)"
        )
    raise AssertionError(f"unexpected script status {status!r}")


def script(name: str, args: tuple[Arg, ...], parse: Callable[[list[Any]], T], subject: str):
    """A script plan whose JSON reply is status-checked (errors named after subject)."""

    def _parse(raw: str) -> T:
        return parse(_status(subject, json.loads(raw)))

    return Plan(name, args, _parse)


def _fenced(replica_id: str, epoch: int, reply: list[Any]) -> list[Any] | None:
    """None when the lease lapsed; raise StaleEpoch when a newer epoch exists."""
    if reply[0] == "stale":
        raise StaleEpoch(
            f"replica {replica_id!r} epoch {epoch} is stale (current epoch {reply[1]}); "
            "a newer registration of this replica id exists"
        )
    if reply[0] == "lapsed":
        return None
    return reply[1:]


def fenced_write(name: str, args: tuple[Arg, ...], replica_id: str, epoch: int, subject: str):
    """A replica write: refused with StaleEpoch when (replica_id, epoch) is not the lease."""

    def _parse(raw: str) -> list[Any]:
        reply = json.loads(raw)
        rest = _fenced(replica_id, epoch, reply)
        if rest is None:
            raise StaleEpoch(
                f"replica {replica_id!r} lease for epoch {epoch} lapsed; re-register first"
            )
        return _status(subject, reply)

    return Plan(name, args, _parse)


def heartbeat(replica_id: str, epoch: int, ttl_ms: int) -> Plan[bool]:
    def _parse(raw: str) -> bool:
        return _fenced(replica_id, epoch, json.loads(raw)) is not None

    return Plan("heartbeat", (replica_id, epoch, ttl_ms), _parse)


def deregister_replica(replica_id: str, epoch: int) -> Plan[bool]:
    """True: the record of (replica_id, epoch) is gone; False: a newer epoch holds the id."""
    return Plan("deregister_replica", (replica_id, epoch), lambda raw: json.loads(raw)[0] == "ok")


def pin_refused(name: str, slots: int, held: list[str]) -> PinRefused:
    """The refusal of pinning name: replicas have slots GPU adapter slots and the adapters
    in held are pinned already, so one more pin would leave them no evictable slot."""
    already = f"{len(held)} pinned already ({', '.join(held)})" if held else "none pinned yet"
    advice = "; unpin one of them first" if held else ""
    return PinRefused(
        f"pinning {name!r} would leave replicas no evictable GPU adapter slot: each has "
        f"{slots} slots (max_loras) and {already}; allowed: at most {slots - 1} pinned at "
        f"a time (max_loras - 1, over all pools: mixed replicas take every pin){advice}"
    )


def pin(name: str, pool: str) -> Plan[None]:
    """Pin name to pool; PinRefused when that would leave replicas no evictable slot."""

    def _parse(raw: str) -> None:
        reply = json.loads(raw)
        if reply[0] == "refused":
            raise pin_refused(name, int(reply[1]), _list(reply[2]))
        _status(name, reply)

    return Plan("pin", (name, pool), _parse)


def get_adapter(keys: Keys, name: str) -> Plan[AdapterRecord]:
    def _parse(h: dict[str, str]) -> AdapterRecord:
        if not h:
            raise AdapterNotFound(name)
        return AdapterRecord.from_hash(h)

    return Plan(None, ("HGETALL", keys.adapter(name)), _parse)


def resolve_key(keys: Keys, key_hash: str) -> Plan[str | None]:
    return Plan(None, ("GET", keys.apikey(key_hash)), lambda v: v)


def set_base_shape(keys: Keys, model_id: str, shape: BaseShape) -> Plan[None]:
    blob = json.dumps(dataclasses.asdict(shape), sort_keys=True)
    return Plan(None, ("SET", keys.base(model_id), blob), lambda _: None)


def get_base_shape(keys: Keys, model_id: str) -> Plan[BaseShape | None]:
    return Plan(
        None,
        ("GET", keys.base(model_id)),
        lambda v: BaseShape.from_record(json.loads(v)) if v else None,
    )


def set_served(keys: Keys, served: ServedBase) -> Plan[None]:
    return Plan(None, ("SET", keys.served, served.to_json()), lambda _: None)


def served_name_refused(name: str) -> InvalidRequest:
    """The refusal of an adapter named after the served base model."""
    return InvalidRequest(
        f"adapter name {name!r} is the base model's id (requests for it get the base "
        "model); allowed: any other name"
    )


def served_shadows(name: str, state: str) -> AdapterAlreadyExists:
    """The refusal of serving the base model under name while an adapter in state
    ("active" / "draining") is registered under it."""
    if state == "draining":
        state, out = (
            " (draining)",
            f"wait until its replicas unload it (lorafleet adapters show {name} lists them)",
        )
    else:
        state, out = "", f"unregister the adapter (lorafleet adapters unregister {name})"
    return AdapterAlreadyExists(
        f"an adapter named {name!r} is registered{state}, and this cluster serves its "
        "base model under that id, so requests naming the adapter would get the base "
        f"model; allowed: {out}, or serve the base model under another served_model_name"
    )


def publish_served(served: ServedBase) -> Plan[None]:
    """Store served unless an adapter record (active or draining) holds its id:
    AdapterAlreadyExists then, and nothing is written."""

    def _parse(raw: str) -> None:
        reply = json.loads(raw)
        if reply[0] == "exists":
            raise served_shadows(served.model_id, reply[2])
        _status("", reply)

    return Plan("publish_served", (served.model_id, served.to_json()), _parse)


def get_served(keys: Keys) -> Plan[ServedBase | None]:
    return Plan(None, ("GET", keys.served), lambda v: ServedBase.from_json(v) if v else None)


def adapter_names(keys: Keys) -> Plan[list[str]]:
    return Plan(None, ("SMEMBERS", keys.adapters), lambda v: sorted(v))


def list_tenants(keys: Keys) -> Plan[list[str]]:
    return Plan(None, ("SMEMBERS", keys.tenants), lambda v: sorted(v))


def resolve_request(name: str, key_hash: str, require_key: bool) -> Plan[ResolvedRequest]:
    def _parse(rest: list[Any]) -> ResolvedRequest:
        rec, tenant, locs = rest
        return ResolvedRequest(
            ref=AdapterRef(
                name=rec["name"],
                version=int(rec["version"]),
                content_hash=rec["content_hash"],
                path=rec["path"],
                rank=int(rec["rank"]),
                base_model=rec.get("base_model", ""),
            ),
            tenant=tenant or None,
            locations=_locations(locs),
        )

    return script("resolve_request", (name, key_hash, int(require_key)), _parse, name)


def register_adapter(
    record: AdapterRecord, replace: bool, *, owner_given: bool = True, public_given: bool = True
) -> Plan[AdapterRecord]:
    """Store record (its version is ignored) as its name's next version. On a replace of
    an active adapter, its owner / public flag are kept unless given (owner_given /
    public_given); the reply is the record as stored."""
    args = (
        record.name,
        int(replace),
        record.owner,
        int(record.public) if public_given else "",
        record.content_hash,
        record.path,
        record.rank,
        record.base_model,
        json.dumps(list(record.target_modules)),
        record.created,
        int(owner_given),
    )

    def _parse(raw: str) -> AdapterRecord:
        reply = json.loads(raw)
        if reply[0] == "exists":
            raise AdapterAlreadyExists(
                f"adapter {record.name!r} already exists (version {reply[1]}); "
                "allowed: pass replace (--replace) to register a new version"
            )
        if reply[0] == "served":
            raise served_name_refused(record.name)
        version, owner, public = _status(record.name, reply)
        return dataclasses.replace(record, version=int(version), owner=owner, public=public == "1")

    return Plan("register_adapter", args, _parse)


def create_tenant(name: str, now: float) -> Plan[None]:
    def _parse(raw: str) -> None:
        if json.loads(raw)[0] == "exists":
            raise InvalidRequest(f"tenant {name!r} already exists")

    return Plan("create_tenant", (name, now), _parse)


def delete_tenant(tenant: str) -> Plan[tuple[int, int]]:
    """Delete tenant with its keys and grants: (keys revoked, grants removed)."""

    def _parse(raw: str) -> tuple[int, int]:
        reply = json.loads(raw)
        if reply[0] == "owns":
            names = ", ".join(reply[1])
            raise InvalidRequest(
                f"tenant {tenant!r} owns adapters ({names}); allowed: delete a tenant that "
                "owns none: unregister them, or give them another owner first "
                "(`adapters register NAME PATH --replace --tenant OTHER`)"
            )
        keys, grants = _status("", reply)
        return int(keys), int(grants)

    return Plan("delete_tenant", (tenant,), _parse)


def set_tenant_limit(tenant: str, requests_per_minute: int) -> Plan[None]:
    """tenant's own limit (0 removes it); InvalidRequest when there is no such tenant."""
    return script("set_tenant_limit", (tenant, requests_per_minute), lambda _: None, "")


def tenant_limit(keys: Keys, tenant: str) -> Plan[int]:
    """tenant's own limit, 0 for none (or no such tenant): one HGET."""
    field = ("HGET", keys.tenant(tenant), "requests_per_minute")
    return Plan(None, field, lambda v: int(v) if v else 0)


def tenant_limits() -> Plan[list[TenantInfo]]:
    def _parse(rest: list[Any]) -> list[TenantInfo]:
        return sorted(TenantInfo(t, int(rpm) if rpm else 0) for t, rpm in _list(rest[0]))

    return script("tenant_limits", (), _parse, "")


def admit_request(tenant: str, limit: int, period_us: int) -> Plan[int]:
    """One request of tenant under `limit` requests per period_us (GCRA, the
    `admit_request` script): 0 when admitted, else the microseconds until a request would
    be (nothing is written then). The emission interval is period_us / limit rounded up to
    a whole microsecond, so a burst is exactly `limit` requests and the sustained rate at
    most limit per period."""
    interval_us = -(-period_us // limit)

    def _parse(raw: str) -> int:
        reply = json.loads(raw)
        return 0 if reply[0] == "ok" else int(reply[1])

    return Plan("admit_request", (tenant, interval_us, limit), _parse)


def list_api_keys(tenant: str) -> Plan[list[ApiKeyInfo]]:
    """tenant's keys sorted by issue time (keys without one first), then id."""

    def _parse(rest: list[Any]) -> list[ApiKeyInfo]:
        keys = [ApiKeyInfo(key_id(h), float(c) if c else None) for h, c in _list(rest[0])]
        return sorted(keys, key=lambda k: (k.created or 0.0, k.key_id))

    return script("list_api_keys", (tenant,), _parse, "")


def revoke_api_keys(tenant: str, prefix: str) -> Plan[list[str]]:
    """Delete tenant's key whose id starts with prefix ('' = all of them); the ids deleted."""

    def _parse(raw: str) -> list[str]:
        reply = json.loads(raw)
        if reply[0] == "no_key":
            raise InvalidRequest(
                f"tenant {tenant!r} has no key with id {prefix!r}; "
                f"allowed: an id listed by `tenants keys {tenant}`"
            )
        if reply[0] == "ambiguous":
            ids = ", ".join(sorted(key_id(h) for h in reply[1]))
            raise InvalidRequest(
                f"key id {prefix!r} matches {len(reply[1])} keys of tenant {tenant!r} "
                f"({ids}); allowed: a longer prefix that matches one"
            )
        return sorted(key_id(h) for h in _list(_status("", reply)[0]))

    return Plan("revoke_api_keys", (tenant, prefix), _parse)


def listing(rest: list[Any]) -> list[AdapterListing]:
    out = [
        AdapterListing(
            record=AdapterRecord.from_hash(rec),
            pin=pin or None,
            warm=_warm(warm),
            locations=_locations(locs),
        )
        for rec, pin, warm, locs in _list(rest[0])
    ]
    return sorted(out, key=lambda a: a.record.name)


def visible(rest: list[Any]) -> list[AdapterRef]:
    refs = [
        AdapterRef(name=n, version=int(v), content_hash=h, path=p, rank=int(r), base_model=b)
        for n, v, h, p, r, b in _list(rest[0])
    ]
    return sorted(refs, key=lambda ref: ref.name)


def desired(rest: list[Any]) -> DesiredState:
    version, pins, warm, draining, refs = rest
    return DesiredState(
        version=int(version),
        pins=dict(pins) if isinstance(pins, dict) else {},
        warm={n: _warm(w) for n, w in (warm.items() if isinstance(warm, dict) else [])},
        draining=frozenset(_list(draining)),
        refs={
            n: AdapterRecord.from_hash(r).ref
            for n, r in (refs.items() if isinstance(refs, dict) else [])
            if r
        },
    )


def replicas(rest: list[Any]) -> list[ReplicaInfo]:
    out = [
        ReplicaInfo(
            replica_id=rec["id"],
            pool=rec["pool"],
            deployment=rec["deployment"],
            slot_capacity=int(rec["slot_capacity"]),
            epoch=int(rec["epoch"]),
            live=bool(live),
            registered=float(rec["registered"]),
            gpu_adapters=int(gpu),
            cpu_adapters=int(cpu),
        )
        for rec, live, gpu, cpu in _list(rest[0])
    ]
    return sorted(out, key=lambda r: r.replica_id)


def status(rest: list[Any]) -> RegistryStatus:
    adapters, draining, tenants, pins, warm, version, total, live = rest
    return RegistryStatus(
        adapters=int(adapters),
        draining=int(draining),
        tenants=int(tenants),
        pins=int(pins),
        warm=int(warm),
        desired_version=int(version),
        replicas_total=int(total),
        replicas_live={p: int(n) for p, n in sorted(live.items())},
    )


def locations(rest: list[Any]) -> tuple[Location, ...]:
    return _locations(rest[0])


def counts(names: list[str], rest: list[Any]) -> dict[str, int]:
    """names zipped with the counts a script returned for them, in order."""
    return dict(zip(names, (int(c) for c in _list(rest[0])), strict=True))


def hot(rest: list[Any]) -> list[HotAdapter]:
    """hot_adapters rows, in the script's order (most in flight per copy first)."""
    return [
        HotAdapter(
            ref=AdapterRef(
                name=n, version=int(v), content_hash=h, path=p, rank=int(r), base_model=b
            ),
            in_flight=int(flight),
            copies=int(copies),
        )
        for n, v, h, p, r, b, flight, copies in _list(rest[0])
    ]


def names(rest: list[Any]) -> list[str]:
    return sorted(_list(rest[0]))

"""The cluster registry: adapters, tenants and keys, residency, leases, pins, warm targets.

`Registry` (sync, thread-safe) and `AsyncRegistry` (asyncio) expose the same
methods, defined once in `_Api`: each builds an I/O-free `cluster.ops.Plan` and
hands it to the class's executor, so every method is exactly one Redis round trip
(the request-path `resolve_request` included). On `AsyncRegistry` each method
returns an awaitable of the documented type. The key layout lives in
`cluster.keys`; the atomic multi-key logic in `cluster.scripts`; the fleet methods
(replicas, residency, pins, warm targets) in `cluster.registry_fleet`.

Liveness: a replica is live while `{ns}:lease:{id}` holds its current epoch.
Every read that answers "where" checks that lease inside the same script, so a
lapsed lease drops the replica from every answer at once, with no reliance on
keyspace-expiry events.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence

from cluster import ops
from cluster.catalog import validate_for_registry
from cluster.client import DEFAULT_URL, AsyncExecutor, RetryPolicy, SyncExecutor
from cluster.hints import AsyncHintSubscription, HintSubscription
from cluster.keys import Keys, check_name
from cluster.records import (
    AdapterListing,
    AdapterRecord,
    ApiKeyInfo,
    ResolvedRequest,
    ServedBase,
    TenantInfo,
    check_key_id,
    check_requests_per_minute,
)
from cluster.registry_fleet import FleetApi, Reply, T
from lora_core.base_shape import BaseShape
from lora_core.errors import AdapterIncompatible, AdapterLoadFailed, AdapterNotFound
from lora_core.identity import AdapterRef

API_KEY_PREFIX = "lf-"
MAX_LORA_RANK = 1024  # the largest rank limit a registry takes
LIST_PAGE = 256
RATE_PERIOD_MS = 60_000  # a tenant's limit is requests per minute


def hash_key(api_key: str) -> str:
    """sha256 hex of an API key: the only form in which keys are stored."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def _check_served(name: str, base_model: str | None, served: ServedBase) -> None:
    if name == served.model_id:
        raise ops.served_name_refused(name)
    if base_model is not None and base_model != served.model_id:
        raise AdapterIncompatible(
            "base_model",
            f"{base_model!r} is not the model this cluster serves",
            f"{served.model_id!r}, or leave it out",
        )


def _grant_args(tenant: str, adapter: str, grant: int) -> tuple[str, str, int]:
    # Both names checked: a ':' in either can spell another key of the layout (tenant
    # "t:keys" is t's key set, which passes the script's tenant-exists check).
    return check_name("tenant", tenant), check_name("adapter", adapter), grant


def _changed(reply: list) -> bool:
    return reply[0] == 1


class _Api(FleetApi):
    """The registry methods, shared by the sync and asyncio registries (the replica,
    residency and desired-state ones in `cluster.registry_fleet`)."""

    def __init__(self, url: str, namespace: str, max_lora_rank: int, retry: RetryPolicy):
        if not 1 <= max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank={max_lora_rank}; allowed: 1 .. {MAX_LORA_RANK}")
        self.url = url
        self.keys = Keys(namespace)
        self.max_lora_rank = max_lora_rank
        self.retry = retry

    # -- adapter catalog ---------------------------------------------------------

    def register_adapter(
        self,
        name: str,
        path: str,
        *,
        base_model: str | None = None,
        tenant: str | None = None,
        public: bool | None = None,
        replace: bool = False,
        base: BaseShape | None = None,
        served: ServedBase | None = None,
        max_lora_rank: int | None = None,
    ) -> Reply[AdapterRecord]:
        """Validate the PEFT directory at path, then record it as name's next version.

        Refused before anything is written: invalid directory (AdapterIncompatible /
        AdapterLoadFailed from lora_core's validation, rank over max_lora_rank, or a
        shape that does not fit `base` when given), an existing name without replace
        (AdapterAlreadyExists), an unknown tenant (InvalidRequest), the id of the base
        model the cluster serves (InvalidRequest; checked in the writing script too, so a
        cluster publishing it meanwhile cannot shadow the adapter). tenant becomes the
        owner (always authorized). Returns the stored record.

        tenant / public None: a replace keeps the adapter's owner / public flag (a new
        version must not lock its users out); a new adapter gets none / private. A name
        being unregistered (draining) is registered afresh: its old grants are dropped.

        served (the cluster's base model, `get_served`): the adapter must fit its shapes
        and rank limit, may not take its id as name, and is recorded as adapting it
        (a different explicit base_model is refused: the cluster serves one base).
        max_lora_rank: this call's rank limit instead of the registry's (served's applies too).
        """
        check_name("adapter", name)
        if not path.strip():
            # Path("") is the working directory: an empty field must not register it
            raise AdapterLoadFailed(
                "path is empty; allowed: an existing local directory holding "
                "adapter_config.json and adapter_model.safetensors"
            )
        if tenant is not None:
            check_name("tenant", tenant)
        max_rank = self.max_lora_rank if max_lora_rank is None else max_lora_rank
        if served is not None:
            _check_served(name, base_model, served)
            base = base or served.shape
            max_rank = min(max_rank, served.max_lora_rank)
            base_model = served.model_id

        def build() -> ops.Plan[AdapterRecord]:
            manifest = validate_for_registry(path, max_rank, base)
            record = AdapterRecord(
                name=name,
                version=0,
                content_hash=manifest.content_hash,
                path=manifest.path,
                rank=manifest.rank,
                base_model=base_model if base_model is not None else manifest.base_model,
                target_modules=tuple(sorted(manifest.target_modules)),
                owner=tenant or "",
                public=bool(public),
                created=time.time(),
                state="active",
            )
            return ops.register_adapter(
                record, replace, owner_given=tenant is not None, public_given=public is not None
            )

        return self._run_built(build)

    def set_served(self, served: ServedBase) -> Reply[None]:
        """Store served as the base model this cluster serves, unchecked (tests, tools);
        deployments use publish_served."""
        check_name("base model", served.model_id)
        return self._run(ops.set_served(self.keys, served))

    def publish_served(self, served: ServedBase) -> Reply[None]:
        """Publish the base model this cluster serves (the deployment does this at start
        and again every few seconds). AdapterAlreadyExists: an adapter (active or
        draining) is registered under its id, which requests would then resolve to the
        base model; nothing is written. Check and write are one script, and registration
        refuses the served id in its own, so no interleaving leaves both."""
        check_name("base model", served.model_id)
        return self._run(ops.publish_served(served))

    def get_served(self) -> Reply[ServedBase | None]:
        """The base model this cluster serves, or None before a deployment published it."""
        return self._run(ops.get_served(self.keys))

    def set_base_shape(self, model_id: str, shape: BaseShape) -> Reply[None]:
        """Store a base model's shapes, for `register --base-model` outside a cluster."""
        return self._run(ops.set_base_shape(self.keys, check_name("base model", model_id), shape))

    def get_base_shape(self, model_id: str) -> Reply[BaseShape | None]:
        """The shapes stored for model_id, or None."""
        return self._run(ops.get_base_shape(self.keys, model_id))

    def get_adapter(self, name: str) -> Reply[AdapterRecord]:
        """The stored record of name (AdapterNotFound if none)."""
        return self._run(ops.get_adapter(self.keys, name))

    def show_adapter(self, name: str) -> Reply[AdapterListing]:
        """name's record with its pin, warm target and live locations."""

        def _one(rest: list) -> AdapterListing:
            found = ops.listing(rest)
            if not found:
                raise AdapterNotFound(name)
            return found[0]

        return self._run(ops.script("list_adapters", ("names", name), _one, name))

    def list_adapter_names(self) -> Reply[list[str]]:
        """Every registered adapter name, sorted (cheap: one SMEMBERS)."""
        return self._run(ops.adapter_names(self.keys))

    def list_adapters(self, names: Sequence[str] | None = None) -> Reply[list[AdapterListing]]:
        """Adapters (sorted by name; unknown names skipped) with pin, warm target and live
        locations; names None means all in one script, which blocks Redis ~25 ms per
        1k adapters: page big catalogs through list_adapter_names (LIST_PAGE names per call)."""
        args = ("all",) if names is None else ("names", *names)
        return self._run(ops.script("list_adapters", args, ops.listing, ""))

    def visible_adapters(
        self, tenant: str | None, names: Sequence[str] | None = None
    ) -> Reply[list[AdapterRef]]:
        """Refs of the active adapters tenant may use (owned, public or granted; every
        active one for tenant None), sorted by name: what `/v1/models` lists, in one round
        trip with no residency reads (list_adapters + one authorize per private adapter
        cost a round trip each). names None means the whole catalog in one script (Redis
        blocks ~5 ms per 1k adapters); page big catalogs like list_adapters."""
        args = (tenant or "", "all") if names is None else (tenant or "", "names", *names)
        return self._run(ops.script("visible_adapters", args, ops.visible, ""))

    def unregister_adapter(self, name: str) -> Reply[str]:
        """Stop new requests for name. Returns "removed" when no live replica holds it
        (the record is deleted now), else "draining" (deleted when the last live
        replica removes it, or by `reap`). Pins and warm targets are dropped."""
        return self._run(ops.script("unregister_adapter", (name,), lambda r: r[0], name))

    # -- tenants and keys ----------------------------------------------------------

    def create_tenant(self, name: str) -> Reply[None]:
        """Create tenant name (InvalidRequest if it exists)."""
        return self._run(ops.create_tenant(check_name("tenant", name), time.time()))

    def delete_tenant(self, name: str) -> Reply[tuple[int, int]]:
        """Delete tenant name, its API keys (they stop resolving at once), its grants and
        its rate-limit state (a namesake created later starts afresh); returns (keys
        revoked, grants removed). InvalidRequest: no such tenant, or it owns active
        adapters (nothing is deleted then: a tenant created later under the same name
        would own them)."""
        return self._run(ops.delete_tenant(check_name("tenant", name)))

    def list_tenants(self) -> Reply[list[str]]:
        return self._run(ops.list_tenants(self.keys))

    def list_tenant_limits(self) -> Reply[list[TenantInfo]]:
        """Every tenant with its own request rate limit (0: none), sorted by name."""
        return self._run(ops.tenant_limits())

    def set_tenant_limit(self, tenant: str, requests_per_minute: int) -> Reply[None]:
        """Limit tenant to requests_per_minute inference requests per minute; 0 removes its
        own limit (the cluster's tenant_requests_per_minute applies then). ValueError: not
        an integer >= 0; InvalidRequest: no such tenant (nothing is written). Deleting the
        tenant deletes its limit. Ingresses see a change within their cache's few seconds."""
        args = (check_name("tenant", tenant), check_requests_per_minute(requests_per_minute))
        return self._run(ops.set_tenant_limit(*args))

    def tenant_limit(self, tenant: str) -> Reply[int]:
        """tenant's own request rate limit; 0 for none, and for an unknown tenant."""
        return self._run(ops.tenant_limit(self.keys, check_name("tenant", tenant)))

    def admit_request(self, tenant: str, limit: int, period_ms: int = RATE_PERIOD_MS) -> Reply[int]:
        """Admit one request of tenant under a limit of `limit` requests per period_ms, by
        GCRA on Redis's clock (one round trip, `cluster.scripts.limits`): 0 when admitted,
        else the microseconds until a request would be (a refusal changes nothing). The
        emission interval T is period_ms / limit (rounded up to a whole microsecond): a
        tenant idle for a period may send `limit` requests at once, and at most one per T
        after that. Every caller with the same tenant shares one budget. ValueError: limit
        or period_ms < 1."""
        if limit < 1 or period_ms < 1:
            raise ValueError(f"limit={limit}, period_ms={period_ms}; allowed: both >= 1")
        return self._run(ops.admit_request(check_name("tenant", tenant), limit, period_ms * 1000))

    def issue_api_key(self, tenant: str) -> Reply[str]:
        """A new key "lf-<43 urlsafe chars>" for tenant; only its sha256 (and the time
        it was issued) is stored. Its id is `records.key_id(hash_key(key))`."""
        key = API_KEY_PREFIX + secrets.token_urlsafe(32)
        # checked here: a name with ':' can spell another key of the layout (tenant
        # "t:keys" is t's key set), which the script's tenant-exists check would accept
        args = (check_name("tenant", tenant), hash_key(key), time.time())
        return self._run(ops.script("issue_api_key", args, lambda _: key, ""))

    def list_api_keys(self, tenant: str) -> Reply[list[ApiKeyInfo]]:
        """tenant's keys (ids and issue times, oldest first). InvalidRequest: no tenant."""
        return self._run(ops.list_api_keys(check_name("tenant", tenant)))

    def revoke_api_key(self, tenant: str, key_id: str) -> Reply[str]:
        """Delete the one key of tenant whose id starts with key_id (6-64 hex chars);
        it stops resolving at once. Returns its id. InvalidRequest: no tenant, no such
        key, or a prefix matching several keys (nothing is deleted then)."""
        plan = ops.revoke_api_keys(check_name("tenant", tenant), check_key_id(key_id))
        return self._run(ops.Plan(plan.script, plan.args, lambda raw: plan.parse(raw)[0]))

    def revoke_all_api_keys(self, tenant: str) -> Reply[list[str]]:
        """Delete every key of tenant at once. Returns their ids, sorted."""
        return self._run(ops.revoke_api_keys(check_name("tenant", tenant), ""))

    def grant(self, tenant: str, adapter: str) -> Reply[bool]:
        """Let tenant use adapter. True if newly granted. AdapterNotFound / InvalidRequest."""
        return self._run(ops.script("grant", _grant_args(tenant, adapter, 1), _changed, adapter))

    def revoke(self, tenant: str, adapter: str) -> Reply[bool]:
        """Withdraw a grant. True if one was removed (owner/public access is unaffected)."""
        return self._run(ops.script("grant", _grant_args(tenant, adapter, 0), _changed, adapter))

    def resolve_key(self, api_key: str) -> Reply[str | None]:
        """The tenant owning api_key, or None."""
        return self._run(ops.resolve_key(self.keys, hash_key(api_key)))

    def authorize(self, tenant: str, adapter: str) -> Reply[bool]:
        """Whether tenant may send new requests to adapter (False if unknown or draining)."""
        args = (check_name("tenant", tenant), adapter)
        return self._run(ops.script("authorize", args, lambda r: bool(r[0]), adapter))

    def resolve_request(
        self, api_key: str | None, model_name: str, *, auth: bool = True
    ) -> Reply[ResolvedRequest]:
        """The request path, one round trip: key -> tenant, adapter -> ref, access
        check, live locations of that exact version.

        Unauthorized: a bad key, or no key while auth is on. AdapterNotFound: unknown
        and forbidden alike (existence must not leak). AdapterDraining: unregistered.
        With auth off and no key, every adapter is allowed (tenant None).
        """
        key_hash = hash_key(api_key) if api_key is not None else ""
        return self._run(ops.resolve_request(model_name, key_hash, auth))


class Registry(_Api):
    """Sync registry on a pooled, thread-safe redis-py client."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        namespace: str = "lorafleet",
        *,
        max_lora_rank: int = 64,
        retry: RetryPolicy = RetryPolicy(),
    ):
        super().__init__(url, namespace, max_lora_rank, retry)
        self._exec = SyncExecutor(url, self.keys.ns, retry)

    @property
    def client(self):
        """The underlying redis.Redis (for benchmarks and tests)."""
        return self._exec.client

    def _run(self, plan: ops.Plan[T]) -> T:
        return self._exec.run(plan)

    def _run_built(self, build: Callable[[], ops.Plan[T]]) -> T:
        return self._run(build())

    def subscribe_hints(self) -> HintSubscription:
        """Subscribe to desired-state hints (see HintSubscription)."""
        return HintSubscription(self._exec.client, self.keys.hints, self.url)

    def close(self) -> None:
        self._exec.close()


class AsyncRegistry(_Api):
    """asyncio registry: the same methods as Registry, each returning an awaitable."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        namespace: str = "lorafleet",
        *,
        max_lora_rank: int = 64,
        retry: RetryPolicy = RetryPolicy(),
    ):
        super().__init__(url, namespace, max_lora_rank, retry)
        self._exec = AsyncExecutor(url, self.keys.ns, retry)

    @property
    def client(self):
        """The underlying redis.asyncio.Redis."""
        return self._exec.client

    def _run(self, plan: ops.Plan[T]) -> Awaitable[T]:
        return self._exec.run(plan)

    async def _run_built(self, build: Callable[[], ops.Plan[T]]) -> T:
        # build reads files (a registration reads, hashes and scans the whole adapter):
        # on the event loop that stalled every request the ingress was serving
        return await self._run(await asyncio.to_thread(build))

    def subscribe_hints(self) -> AsyncHintSubscription:
        return AsyncHintSubscription(self._exec.client, self.keys.hints, self.url)

    async def close(self) -> None:
        await self._exec.close()

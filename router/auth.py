"""Adapter resolution and tenant auth through the registry (no Ray).

One registry round trip per request resolves (API key, model name) to an immutable
AdapterRef plus where it is resident. Unknown, forbidden and draining (being unloaded)
adapters raise the same `AdapterNotFound`, so a tenant cannot probe which names exist
and clients do not retry a name that is going away. The base model's served name
resolves to None (no adapter) without touching the adapter catalog.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lora_core.errors import AdapterDraining, AdapterNotFound, RegistryUnavailable, Unauthorized
from lora_core.identity import AdapterRef

MISSING_KEY = "missing API key; send 'Authorization: Bearer <key>'"  # key_refusal(None)
# Adapter names per registry script of a /v1/models listing (the CLI's LIST_PAGE): one
# script over a 10k catalog holds Redis ~50 ms, and any caller may list in a loop.
MODELS_PAGE = 256
INVALID_KEY = "invalid API key; allowed: a key issued by `lorafleet tenants key`"


class RegistryClient(Protocol):
    """The part of `cluster.registry.AsyncRegistry` the ingress uses."""

    async def resolve_request(self, api_key: str | None, model_name: str, *, auth: bool): ...

    async def resolve_key(self, api_key: str) -> str | None: ...

    async def list_adapter_names(self) -> list[str]: ...

    async def visible_adapters(
        self, tenant: str | None, names: Sequence[str] | None = None
    ) -> list[AdapterRef]: ...


@dataclass(frozen=True)
class Resolved:
    """adapter: None for the base model. residency: (replica_id, tier) from the registry."""

    adapter: AdapterRef | None
    residency: tuple[tuple[str, str], ...] = ()
    tenant: str | None = None


class NotBearer(str):
    """`bearer_key`'s answer for an Authorization header of another scheme ("Token abc",
    "Basic ...", a bare key): never a key. Its text is the header's scheme ("" for a
    value without one, which may be the key itself and is never echoed). With auth on
    it is refused naming the scheme (`key_refusal`); with auth off it is ignored, as
    any key is."""


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header; None when the header is absent
    or its key empty; a `NotBearer` for another scheme.
    Example: "Bearer abc" -> "abc"; "Token abc" -> NotBearer("Token"); "abc" -> NotBearer("")."""
    if not authorization or not authorization.strip():
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return NotBearer(scheme if key.strip() else "")
    return key.strip() or None


def key_refusal(api_key: str | None, wanted: str = "send 'Authorization: Bearer <key>'") -> str:
    """Why `api_key` cannot authenticate anyone: missing, or a header of another scheme.
    wanted: what the caller should send instead."""
    if api_key is None:
        return f"missing API key; {wanted}"
    if not api_key:
        return f"the Authorization header names no scheme; {wanted}"
    return f"unsupported Authorization scheme {api_key[:32]!r}; {wanted}"


class AdapterResolver:
    """Resolves `model` names for one cluster.

    base_name: the base model's served name (requests for it use no adapter).
    auth: require a valid tenant API key on every inference request.
    admin_key: the key the admin endpoints require ("" = admin endpoints disabled).
    """

    def __init__(self, registry: RegistryClient | None, base_name: str, auth: bool, admin_key: str):
        self.registry = registry
        self.base_name = base_name
        self.auth = auth
        self.admin_key = admin_key

    async def tenant(self, api_key: str | None) -> str | None:
        """The caller's tenant; None when auth is off. Raises Unauthorized."""
        if not self.auth:
            return None
        self._check_bearer(api_key)
        tenant = await self._registry().resolve_key(api_key)
        if tenant is None:
            raise Unauthorized(INVALID_KEY)
        return tenant

    async def resolve(self, api_key: str | None, model: str) -> Resolved:
        """Resolve one inference request's `model`. Raises Unauthorized / AdapterNotFound."""
        if self.auth:
            self._check_bearer(api_key)
        if model == self.base_name:
            return Resolved(adapter=None, tenant=await self.tenant(api_key))
        # With auth off a client's key (OpenAI clients always send one) is ignored.
        key = api_key if self.auth else None
        try:
            found = await self._registry().resolve_request(key, model, auth=self.auth)
        except Unauthorized:  # the registry's wording differs; one answer on every route
            raise Unauthorized(INVALID_KEY) from None
        except AdapterDraining:
            raise AdapterNotFound(model) from None
        residency = tuple((loc.replica, loc.tier) for loc in found.locations)
        return Resolved(adapter=found.ref, residency=residency, tenant=found.tenant)

    async def visible_adapters(self, api_key: str | None) -> list[AdapterRef]:
        """Adapters the caller may use (all active ones when auth is off), sorted by name."""
        tenant = await self.tenant(api_key)
        if self.registry is None:
            return []
        # No residency reads and no round trip per private adapter: one script per page
        # of names, so Redis serves other requests between pages of a big catalog.
        names = await self.registry.list_adapter_names()
        refs: list[AdapterRef] = []
        for i in range(0, len(names), MODELS_PAGE):
            refs += await self.registry.visible_adapters(tenant, names[i : i + MODELS_PAGE])
        return refs  # names come sorted, and so does each page

    def check_admin(self, api_key: str | None) -> None:
        """Raises Unauthorized unless `api_key` is the admin key."""
        if not self.admin_key:
            raise Unauthorized("admin endpoints are disabled; set admin_key in the app args")
        # Bytes, not str: compare_digest raises TypeError on non-ASCII str (a header
        # byte >= 0x80 arrives as one), which would answer 500 instead of 401.
        wanted = "admin endpoints need 'Authorization: Bearer <admin key>'"
        if isinstance(api_key, NotBearer):
            raise Unauthorized(key_refusal(api_key, wanted))
        if api_key is None or not hmac.compare_digest(api_key.encode(), self.admin_key.encode()):
            raise Unauthorized(wanted)

    @staticmethod
    def _check_bearer(api_key: str | None) -> None:
        """Raises Unauthorized for a missing key or an Authorization header of another
        scheme (the key, if any, is judged by the registry)."""
        if api_key is None or isinstance(api_key, NotBearer):
            raise Unauthorized(key_refusal(api_key))

    def _registry(self) -> RegistryClient:
        if self.registry is None:
            raise RegistryUnavailable("no registry configured (redis_url is empty)")
        return self.registry

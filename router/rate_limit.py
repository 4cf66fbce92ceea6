"""Per-tenant request rate limits at the ingress: GCRA (the generic cell rate algorithm).

A tenant under a limit of L requests per minute may send at most one request per
emission interval T = 60 s / L on average, with a burst of up to L: a tenant idle for a
minute (T x L) may send L requests at once, then one more each T. Exactly: the registry
keeps each limited tenant's theoretical arrival time TAT (`{ns}:rate:{tenant}`, on
Redis's own clock, so the ingresses' clocks never matter); a request at `now` is admitted
iff TAT <= now + (L - 1) x T, and moves TAT to max(TAT, now) + T. Over any interval of
length D a tenant is admitted at most L + D / T requests, and never more than L at once.

Each inference request of a tenant under a limit is one round trip (`admit_request`: a
Lua script reads and moves TAT atomically, so every ingress shares one budget); a refused
request changes nothing (hammering past the limit does not extend the wait) and raises
`TenantRateLimited` (429 / gRPC RESOURCE_EXHAUSTED) with retry_after_s the seconds until a
request would be admitted, rounded up, at least 1. It is checked before any work on the
request's body (`router.admission`), once whatever its prompts and n. The key expires as
TAT passes, so an idle tenant holds none.

A tenant's own limit is read from the registry at most once per `cache_ttl_s` per
ingress, so a tenant without a limit (none of its own and a cluster default of 0) costs
no round trip of its own, and a changed limit applies within `cache_ttl_s` (the TAT
carries over: a tenant owes under the new limit what it owed under the old).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

from lora_core.errors import TenantRateLimited

CACHE_TTL_S = 5.0


class LimitRegistry(Protocol):
    """The part of `cluster.registry.AsyncRegistry` the limiter uses."""

    async def tenant_limit(self, tenant: str) -> int: ...

    async def admit_request(self, tenant: str, limit: int) -> int: ...


def retry_after_s(wait_us: int) -> int:
    """The Retry-After of a refusal whose next admission is wait_us away: whole seconds,
    rounded up, at least 1 (a client waiting that long is admitted). Example:
    20_000_000 -> 20; 19_000_001 -> 20; 1 -> 1."""
    return max(1, math.ceil(wait_us / 1_000_000))


class TenantRateLimiter:
    """Admits or refuses one tenant's requests against its limit.

    registry: where limits and the tenants' arrival times live.
    default_rpm: the limit of tenants without one of their own (0 = none).
    cache_ttl_s: how long a tenant's own limit, once read, is used without reading it
        again.
    monotonic: the cache's clock (the limits' own clock is Redis's).
    """

    def __init__(
        self,
        registry: LimitRegistry,
        default_rpm: int = 0,
        *,
        cache_ttl_s: float = CACHE_TTL_S,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        if default_rpm < 0:
            raise ValueError(f"tenant_requests_per_minute={default_rpm}; allowed: >= 0")
        if cache_ttl_s < 0:
            raise ValueError(f"cache_ttl_s={cache_ttl_s}; allowed: >= 0")
        self.registry = registry
        self.default_rpm = default_rpm
        self.cache_ttl_s = cache_ttl_s
        self.monotonic = monotonic
        self._own: dict[str, tuple[int, float]] = {}  # tenant -> (own limit, read at)

    async def limit_of(self, tenant: str) -> int:
        """The limit tenant's requests are held to now (0 = none): its own, else the
        default."""
        now = self.monotonic()
        cached = self._own.get(tenant)
        if cached is not None and now - cached[1] < self.cache_ttl_s:
            own = cached[0]
        else:
            own = await self.registry.tenant_limit(tenant)
            self._own[tenant] = (own, now)
        return own or self.default_rpm

    async def admit(self, tenant: str) -> None:
        """Admit one request of tenant; TenantRateLimited when its limit's rate has none
        left now (nothing is counted then). RegistryUnavailable when Redis does not answer
        (the request is refused then too: a limit that Redis cannot check is not silently
        lifted)."""
        limit = await self.limit_of(tenant)
        if limit == 0:
            return
        wait_us = await self.registry.admit_request(tenant, limit)
        if wait_us:
            raise TenantRateLimited(tenant, limit, retry_after_s(wait_us))

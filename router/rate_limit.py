"""Per-tenant request rate limits at the ingress: a fixed one-minute window per tenant.

Each inference request of a tenant under a limit is counted in the registry under the
current unix minute (`count_request`: one INCR with the counter's expiry, one round
trip); a count past the limit is refused with `TenantRateLimited` (429 / gRPC
RESOURCE_EXHAUSTED, retry after the seconds left in the minute), before any work on its
body (`router.admission`), once whatever its prompts and n. Refused requests count
too, as in any fixed-window limiter: a client that keeps sending past its limit stays
refused until the minute ends, and a tenant may send up to twice its limit across a
minute's boundary.

A tenant's own limit is read from the registry at most once per `cache_ttl_s` per
ingress, so a tenant without a limit (none of its own and a cluster default of 0) costs
no round trip of its own, and a changed limit applies within `cache_ttl_s`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

from lora_core.errors import TenantRateLimited

WINDOW_S = 60
CACHE_TTL_S = 5.0


class LimitRegistry(Protocol):
    """The part of `cluster.registry.AsyncRegistry` the limiter uses."""

    async def tenant_limit(self, tenant: str) -> int: ...

    async def count_request(self, tenant: str, minute: int) -> int: ...


def window_of(now: float) -> tuple[int, int]:
    """(unix minute of now, whole seconds until it ends, at least 1): a client retrying
    after that many seconds is in the next window. Example: 120.0 -> (2, 60);
    179.2 -> (2, 1); 150.5 -> (2, 30)."""
    minute = int(now // WINDOW_S)
    return minute, max(1, math.ceil((minute + 1) * WINDOW_S - now))


class TenantRateLimiter:
    """Admits or refuses one tenant's requests against its limit.

    registry: where limits and counters live.
    default_rpm: the limit of tenants without one of their own (0 = none).
    cache_ttl_s: how long a tenant's own limit, once read, is used without reading it
        again.
    clock: unix seconds (the windows: every ingress counts into the same minute's key,
        so their clocks should agree to a second). monotonic: the cache's clock.
    """

    def __init__(
        self,
        registry: LimitRegistry,
        default_rpm: int = 0,
        *,
        cache_ttl_s: float = CACHE_TTL_S,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        if default_rpm < 0:
            raise ValueError(f"tenant_requests_per_minute={default_rpm}; allowed: >= 0")
        if cache_ttl_s < 0:
            raise ValueError(f"cache_ttl_s={cache_ttl_s}; allowed: >= 0")
        self.registry = registry
        self.default_rpm = default_rpm
        self.cache_ttl_s = cache_ttl_s
        self.clock = clock
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
        """Count one request of tenant; TenantRateLimited when it is past the limit.
        RegistryUnavailable when Redis does not answer (the request is refused then too:
        a limit that Redis cannot check is not silently lifted)."""
        limit = await self.limit_of(tenant)
        if limit == 0:
            return
        minute, left = window_of(self.clock())
        if await self.registry.count_request(tenant, minute) > limit:
            raise TenantRateLimited(tenant, limit, left)

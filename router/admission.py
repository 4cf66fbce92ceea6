"""The first step of every inference request, before any work on its body (no Ray).

The ingress spends CPU on a request's body: the chat template's rendering and the
tokenizer (up to the context's worth of characters), the length checks. A caller with a
bad key, or a tenant past its requests per minute, must not cost that, so each request
is admitted first, in this order:

1. the API key (auth on): a missing or bad key is 401, whatever else is wrong;
2. the tenant's rate limit (`router.rate_limit`): 429 past it. A request counts once,
   whatever it asks for: a completion of several prompts, n choices, a stream;
3. (the caller's body work: rendering, tokenizing, length checks: 400s)
4. the model's resolution: an unknown, forbidden or draining adapter is 404.

Steps 1 and 4 share one registry round trip (`AdapterResolver.resolve` checks the key
and resolves the adapter in one script; the base model is one key lookup), so the happy
path costs what it did before the reordering and no key is cached (a revoked key is
refused on the next request). A 404 found in that round trip is kept in the `Admitted`
and raised by `Admitted.resolution` after the body's checks, so a body error with a
good key is the 400 it would be for a known adapter; finding the tenant of a 404's key
for the limit costs a second round trip, on that error path only.
"""

from __future__ import annotations

from dataclasses import dataclass

from lora_core.errors import AdapterNotFound
from router.auth import AdapterResolver, Resolved
from router.rate_limit import TenantRateLimiter


@dataclass(frozen=True)
class Admitted:
    """A request whose key and tenant's limit passed.

    model: the name it asked for. tenant: the caller's (None with auth off).
    resolved: the model's resolution, None when it was refused; not_found: that refusal.
    """

    model: str
    tenant: str | None
    resolved: Resolved | None = None
    not_found: AdapterNotFound | None = None

    def resolution(self) -> Resolved:
        """The model's resolution; raises its AdapterNotFound (call it once the body's own
        checks passed)."""
        if self.resolved is None:
            assert self.not_found is not None  # admit() sets exactly one of the two
            raise self.not_found
        return self.resolved


async def admit(
    resolver: AdapterResolver,
    rate_limiter: TenantRateLimiter | None,
    api_key: str | None,
    model: str,
) -> Admitted:
    """Steps 1, 2 and 4 above for one request. Raises Unauthorized (401),
    TenantRateLimited (429), RegistryUnavailable (503). rate_limiter: None for no limits;
    a request without a tenant (auth off) is never limited."""
    try:
        resolved = await resolver.resolve(api_key, model)
    except AdapterNotFound as e:  # the key passed: the registry checks it first
        admitted = Admitted(model, await resolver.tenant(api_key), not_found=e)
    else:
        admitted = Admitted(model, resolved.tenant, resolved)
    if admitted.tenant is not None and rate_limiter is not None:
        await rate_limiter.admit(admitted.tenant)
    return admitted

"""The limiter's pure parts (router.rate_limit): a refusal's wait as Retry-After, and the
registry's answer turned into admission or TenantRateLimited (a fake registry; the GCRA
itself runs in Redis: tests/integration/cluster/test_registry_rate.py)."""

from __future__ import annotations

import asyncio

import pytest

from lora_core.errors import TenantRateLimited
from router.rate_limit import TenantRateLimiter, retry_after_s


@pytest.mark.parametrize(
    "wait_us, seconds",
    [(1, 1), (100_000, 1), (1_000_000, 1), (1_000_001, 2), (19_999_999, 20), (60_000_000, 60)],
)
def test_retry_after_is_the_wait_in_whole_seconds_rounded_up(wait_us, seconds):
    assert retry_after_s(wait_us) == seconds


class Answers:
    """A registry answering admit_request with the waits given, in turn (0 = admitted)."""

    def __init__(self, limits: dict[str, int], waits: list[int]):
        self.limits, self.waits = limits, waits
        self.asked: list[tuple[str, int]] = []

    async def tenant_limit(self, tenant: str) -> int:
        return self.limits.get(tenant, 0)

    async def admit_request(self, tenant: str, limit: int) -> int:
        self.asked.append((tenant, limit))
        return self.waits.pop(0)


def admit(limiter: TenantRateLimiter, tenant: str) -> int | None:
    try:
        asyncio.run(limiter.admit(tenant))
    except TenantRateLimited as e:
        return e.retry_after_s
    return None


def test_a_wait_refuses_with_its_retry_after_and_the_tenants_limit():
    registry = Answers({"acme": 3}, [0, 2_500_000, 0])
    limiter = TenantRateLimiter(registry, 10)
    assert [admit(limiter, "acme") for _ in range(2)] == [None, 3]
    assert admit(limiter, "zeta") is None  # the default binds it
    assert registry.asked == [("acme", 3), ("acme", 3), ("zeta", 10)]


def test_no_limit_asks_nothing_of_the_budget():
    registry = Answers({}, [])
    assert admit(TenantRateLimiter(registry), "acme") is None
    assert registry.asked == []

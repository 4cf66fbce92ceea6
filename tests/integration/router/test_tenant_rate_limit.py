"""Per-tenant request rate limits (router.rate_limit) against a real registry on a real
redis-server: GCRA's burst and Retry-After, one budget across ingresses, the cached
limits, and the 429 / RESOURCE_EXHAUSTED answers through the real REST handler and gRPC
method. (The rate in real time: tests/integration/cluster/test_registry_rate.py.)

A refusal's Retry-After is the wait until its tenant may send again, which shrinks as
time passes: the tests read Redis's clock (TIME) around each scenario and allow every
value the time that passed can give (`retries`), so a stalled test machine does not
fail them."""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import pytest

from cluster.client import RetryPolicy
from cluster.registry import AsyncRegistry, Registry
from lora_core.errors import RegistryUnavailable, TenantRateLimited
from router import rest
from router.auth import AdapterResolver
from router.body_parse import parse_body
from router.frontend import Frontend
from router.grpc_proxy import retry_hint
from router.grpc_service import GrpcInferenceMixin
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.proto import lorafleet_pb2 as pb
from router.rate_limit import TenantRateLimiter
from tests.integration.cluster.timing import redis_now_us
from tests.unit.router.test_frontend_auth import BASE, Dispatcher, tokenizer
from tests.unit.router.test_status_mapping import FakeContext

__all__ = ["tokenizer"]  # the shared fixture
NS = "t"
ACME_MESSAGE = (
    "tenant 'acme' sent requests faster than its limit of 3 per minute; allowed: a burst of "
    "up to 3 requests, then 3 per minute (retry after {} s)"
)


def retries(limit: int, elapsed_us: int) -> range:
    """The Retry-After seconds a refusal may carry when its tenant's burst of `limit`
    requests began at most elapsed_us (Redis's clock) before it: GCRA's wait, one interval
    (a minute / limit) less the time since, in whole seconds rounded up. Example: limit 3,
    under a second passed: range(20, 21)."""
    interval_us = -(-60_000_000 // limit)
    return range(
        max(1, math.ceil((interval_us - elapsed_us) / 1e6)), math.ceil(interval_us / 1e6) + 1
    )


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Counting:
    """A real AsyncRegistry, counting the limiter's round trips."""

    def __init__(self, registry: AsyncRegistry):
        self.registry = registry
        self.reads = self.admits = 0

    async def tenant_limit(self, tenant: str) -> int:
        self.reads += 1
        return await self.registry.tenant_limit(tenant)

    async def admit_request(self, tenant: str, limit: int) -> int:
        self.admits += 1
        return await self.registry.admit_request(tenant, limit)


@pytest.fixture
def registry(redis_url):
    """Tenants acme (own limit 3) and zeta (none)."""
    reg = Registry(redis_url, NS)
    for tenant in ("acme", "zeta"):
        reg.create_tenant(tenant)
    reg.set_tenant_limit("acme", 3)
    yield reg
    reg.close()


@pytest.fixture
def keys(registry) -> dict[str, str]:
    """An API key of each tenant."""
    return {tenant: registry.issue_api_key(tenant) for tenant in ("acme", "zeta")}


def run_with(redis_url, body):
    """asyncio.run(body(async registry)): the asyncio client is bound to its loop."""

    async def go():
        areg = AsyncRegistry(redis_url, NS)
        try:
            return await body(areg)
        finally:
            await areg.close()

    return asyncio.run(go())


async def outcomes(limiter: TenantRateLimiter, tenant: str, n: int) -> list[int | None]:
    """admit n times: None for admitted, the retry-after of each refusal."""
    out: list[int | None] = []
    for _ in range(n):
        try:
            await limiter.admit(tenant)
            out.append(None)
        except TenantRateLimited as e:
            out.append(e.retry_after_s)
    return out


def test_a_burst_of_the_limit_then_refused_without_counting_refusals(registry, redis_url):
    async def body(areg):
        limiter = TenantRateLimiter(areg)
        first = await outcomes(limiter, "acme", 3)
        tat = registry.client.get(registry.keys.rate("acme"))
        with pytest.raises(TenantRateLimited) as e:
            await limiter.admit("acme")
        more = await outcomes(limiter, "acme", 20)
        return first, tat, e.value, more

    start = redis_now_us(registry)
    first, tat, err, more = run_with(redis_url, body)
    allowed = retries(3, redis_now_us(registry) - start)
    assert first == [None, None, None]
    # one is admitted once 60 s / 3 passed since the first: 19.9.. s, rounded up
    assert (str(err), err.tenant, err.limit) == (ACME_MESSAGE.format(err.retry_after_s), "acme", 3)
    assert err.retry_after_s in allowed
    assert [r for r in more if r not in allowed] == [] and more == sorted(more, reverse=True)
    assert registry.client.get(registry.keys.rate("acme")) == tat  # refusals moved nothing


def test_two_ingresses_share_one_budget(registry, redis_url):
    async def body(areg):
        other = AsyncRegistry(redis_url, NS)  # a second ingress: its own client and cache
        try:
            one, two = TenantRateLimiter(areg), TenantRateLimiter(other)
            got = [await outcomes(one, "acme", 2), await outcomes(two, "acme", 1)]
            return got + [await outcomes(one, "acme", 1), await outcomes(two, "acme", 1)]
        finally:
            await other.close()

    start = redis_now_us(registry)
    got = run_with(redis_url, body)
    allowed = retries(3, redis_now_us(registry) - start)
    assert got[:2] == [[None, None], [None]]
    assert got[2][0] in allowed and got[3][0] in allowed


def test_the_default_binds_tenants_without_a_limit_of_their_own(registry, redis_url):
    async def body(areg):
        limiter = TenantRateLimiter(areg, 2)
        return await outcomes(limiter, "zeta", 3), await outcomes(limiter, "acme", 4)

    start = redis_now_us(registry)
    zeta, acme = run_with(redis_url, body)
    elapsed_us = redis_now_us(registry) - start
    assert zeta[:2] == [None, None] and zeta[2] in retries(2, elapsed_us)
    # its own limit, not the default
    assert acme[:3] == [None, None, None] and acme[3] in retries(3, elapsed_us)


def test_no_limit_costs_no_round_trip_per_request(registry, redis_url):
    mono = Clock()

    async def body(areg):
        spy = Counting(areg)
        limiter = TenantRateLimiter(spy, monotonic=mono)
        free = await outcomes(limiter, "zeta", 10)
        unlimited = (spy.reads, spy.admits)
        await outcomes(limiter, "acme", 2)
        limited = (spy.reads, spy.admits)
        mono.now += 4.9  # the cached limits are still fresh
        await outcomes(limiter, "zeta", 1)
        mono.now += 0.2  # now they are not
        await outcomes(limiter, "zeta", 1)
        return free, unlimited, limited, (spy.reads, spy.admits)

    free, unlimited, limited, last = run_with(redis_url, body)
    assert free == [None] * 10
    assert unlimited == (1, 0)  # one read of zeta's limit, no admission's round trip
    assert limited == (2, 2)  # one read of acme's, one round trip per request
    assert last == (3, 2)
    assert not registry.client.exists(registry.keys.rate("zeta"))


def test_a_changed_limit_applies_once_the_cache_expires(registry, redis_url):
    mono = Clock()

    async def body(areg):
        limiter = TenantRateLimiter(areg, monotonic=mono)
        before = await outcomes(limiter, "zeta", 2)
        registry.set_tenant_limit("zeta", 1)
        cached = await outcomes(limiter, "zeta", 1)  # zeta had no limit: none counted yet
        mono.now += 5.0
        after = await outcomes(limiter, "zeta", 2)
        return before, cached, after

    start = redis_now_us(registry)
    before, cached, after = run_with(redis_url, body)
    assert (before, cached, after[0]) == ([None, None], [None], None)
    assert after[1] in retries(1, redis_now_us(registry) - start)


def test_an_unreachable_registry_refuses_with_registry_unavailable():
    async def body():
        areg = AsyncRegistry("redis://127.0.0.1:1/0", NS, retry=RetryPolicy(retries=0))
        try:
            await TenantRateLimiter(areg, 5).admit("acme")
        finally:
            await areg.close()

    with pytest.raises(RegistryUnavailable, match="cannot reach Redis at redis://127.0.0.1:1/0"):
        asyncio.run(body())


def frontend(tokenizer, areg, auth: bool = True, default_rpm: int = 0) -> Frontend:
    resolver = AdapterResolver(areg, BASE, auth=auth, admin_key="")
    limiter = TenantRateLimiter(areg, default_rpm)
    return Frontend(tokenizer, resolver, Dispatcher(), 64, rate_limiter=limiter)


def completion(n: int = 1) -> CompletionRequest:
    return parse_body(CompletionRequest, {"model": BASE, "prompt": [1, 2], "max_tokens": 2, "n": n})


def test_rest_answers_429_with_retry_after_and_the_openai_error(
    tokenizer, registry, keys, redis_url
):
    chat = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def body(areg):
        front = frontend(tokenizer, areg)
        first = [await rest.completions(front, keys["acme"], completion(n=3))]
        first.append(
            await rest.chat_completions(
                front, keys["acme"], parse_body(ChatCompletionRequest, chat)
            )
        )
        first.append(await rest.completions(front, keys["acme"], completion()))
        refused = await rest.completions(front, keys["acme"], completion())
        other = await rest.completions(front, keys["zeta"], completion())
        return first, refused, other

    start = redis_now_us(registry)
    first, refused, other = run_with(redis_url, body)
    allowed = retries(3, redis_now_us(registry) - start)
    assert [r.status_code for r in first] == [200, 200, 200]  # n = 3 counted once
    retry = refused.headers["retry-after"]
    assert refused.status_code == 429 and int(retry) in allowed
    assert json.loads(refused.body) == {
        "error": {
            "message": ACME_MESSAGE.format(retry),
            "type": "rate_limit_error",
            "param": None,
            "code": "tenant_rate_limited",
        }
    }
    assert other.status_code == 200  # one tenant's limit is its own


def test_with_auth_off_nothing_is_limited_or_counted(tokenizer, registry, redis_url):
    async def body(areg):
        front = frontend(tokenizer, areg, auth=False, default_rpm=1)
        return [(await rest.completions(front, None, completion())).status_code for _ in range(3)]

    assert run_with(redis_url, body) == [200, 200, 200]
    assert not list(registry.client.scan_iter(f"{NS}:rate:*"))  # no tenant: no rate state


def test_grpc_answers_resource_exhausted_with_the_retry_hint(tokenizer, registry, keys, redis_url):
    ingress = GrpcInferenceMixin()
    request = pb.GenerateRequest(model=BASE, prompt_token_ids=[1, 2], max_tokens=2)

    async def body(areg):
        ingress.frontend = frontend(tokenizer, areg)
        contexts = []
        for _ in range(4):
            ctx = FakeContext([("authorization", "Bearer " + keys["acme"])])
            try:
                _ = [chunk async for chunk in ingress.Generate(request, ctx)]
            except TenantRateLimited:
                pass
            contexts.append(ctx)
        return contexts

    start = redis_now_us(registry)
    contexts = run_with(redis_url, body)
    allowed = retries(3, redis_now_us(registry) - start)
    assert [c.code for c in contexts[:3]] == [None, None, None]
    refused = contexts[3]
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry = retry_hint(refused.details)  # the proxy's retry-after trailer
    assert retry is not None and int(retry) in allowed
    assert refused.details == ACME_MESSAGE.format(retry)  # the retry time named once

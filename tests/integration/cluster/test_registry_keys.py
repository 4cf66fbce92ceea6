"""API key ids, listing and revocation on a real redis-server."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from cluster.records import key_id
from cluster.registry import AsyncRegistry, Registry, hash_key
from lora_core.errors import InvalidRequest, Unauthorized
from router.auth import AdapterResolver
from tests.redis_fixture import dump_redis


@pytest.fixture
def tenants(registry: Registry, adapters) -> Registry:
    """Tenants t1, t2 and a public adapter "pub" any valid key may use."""
    for t in ("t1", "t2"):
        registry.create_tenant(t)
    registry.register_adapter("pub", str(adapters["small"]), public=True)
    return registry


def legacy_key(redis_url: str, tenant: str, key_hash: str) -> None:
    """Store a key as issue_api_key did before issue times were recorded."""
    client = redis.Redis.from_url(redis_url)
    client.set(f"t:apikey:{key_hash}", tenant)
    client.sadd(f"t:tenant:{tenant}:keys", key_hash)
    client.close()


def test_issue_list_revoke(tenants: Registry):
    before = time.time()
    k1, k2 = tenants.issue_api_key("t1"), tenants.issue_api_key("t1")
    listed = tenants.list_api_keys("t1")
    assert {k.key_id for k in listed} == {key_id(hash_key(k1)), key_id(hash_key(k2))}
    assert all(before <= k.created <= time.time() for k in listed)
    assert tenants.list_api_keys("t2") == []
    assert tenants.resolve_request(k1, "pub").tenant == "t1"

    assert tenants.revoke_api_key("t1", key_id(hash_key(k1))) == key_id(hash_key(k1))
    assert tenants.resolve_key(k1) is None
    with pytest.raises(Unauthorized):
        tenants.resolve_request(k1, "pub")
    assert tenants.resolve_request(k2, "pub").tenant == "t1"
    assert [k.key_id for k in tenants.list_api_keys("t1")] == [key_id(hash_key(k2))]


def test_revoke_leaves_no_trace_of_the_key(tenants: Registry, redis_url):
    before = dump_redis(redis_url)
    key = tenants.issue_api_key("t1")
    tenants.revoke_api_key("t1", key_id(hash_key(key)).upper()[:6])
    assert dump_redis(redis_url) == before


def test_legacy_keys_are_listed_and_revocable(tenants: Registry, redis_url):
    key = "lf-issued-before-key-ids"
    legacy_key(redis_url, "t1", hash_key(key))
    assert tenants.resolve_key(key) == "t1"
    (info,) = tenants.list_api_keys("t1")
    assert (info.key_id, info.created) == (key_id(hash_key(key)), None)
    assert tenants.revoke_api_key("t1", info.key_id) == info.key_id
    assert tenants.resolve_key(key) is None
    assert tenants.list_api_keys("t1") == []


def test_revoke_all(tenants: Registry):
    keys = [tenants.issue_api_key("t1") for _ in range(3)]
    other = tenants.issue_api_key("t2")
    assert tenants.revoke_all_api_keys("t1") == sorted(key_id(hash_key(k)) for k in keys)
    assert [tenants.resolve_key(k) for k in keys] == [None, None, None]
    assert tenants.resolve_key(other) == "t2"
    assert tenants.revoke_all_api_keys("t1") == []


def test_refusals_change_nothing(tenants: Registry, redis_url):
    other = tenants.issue_api_key("t2")
    legacy_key(redis_url, "t1", "abcdef0" + "0" * 57)
    legacy_key(redis_url, "t1", "abcdef1" + "1" * 57)
    before = dump_redis(redis_url)
    with pytest.raises(InvalidRequest, match="tenant 't1' has no key with id '0000000000'"):
        tenants.revoke_api_key("t1", "0000000000")
    with pytest.raises(InvalidRequest, match="has no key"):  # another tenant's key
        tenants.revoke_api_key("t1", key_id(hash_key(other)))
    with pytest.raises(InvalidRequest, match="'abcdef' matches 2 keys of tenant 't1'"):
        tenants.revoke_api_key("t1", "abcdef")
    with pytest.raises(ValueError, match="key id 'lf-x' is invalid"):
        tenants.revoke_api_key("t1", "lf-x")
    with pytest.raises(InvalidRequest, match="tenant 'ghost' does not exist"):
        tenants.revoke_all_api_keys("ghost")
    with pytest.raises(InvalidRequest, match="tenant 'ghost' does not exist"):
        tenants.list_api_keys("ghost")
    assert dump_redis(redis_url) == before
    assert tenants.revoke_api_key("t1", "abcdef1") == "abcdef111111"


@pytest.mark.parametrize("model", ["pub", "base"])
def test_router_refuses_a_revoked_key_at_once(tenants: Registry, redis_url, model: str):
    """The ingress (REST and gRPC alike) resolves every request through AdapterResolver,
    which caches no keys: Unauthorized (401 / UNAUTHENTICATED) from the next request."""
    key = tenants.issue_api_key("t1")

    async def resolve() -> str | None:
        reg = AsyncRegistry(redis_url, namespace="t", max_lora_rank=16)
        try:
            resolver = AdapterResolver(reg, "base", auth=True, admin_key="")
            return (await resolver.resolve(key, model)).tenant
        finally:
            await reg.close()

    assert asyncio.run(resolve()) == "t1"
    tenants.revoke_api_key("t1", key_id(hash_key(key)))
    with pytest.raises(Unauthorized):
        asyncio.run(resolve())

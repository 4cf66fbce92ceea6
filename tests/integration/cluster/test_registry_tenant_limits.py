"""Tenants' request rate limits in the registry: stored with the tenant, refused for an
unknown tenant or a bad value, gone with the tenant; the per-minute request counters."""

from __future__ import annotations

import pytest

from cluster.records import TenantInfo
from cluster.registry import RATE_WINDOW_TTL_S, Registry
from lora_core.errors import InvalidRequest
from tests.redis_fixture import dump_redis


def test_set_get_and_remove_a_limit(registry: Registry):
    registry.create_tenant("acme")
    registry.create_tenant("zeta")
    assert registry.tenant_limit("acme") == 0
    registry.set_tenant_limit("acme", 600)
    assert registry.tenant_limit("acme") == 600
    assert registry.tenant_limit("zeta") == 0
    assert registry.list_tenant_limits() == [TenantInfo("acme", 600), TenantInfo("zeta", 0)]
    registry.set_tenant_limit("acme", 5)
    assert registry.tenant_limit("acme") == 5
    registry.set_tenant_limit("acme", 0)  # removes its own limit
    assert registry.tenant_limit("acme") == 0
    assert registry.client.hgetall(registry.keys.tenant("acme")).keys() == {"name", "created"}


def test_deleting_a_tenant_deletes_its_limit(registry: Registry):
    registry.create_tenant("acme")
    registry.set_tenant_limit("acme", 60)
    registry.delete_tenant("acme")
    assert registry.tenant_limit("acme") == 0
    assert registry.list_tenant_limits() == []
    registry.create_tenant("acme")  # a later namesake starts without one
    assert registry.tenant_limit("acme") == 0


def test_a_limit_on_an_unknown_tenant_is_refused_writing_nothing(registry: Registry, redis_url):
    before = dump_redis(redis_url)
    with pytest.raises(InvalidRequest) as e:
        registry.set_tenant_limit("ghost", 10)
    assert str(e.value) == (
        "tenant 'ghost' does not exist; allowed: a tenant that `tenants list` shows "
        "(`tenants create` makes one)"
    )
    assert dump_redis(redis_url) == before
    assert registry.tenant_limit("ghost") == 0


@pytest.mark.parametrize("value", [-1, 1.5, "10", True, None])
def test_bad_values_are_refused(registry: Registry, redis_url, value):
    registry.create_tenant("acme")
    before = dump_redis(redis_url)
    with pytest.raises(ValueError) as e:
        registry.set_tenant_limit("acme", value)
    assert str(e.value) == (
        f"requests_per_minute={value!r}; allowed: an integer >= 0 (0 = no limit of the "
        "tenant's own: the cluster's tenant_requests_per_minute applies)"
    )
    assert dump_redis(redis_url) == before


def test_a_tenant_name_that_spells_another_key_is_refused(registry: Registry):
    registry.create_tenant("acme")
    with pytest.raises(ValueError, match="tenant name 'acme:keys' is invalid"):
        registry.set_tenant_limit("acme:keys", 10)


def test_count_request_counts_per_tenant_and_minute(registry: Registry):
    assert [registry.count_request("acme", 100) for _ in range(3)] == [1, 2, 3]
    assert registry.count_request("zeta", 100) == 1
    assert registry.count_request("acme", 101) == 1  # a new minute starts from 1
    db = registry.client
    assert db.get(registry.keys.rate("acme", 100)) == "3"
    assert db.get("t:rate:acme:101") == "1"  # the layout cluster.keys documents
    # every counter expires: none outlives its minute by more than RATE_WINDOW_TTL_S
    for key in db.scan_iter("t:rate:*"):
        assert RATE_WINDOW_TTL_S - 2 <= db.ttl(key) <= RATE_WINDOW_TTL_S

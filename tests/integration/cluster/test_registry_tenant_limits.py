"""Tenants' request rate limits in the registry: stored with the tenant, refused for an
unknown tenant or a bad value, gone with the tenant (its rate state too)."""

from __future__ import annotations

import pytest

from cluster.records import TenantInfo
from cluster.registry import Registry
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
    assert registry.admit_request("acme", 1) == 0
    assert registry.client.exists(registry.keys.rate("acme"))
    registry.delete_tenant("acme")
    assert not registry.client.exists(registry.keys.rate("acme"))
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

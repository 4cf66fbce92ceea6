"""Tenants, API keys, grants and the one-round-trip request path, on a real redis-server."""

from __future__ import annotations

import re

import pytest
import redis
import redis.connection

from cluster.registry import Registry, hash_key
from lora_core.errors import AdapterNotFound, InvalidRequest, Unauthorized
from tests.redis_fixture import dump_redis


@pytest.fixture
def catalog(registry: Registry, adapters):
    """Tenants t1 (owns "own"), t2; adapters "own" (t1), "granted" (t2 granted), "pub"."""
    for t in ("t1", "t2"):
        registry.create_tenant(t)
    registry.register_adapter("own", str(adapters["a"]), tenant="t1")
    registry.register_adapter("granted", str(adapters["b"]))
    registry.register_adapter("pub", str(adapters["small"]), public=True)
    registry.grant("t2", "granted")
    return registry


def test_key_format_and_only_hash_stored(catalog: Registry, redis_url):
    key = catalog.issue_api_key("t1")
    assert re.fullmatch(r"lf-[A-Za-z0-9_\-]{43}", key)
    assert catalog.resolve_key(key) == "t1"
    assert catalog.resolve_key(key + "x") is None
    client = redis.Redis.from_url(redis_url)
    blob = b"".join(k + (client.dump(k) or b"") for k in client.scan_iter("*"))
    client.close()
    assert key.encode() not in blob
    assert hash_key(key).encode() in blob
    assert catalog.issue_api_key("t1") != key


def test_authorize_matrix(catalog: Registry):
    got = {
        (t, a): catalog.authorize(t, a)
        for t in ("t1", "t2", "ghost")
        for a in ("own", "granted", "pub", "missing")
    }
    assert got == {
        ("t1", "own"): True, ("t1", "granted"): False, ("t1", "pub"): True,
        ("t1", "missing"): False,
        ("t2", "own"): False, ("t2", "granted"): True, ("t2", "pub"): True,
        ("t2", "missing"): False,
        ("ghost", "own"): False, ("ghost", "granted"): False, ("ghost", "pub"): False,
        ("ghost", "missing"): False,
    }  # fmt: skip


def test_grant_and_revoke(catalog: Registry, redis_url):
    assert catalog.grant("t1", "granted") is True
    assert catalog.grant("t1", "granted") is False
    assert catalog.authorize("t1", "granted") is True
    assert catalog.revoke("t1", "granted") is True
    assert catalog.revoke("t1", "granted") is False
    assert catalog.authorize("t1", "granted") is False
    before = dump_redis(redis_url)
    with pytest.raises(AdapterNotFound):
        catalog.grant("t1", "missing")
    with pytest.raises(InvalidRequest, match="tenant 'ghost' does not exist"):
        catalog.grant("ghost", "own")
    with pytest.raises(InvalidRequest, match="tenant 'ghost' does not exist"):
        catalog.issue_api_key("ghost")
    with pytest.raises(InvalidRequest, match="tenant 't1' already exists"):
        catalog.create_tenant("t1")
    assert dump_redis(redis_url) == before
    assert catalog.list_tenants() == ["t1", "t2"]


def test_resolve_request_forbidden_equals_unknown(catalog: Registry):
    k1 = catalog.issue_api_key("t1")
    assert catalog.resolve_request(k1, "own").tenant == "t1"
    assert catalog.resolve_request(k1, "pub").ref.name == "pub"
    errors = []
    for name in ("granted", "missing"):
        with pytest.raises(AdapterNotFound) as info:
            catalog.resolve_request(k1, name)
        errors.append(str(info.value).replace(name, "X"))
    assert errors[0] == errors[1] == "adapter 'X' not found"


def test_resolve_request_keys_and_auth_mode(catalog: Registry):
    with pytest.raises(Unauthorized):
        catalog.resolve_request(None, "pub")
    with pytest.raises(Unauthorized):
        catalog.resolve_request("lf-bogus", "pub", auth=False)
    with pytest.raises(Unauthorized):
        catalog.resolve_request("lf-bogus", "missing")
    anon = catalog.resolve_request(None, "own", auth=False)
    assert (anon.tenant, anon.ref) == (None, catalog.get_adapter("own").ref)


def test_resolve_request_is_one_round_trip_with_live_locations(
    catalog: Registry, redis_url, monkeypatch
):
    e = catalog.register_replica("r1", "prefill", "d", 4, 5.0)
    catalog.report_resident("r1", e, catalog.get_adapter("pub").ref, "gpu")
    key = catalog.issue_api_key("t2")
    catalog.resolve_request(key, "pub")  # loads the script
    sends = []
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):
        sends.append(command)
        return original(self, command, check_health)

    admin = redis.Redis.from_url(redis_url, decode_responses=True)
    admin.config_resetstat()
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    got = catalog.resolve_request(key, "pub")
    monkeypatch.undo()
    stats = admin.info("commandstats")
    admin.close()
    assert len(sends) == 1
    assert stats["cmdstat_evalsha"]["calls"] == 1
    assert "cmdstat_eval" not in stats and "cmdstat_script|load" not in stats
    assert [tuple(loc) for loc in got.locations] == [("r1", "gpu", "prefill")]


@pytest.mark.parametrize("name", ["", "a:b", "own:x", "x y", "../own", "own\n"])
def test_odd_model_names_are_not_found(catalog: Registry, name: str):
    key = catalog.issue_api_key("t1")
    with pytest.raises(AdapterNotFound):
        catalog.resolve_request(key, name)
    with pytest.raises(Unauthorized):
        catalog.resolve_request("lf-bad", name)


@pytest.mark.parametrize("phantom", ["t1:keys", "t1:key_created"])
def test_tenant_names_that_spell_a_tenants_own_keys_are_refused(
    catalog: Registry, redis_url, phantom: str
):
    # "tenant:t1:keys" is t1's key set: a name with ':' used to pass the tenant-exists
    # check and got a key (and grants) for a tenant no listing shows and no verb can
    # revoke, since every revoking verb refuses the name
    catalog.issue_api_key("t1")
    catalog.grant("t2", "granted")
    before = dump_redis(redis_url)
    for call in (
        lambda: catalog.issue_api_key(phantom),
        lambda: catalog.grant(phantom, "own"),
        lambda: catalog.revoke(phantom, "own"),
        lambda: catalog.authorize(phantom, "own"),
    ):
        with pytest.raises(ValueError, match=f"tenant name '{phantom}' is invalid"):
            call()
    with pytest.raises(ValueError, match="adapter name 'own:x' is invalid"):
        catalog.grant("t2", "own:x")
    assert dump_redis(redis_url) == before

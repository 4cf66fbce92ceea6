"""Deleting a tenant removes its keys and grants, so nothing leaks to a later namesake."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.registry import Registry, hash_key
from lora_core.errors import AdapterNotFound, InvalidRequest, Unauthorized
from tests.redis_fixture import dump_redis

ROOT = Path(__file__).resolve().parents[3]


def test_delete_tenant_removes_keys_and_grants(registry: Registry, adapters, redis_url):
    registry.create_tenant("keep")
    keep_key = registry.issue_api_key("keep")
    registry.create_tenant("gone")
    gone_keys = [registry.issue_api_key("gone") for _ in range(3)]
    for name in ("a", "b", "c"):
        registry.register_adapter(name, str(adapters["a"]), tenant="keep")
    for name in ("a", "b"):
        registry.grant("gone", name)
    registry.grant("keep", "c")
    assert registry.resolve_request(gone_keys[0], "a").tenant == "gone"
    assert registry.delete_tenant("gone") == (3, 2)
    assert registry.list_tenants() == ["keep"]
    for key in gone_keys:
        assert registry.resolve_key(key) is None
        with pytest.raises(Unauthorized):
            registry.resolve_request(key, "a")
    # not a key of it, not a grant to it, not its record is left anywhere in Redis
    db = registry.client
    left = sorted(db.scan_iter("*"))
    assert not [k for k in left if "gone" in k or any(hash_key(g) in k for g in gone_keys)]
    assert not [k for k in left if db.type(k) == "set" and db.sismember(k, "gone")]
    # a tenant created later under the same name starts with nothing
    registry.create_tenant("gone")
    new_key = registry.issue_api_key("gone")
    assert registry.list_api_keys("gone")[0].key_id == hash_key(new_key)[:12]
    assert len(registry.list_api_keys("gone")) == 1
    with pytest.raises(AdapterNotFound):
        registry.resolve_request(new_key, "a")
    assert registry.authorize("gone", "b") is False
    assert registry.resolve_request(keep_key, "c").tenant == "keep"


def test_delete_tenant_refusals(registry: Registry, adapters, redis_url):
    with pytest.raises(InvalidRequest, match="tenant 'ghost' does not exist"):
        registry.delete_tenant("ghost")
    with pytest.raises(ValueError, match="tenant name 'a:b' is invalid"):
        registry.delete_tenant("a:b")
    registry.create_tenant("acme")
    registry.issue_api_key("acme")
    registry.register_adapter("z", str(adapters["a"]), tenant="acme")
    registry.register_adapter("y", str(adapters["b"]), tenant="acme")
    before = dump_redis(redis_url)
    with pytest.raises(InvalidRequest) as err:
        registry.delete_tenant("acme")
    assert str(err.value) == (
        "tenant 'acme' owns adapters (y, z); allowed: delete a tenant that owns none: "
        "unregister them, or give them another owner first "
        "(`adapters register NAME PATH --replace --tenant OTHER`)"
    )
    assert dump_redis(redis_url) == before
    # a draining adapter is on its way out: it does not hold its owner back
    epoch = registry.register_replica("r1", "mixed", "d", 4, 30.0)
    registry.report_resident("r1", epoch, ("z", 1), "gpu")
    assert registry.unregister_adapter("z") == "draining"
    assert registry.unregister_adapter("y") == "removed"
    assert registry.delete_tenant("acme") == (1, 0)


def test_cli_tenants_delete(registry: Registry, redis_url):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LORAFLEET_NAMESPACE": "t"}

    def cli(*argv: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "cluster.cli", "tenants", *argv, "--redis-url", redis_url]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)

    registry.create_tenant("acme")
    registry.issue_api_key("acme")
    done = cli("delete", "acme")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == "deleted tenant acme (1 keys revoked, 0 grants removed)\n"
    again = cli("delete", "acme")
    assert (again.returncode, again.stdout) == (1, "")
    assert (
        again.stderr
        == "lorafleet: error: tenant 'acme' does not exist; allowed: a tenant that `tenants list` shows (`tenants create` makes one)\n"
    )

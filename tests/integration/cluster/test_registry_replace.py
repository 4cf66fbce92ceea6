"""A replace is a new version of the same adapter: who may use it does not change unless
asked; a draining name registered again is a new adapter that no old grant opens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.registry import Registry
from lora_core.errors import AdapterNotFound

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def keys(registry: Registry) -> dict[str, str]:
    """Tenants acme (owner), other (granted) and stranger, one API key each."""
    out = {}
    for tenant in ("acme", "other", "stranger"):
        registry.create_tenant(tenant)
        out[tenant] = registry.issue_api_key(tenant)
    return out


def _sees(registry: Registry, key: str, name: str) -> int | None:
    """The version tenant's key resolves name to, or None when it may not use it."""
    try:
        return registry.resolve_request(key, name).ref.version
    except AdapterNotFound:
        return None


def test_replace_keeps_owner_public_and_grants(registry: Registry, adapters, keys):
    registry.register_adapter("priv", str(adapters["a"]), tenant="acme")
    registry.grant("other", "priv")
    registry.register_adapter("pub", str(adapters["a"]), public=True)
    new = registry.register_adapter("priv", str(adapters["b"]), replace=True)
    assert (new.version, new.owner, new.public) == (2, "acme", False)
    assert registry.get_adapter("priv") == new
    new = registry.register_adapter("pub", str(adapters["b"]), replace=True)
    assert (new.version, new.owner, new.public) == (2, "", True)
    sees = {t: (_sees(registry, k, "priv"), _sees(registry, k, "pub")) for t, k in keys.items()}
    # every tenant that could use version 1 gets version 2 (never the stale one)
    assert sees == {"acme": (2, 2), "other": (2, 2), "stranger": (None, 2)}


def test_replace_changes_access_when_asked(registry: Registry, adapters, keys):
    registry.register_adapter("x", str(adapters["a"]), tenant="acme", public=True)
    new = registry.register_adapter("x", str(adapters["b"]), replace=True, public=False)
    assert (new.owner, new.public) == ("acme", False)
    assert _sees(registry, keys["stranger"], "x") is None
    new = registry.register_adapter("x", str(adapters["a"]), replace=True, tenant="other")
    assert (new.version, new.owner, new.public) == (3, "other", False)
    assert registry.get_adapter("x") == new
    assert (_sees(registry, keys["acme"], "x"), _sees(registry, keys["other"], "x")) == (None, 3)


def test_draining_name_registered_again_drops_old_grants(registry: Registry, adapters, keys):
    registry.register_adapter("x", str(adapters["a"]), tenant="acme", public=True)
    registry.grant("other", "x")
    epoch = registry.register_replica("r1", "mixed", "d", 4, 30.0)
    registry.report_resident("r1", epoch, ("x", 1), "gpu")
    assert registry.unregister_adapter("x") == "draining"
    # someone else's adapter under the freed name: private, no owner, no grantee
    new = registry.register_adapter("x", str(adapters["b"]))
    assert (new.version, new.owner, new.public) == (2, "", False)
    assert registry.client.smembers("t:grants:x") == set()
    assert {t: _sees(registry, k, "x") for t, k in keys.items()} == dict.fromkeys(keys)
    registry.grant("stranger", "x")
    assert _sees(registry, keys["stranger"], "x") == 2


def _cli(redis_url: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LORAFLEET_NAMESPACE": "t"}
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *argv, "--redis-url", redis_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_replace_keeps_public_unless_told(registry: Registry, redis_url: str, adapters):
    a, b = str(adapters["a"]), str(adapters["b"])
    assert _cli(redis_url, "adapters", "register", "x", a, "--public").returncode == 0
    assert _cli(redis_url, "adapters", "register", "x", b, "--replace").returncode == 0
    assert (registry.get_adapter("x").version, registry.get_adapter("x").public) == (2, True)
    assert _cli(redis_url, "adapters", "register", "x", a, "--replace", "--private").returncode == 0
    assert (registry.get_adapter("x").version, registry.get_adapter("x").public) == (3, False)
    both = _cli(redis_url, "adapters", "register", "x", a, "--replace", "--public", "--private")
    assert both.returncode == 2
    assert "argument --private: not allowed with argument --public" in both.stderr
    assert registry.get_adapter("x").version == 3

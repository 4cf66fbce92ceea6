"""Two clusters sharing one Redis under different namespaces never see or touch each
other's keys, hints, replicas or tenants (namespaces that are prefixes of each other
included)."""

from __future__ import annotations

import redis

from cluster.registry import Registry, hash_key
from tests.integration.cluster.timing import lapse


def _workload(reg: Registry, adapters) -> str:
    """Every kind of write the registry does; returns the API key it issued."""
    reg.create_tenant("acme")
    key = reg.issue_api_key("acme")
    reg.create_tenant("gone")
    reg.issue_api_key("gone")
    reg.register_adapter("x", str(adapters["a"]), tenant="acme")
    reg.register_adapter("y", str(adapters["b"]), public=True)
    reg.register_adapter("y", str(adapters["a"]), replace=True)
    reg.grant("gone", "y")
    reg.delete_tenant("gone")
    reg.pin("x", "decode")
    reg.warm("y", 2, "prefill")
    live = reg.register_replica("r1", "mixed", "d", 4, 30.0)
    reg.report_resident("r1", live, ("x", 1), "gpu")
    short = reg.register_replica("r2", "decode", "d", 4, 30.0)
    reg.report_resident("r2", short, ("y", 2), "cpu")
    lapse(reg, "r2")
    assert reg.unregister_adapter("x") == "draining"
    return key


def _keys(client: redis.Redis) -> set[str]:
    return set(client.scan_iter("*"))


def test_namespaces_are_isolated(redis_url: str, adapters):
    a, b = Registry(redis_url, "t"), Registry(redis_url, "t2")
    key_b = _workload(b, adapters)
    b_keys = {k: b.client.dump(k) for k in _keys(b.client)}
    assert all(k.startswith("t2:") for k in b_keys)
    with b.subscribe_hints() as hints_b:
        hints_b.get(0.05)  # the subscribe confirmation
        key_a = _workload(a, adapters)
        assert a.reap() == (1, 0)  # r2 of "t" lapsed; b's r2 (lapsed too) is not a's
        assert hints_b.get(0.2) is None  # a's changes woke nobody in b
    assert all(k.startswith("t:") for k in _keys(a.client) - set(b_keys))
    assert {k: b.client.dump(k) for k in _keys(b.client) if k.startswith("t2:")} == b_keys
    # same names, separate worlds
    assert b.resolve_key(key_a) is None and a.resolve_key(key_b) is None
    assert (a.resolve_key(key_a), b.resolve_key(key_b)) == ("acme", "acme")
    assert a.get_adapter("y").version == b.get_adapter("y").version == 2
    assert [r.replica_id for r in a.list_replicas()] == ["r1"]
    assert [r.replica_id for r in b.list_replicas()] == ["r1", "r2"]
    assert a.status().tenants == b.status().tenants == 1
    assert not b.client.exists(f"t2:apikey:{hash_key(key_a)}")
    a.close()
    b.close()

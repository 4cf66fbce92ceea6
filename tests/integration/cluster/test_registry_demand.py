"""Adapter demand on a real redis-server: replicas' active adapters (the autoscaling
share's copy counts)."""

from __future__ import annotations

import time

import pytest

from cluster.registry import Registry
from lora_core.errors import StaleEpoch


@pytest.fixture
def reg(registry: Registry, adapters) -> Registry:
    registry.register_adapter("a", str(adapters["a"]))
    registry.register_adapter("b", str(adapters["b"]))
    return registry


def replicas(reg: Registry, n: int, pool: str = "mixed", ttl_s: float = 30.0) -> list[int]:
    return [reg.register_replica(f"r{i}", pool, "d", 2, ttl_s) for i in range(n)]


def wait_lapsed(reg: Registry, replica_id: str) -> None:
    deadline = time.monotonic() + 3.0
    while any(r.live for r in reg.list_replicas() if r.replica_id == replica_id):
        assert time.monotonic() < deadline, f"{replica_id} still live"
        time.sleep(0.02)


def test_active_copies_count_live_replicas_using_an_adapter(reg: Registry):
    e = replicas(reg, 3)
    assert reg.report_active("r0", e[0], {"a": 3, "b": 1}) == {"a": 1, "b": 1}
    assert reg.report_active("r1", e[1], {"a": 5}) == {"a": 2}
    assert reg.report_active("r2", e[2], {}) == {}
    # r0's next report no longer names b: b is active nowhere, a still on r0 and r1
    assert reg.report_active("r0", e[0], {"a": 1}) == {"a": 2}
    assert reg.client.hgetall("t:active:a") == {"r0": f"1|{e[0]}", "r1": f"5|{e[1]}"}
    assert reg.client.exists("t:active:b") == 0
    assert reg.client.smembers("t:active_names") == {"a"}
    assert reg.report_active("r2", e[2], {"a": 1, "b": 2}) == {"a": 3, "b": 1}


def test_activity_of_a_replica_ends_with_its_lease_or_its_record(reg: Registry):
    fast = reg.register_replica("fast", "mixed", "d", 2, 0.2)
    e = replicas(reg, 2)
    reg.report_active("fast", fast, {"a": 1})
    reg.report_active("r0", e[0], {"a": 1, "b": 1})
    reg.report_active("r1", e[1], {"b": 1})
    assert reg.report_active("r1", e[1], {"a": 1, "b": 1}) == {"a": 3, "b": 2}
    wait_lapsed(reg, "fast")
    assert reg.report_active("r1", e[1], {"a": 1, "b": 1}) == {"a": 2, "b": 2}
    assert reg.deregister_replica("r0", e[0]) is True
    assert reg.report_active("r1", e[1], {"a": 1, "b": 1}) == {"a": 1, "b": 1}
    assert reg.reap() == (1, 0)  # "fast" lapsed
    assert set(reg.client.hgetall("t:active:a")) == {"r1"}
    # a new incarnation is active nowhere until it reports
    again = reg.register_replica("r1", "mixed", "d", 2, 30.0)
    assert reg.client.exists("t:active:a", "t:replica:r1:active") == 0
    assert reg.client.smembers("t:active_names") == set()
    with pytest.raises(StaleEpoch):
        reg.report_active("r1", e[1], {"a": 1})
    assert reg.report_active("r1", again, {"a": 1}) == {"a": 1}


def test_unregistering_an_adapter_drops_its_activity(reg: Registry):
    (e,) = replicas(reg, 1)
    reg.report_active("r0", e, {"a": 1})
    assert reg.unregister_adapter("a") == "removed"  # active but resident nowhere
    assert reg.client.exists("t:active:a") == 0 and reg.client.smembers("t:active_names") == set()

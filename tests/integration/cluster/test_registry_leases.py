"""Replica leases, fencing epochs and residency on a real redis-server (short TTLs).

A TTL is checked on Redis's clock (`timing.redis_now_us` around each step), and a lease
that must stay live across steps is either long or renewed by a lease thread given
a TTL well past a stall, so a loaded machine does not make a lease lapse early."""

from __future__ import annotations

import time

import pytest

from cluster.lease import LeaseConfig, ReplicaLease
from cluster.records import Location
from cluster.registry import Registry
from lora_core.errors import AdapterNotFound, StaleEpoch
from tests.integration.cluster.timing import lapse, redis_now_us
from tests.polling import wait_for
from tests.redis_fixture import dump_redis


@pytest.fixture
def reg(registry: Registry, adapters) -> Registry:
    registry.register_adapter("a", str(adapters["a"]))
    return registry


def _wait_lapsed(reg: Registry, replica_id: str, renewed: tuple[int, int], ttl_s: float) -> None:
    """Poll until replica_id's lease lapses, a TTL of ttl_s after it was set at some Redis
    time within `renewed` (us): each poll that still sees it live began before the
    latest that TTL can end, and the one that sees it lapsed ended after the earliest."""
    ttl_us = round(ttl_s * 1e6)

    def lapsed() -> bool:
        before = redis_now_us(reg)
        live = any(r.live for r in reg.list_replicas() if r.replica_id == replica_id)
        after = redis_now_us(reg)
        if not live:
            assert after >= renewed[0] + ttl_us, "lapsed before its TTL"
            return True
        assert before < renewed[1] + ttl_us + 1000, "live past its TTL"  # PX: whole ms
        return False

    wait_for(lapsed, ttl_s + 10, f"{replica_id}'s lease to lapse", interval_s=0.02)


def test_locations_report_tier_and_pool(reg: Registry):
    e1 = reg.register_replica("r1", "prefill", "d", 4, 5.0)
    e2 = reg.register_replica("r2", "decode", "d", 4, 5.0)
    reg.report_resident("r1", e1, ("a", 1), "gpu")
    reg.report_resident("r2", e2, reg.get_adapter("a").ref, "cpu")
    assert reg.locations("a") == (Location("r1", "gpu", "prefill"), Location("r2", "cpu", "decode"))
    reg.report_resident("r2", e2, ("a", 1), "gpu")  # promoted: one entry per replica
    assert reg.locations("a")[1] == Location("r2", "gpu", "decode")
    key = reg.get_adapter("a").ref.key
    reg.report_resident("r1", e1, key, "cpu")  # by AdapterRef.key
    assert reg.locations("a")[0] == Location("r1", "cpu", "prefill")
    with pytest.raises(ValueError, match="allowed: an AdapterRef.key"):
        reg.report_resident("r1", e1, "a@x", "gpu")
    assert reg.remove_resident("r1", e1, ("a", 7)) is False  # other version: kept
    assert reg.remove_resident("r1", e1, ("a", 1)) is True
    assert reg.locations("a") == (Location("r2", "gpu", "decode"),)
    with pytest.raises(AdapterNotFound):
        reg.locations("zzz")
    with pytest.raises(AdapterNotFound):
        reg.report_resident("r1", e1, ("zzz", 1), "gpu")
    with pytest.raises(ValueError, match="tier='hbm'"):
        reg.report_resident("r1", e1, ("a", 1), "hbm")


def test_lapsed_lease_drops_replica_everywhere(reg: Registry):
    short = reg.register_replica("short", "mixed", "d", 4, 30.0)
    long = reg.register_replica("long", "mixed", "d", 4, 30.0)
    reg.report_resident("short", short, ("a", 1), "gpu")
    reg.report_resident("long", long, ("a", 1), "gpu")
    assert [loc.replica for loc in reg.locations("a")] == ["long", "short"]
    start = redis_now_us(reg)
    assert reg.heartbeat("short", short, 1.0) is True  # its last beat: 1 s left
    _wait_lapsed(reg, "short", (start, redis_now_us(reg)), 1.0)
    assert reg.locations("a") == (Location("long", "gpu", "mixed"),)
    assert [loc.replica for loc in reg.resolve_request(None, "a", auth=False).locations] == ["long"]
    live = {r.replica_id: r.live for r in reg.list_replicas()}
    assert live == {"long": True, "short": False}
    assert reg.status().replicas_live == {"decode": 0, "mixed": 1, "prefill": 0}
    assert reg.heartbeat("short", short, 1.0) is False
    with pytest.raises(StaleEpoch, match="lapsed"):
        reg.report_resident("short", short, ("a", 1), "gpu")
    assert reg.reap() == (1, 0)
    assert [r.replica_id for r in reg.list_replicas()] == ["long"]


def test_heartbeat_keeps_lease(reg: Registry):
    e = reg.register_replica("r1", "mixed", "d", 4, 2.0)
    reg.report_resident("r1", e, ("a", 1), "gpu")
    for _ in range(5):  # 2.5 s in all: alive only because each beat renewed the lease
        time.sleep(0.5)
        assert reg.heartbeat("r1", e, 2.0) is True
    assert len(reg.locations("a")) == 1


def test_stale_epoch_writes_refused(reg: Registry, redis_url):
    old = reg.register_replica("r1", "mixed", "d", 4, 5.0)
    reg.report_resident("r1", old, ("a", 1), "gpu")
    new = reg.register_replica("r1", "mixed", "d", 4, 5.0)
    assert new == old + 1
    assert reg.locations("a") == ()  # a new incarnation holds nothing yet
    before = dump_redis(redis_url)
    msg = f"epoch {old} is stale \\(current epoch {new}\\)"
    with pytest.raises(StaleEpoch, match=msg):
        reg.heartbeat("r1", old, 5.0)
    with pytest.raises(StaleEpoch, match=msg):
        reg.report_resident("r1", old, ("a", 1), "gpu")
    with pytest.raises(StaleEpoch, match=msg):
        reg.remove_resident("r1", old, "a")
    assert dump_redis(redis_url) == before
    assert reg.heartbeat("r1", new, 5.0) is True


def test_replica_lease_reregisters_after_lapse(reg: Registry):
    seen: list[int] = []

    def on_register(epoch: int) -> None:
        seen.append(epoch)
        reg.report_resident("r1", epoch, ("a", 1), "gpu")

    lease = ReplicaLease(
        reg, LeaseConfig("r1", "decode", "d", 4, ttl_s=30.0, interval_s=0.1), on_register
    )
    assert lease.beat() == 1 and seen == [1]
    assert lease.beat() == 1 and seen == [1]
    lapse(reg, "r1")
    assert reg.locations("a") == ()
    assert lease.beat() == 2 and seen == [1, 2]
    assert reg.locations("a") == (Location("r1", "gpu", "decode"),)
    reg.register_replica("r1", "decode", "d", 4, 5.0)  # another incarnation takes the id
    with pytest.raises(StaleEpoch):
        lease.beat()
    assert lease.fenced
    with pytest.raises(StaleEpoch, match="fenced off"):
        lease.beat()


def test_failing_on_register_is_retried_and_keeps_the_lease(reg: Registry, adapters):
    """on_register re-reports what the replica holds; after Redis restarted empty the
    catalog may not know it yet. The lease thread must live on and retry the report."""
    reg.unregister_adapter("a")

    def on_register(epoch: int) -> None:  # AdapterNotFound while "a" is not registered
        reg.report_resident("r1", epoch, reg.get_adapter("a").ref, "gpu")

    cfg = LeaseConfig("r1", "mixed", "d", 4, ttl_s=5.0, interval_s=0.1)
    lease = ReplicaLease(reg, cfg, on_register)
    lease.start_thread()
    try:
        time.sleep(0.35)  # a few beats, each retrying the report
        assert lease._thread.is_alive() and lease.epoch == 1
        assert [r.live for r in reg.list_replicas()] == [True]
        reg.register_adapter("a", str(adapters["a"]))  # back in the catalog
        wait_for(
            lambda: reg.locations("a") == (Location("r1", "gpu", "mixed"),),
            3,
            "the retried report placing a on r1's GPU",
            interval_s=0.02,
        )
        assert lease.epoch == 1  # the same registration: only the report was retried
    finally:
        lease.stop()


def test_lease_thread_keeps_replica_live(reg: Registry):
    lease = ReplicaLease(reg, LeaseConfig("r1", "mixed", "d", 4, ttl_s=2.0, interval_s=0.1))
    lease.start_thread()
    try:
        reg.report_resident("r1", lease.epoch, ("a", 1), "cpu")
        time.sleep(2.5)  # past the TTL: live only because the thread beats
        assert reg.locations("a") == (Location("r1", "cpu", "mixed"),)
        assert lease.epoch == 1
    finally:
        lease.stop()


def test_lease_config_validated():
    with pytest.raises(ValueError, match="interval_s"):
        LeaseConfig("r1", "mixed", "d", 4, ttl_s=1.0, interval_s=0.6)
    with pytest.raises(ValueError, match="pool='gpu'"):
        LeaseConfig("r1", "gpu", "d", 4)

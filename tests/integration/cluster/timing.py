"""Time in registry tests, independent of how fast a loaded machine runs their steps:
Redis's own clock, to bound what may have happened between two steps, and a lease
lapsed at a chosen step instead of by a short TTL."""

from __future__ import annotations

from cluster.registry import Registry


def redis_now_us(reg: Registry) -> int:
    """Redis's clock (TIME), the one its scripts read, in microseconds."""
    s, us = reg.client.time()
    return s * 1_000_000 + us


def lapse(reg: Registry, replica_id: str) -> None:
    """End replica_id's lease now, as its TTL running out does: `cluster.keys` documents
    an absent lease key as a lapsed lease. A test that needs a replica live for some steps
    and lapsed after them cannot get that from a short TTL on a loaded machine, where a
    stall between two steps outlasts it (a lease's own expiry: test_registry_leases)."""
    reg.client.delete(reg.keys.lease(replica_id))

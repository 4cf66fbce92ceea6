"""Time in registry tests, independent of how fast a loaded machine runs their steps:
Redis's own clock, to bound what may have happened between two steps, a lease lapsed
at a chosen step instead of by a short TTL, and the stall to allow for in a bound on
how long something took."""

from __future__ import annotations

import threading
import time

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


class StallMeter:
    """A context in which a thread asks to run every TICK_S; `stall_s` is the longest it
    waited beyond that: how long a loaded machine kept this process from running (about 0
    on an idle one). A test bounding how long the code under test takes adds it to its
    bound, which then holds on a stalled machine and stays tight on an idle one."""

    TICK_S = 0.01

    def __init__(self) -> None:
        self.stall_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.TICK_S):
            now = time.monotonic()
            self.stall_s = max(self.stall_s, now - last - self.TICK_S)
            last = now

    def __enter__(self) -> StallMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

"""`Registry.admit_request` (GCRA on Redis's clock) against a real redis-server: a burst of
exactly the limit, the wait of a refusal, the sustained rate in real time (short periods:
the period is the script's, so a limit per second runs the same code as one per minute),
refusals that do not move the state, and the key's expiry once idle.

Times are read from Redis (TIME) before and after each step, and every bound allows for
what passed between them: a stalled test machine widens what may happen, it does not
turn a right answer wrong."""

from __future__ import annotations

import time

import pytest

from cluster.registry import Registry
from tests.integration.cluster.timing import redis_now_us

MINUTE_US = 60_000_000


class Gcra:
    """One tenant's GCRA state as far as the test can know it, checking each reply.

    The script's `now` is only known to lie between the Redis TIME read before the call
    and the one after it, so the model holds the tenant's TAT as a range [lo, hi] (no key:
    a TAT in the past, (0, 0)). A call must be admitted when its TAT allows it at every
    possible `now`, refused when at none, and a refusal's wait must be what some TAT and
    `now` in range give; each reply then narrows the range. With the emission interval T
    and slack S = (limit - 1) x T: admitted iff TAT - S <= now, then TAT = max(TAT, now) + T;
    a refusal answers TAT - S - now and leaves TAT as it was."""

    def __init__(self, registry: Registry, tenant: str, limit: int, period_ms: int):
        self.registry, self.tenant, self.limit, self.period_ms = registry, tenant, limit, period_ms
        self.interval = -(-period_ms * 1000 // limit)
        self.slack = (limit - 1) * self.interval
        self.tat = (0, 0)

    def admit(self) -> int:
        before = redis_now_us(self.registry)
        wait = self.registry.admit_request(self.tenant, self.limit, self.period_ms)
        after = redis_now_us(self.registry)
        lo, hi = self.tat
        if wait == 0:
            assert lo - self.slack <= after, f"admitted {lo - self.slack - after} us early"
            top = min(max(hi, after), after + self.slack)  # the TAT allowed it at `now`
            self.tat = (max(lo, before) + self.interval, top + self.interval)
        else:
            assert hi - self.slack > before, f"refused {before - hi + self.slack} us late"
            assert lo - self.slack - after <= wait <= hi - self.slack - before, (wait, lo, hi)
            self.tat = (max(lo, wait + self.slack + before), min(hi, wait + self.slack + after))
        return wait


def test_a_burst_of_the_limit_then_a_refusal_until_one_interval_passes(registry: Registry):
    before = redis_now_us(registry)
    replies = [registry.admit_request("acme", 3) for _ in range(5)]
    after = redis_now_us(registry)
    assert replies[:3] == [0, 0, 0]
    # refused: TAT is 60 s past the first admission, and one is admitted once it is
    # (3 - 1) x 20 s ahead: in 20 s less the time since the first
    assert 20_000_000 - (after - before) <= replies[3] <= 20_000_000
    assert replies[4] <= replies[3]
    tat = int(registry.client.get("t:rate:acme"))  # the layout cluster.keys documents
    assert before + MINUTE_US <= tat <= after + MINUTE_US
    ttl_ms = registry.client.pttl(registry.keys.rate("acme"))  # set to the TAT, in ms
    elapsed_ms = (redis_now_us(registry) - before) / 1000
    assert 60_000 - elapsed_ms - 1 <= ttl_ms <= 60_000
    assert registry.admit_request("zeta", 3) == 0  # each tenant its own budget


def test_an_uneven_interval_still_bursts_exactly_the_limit(registry: Registry):
    # 60 s / 7 is 8571428.57 us: rounded up, 7 fit at once and the 8th does not
    assert [registry.admit_request("acme", 7) > 0 for _ in range(8)] == [False] * 7 + [True]


def test_the_sustained_rate_after_a_burst(registry: Registry):
    """Two per second: a burst of 2, then one each 0.5 s, whatever the client sends: each
    reply to a client polling every 20 ms is the one GCRA gives at its time."""
    gcra = Gcra(registry, "acme", 2, period_ms=1000)
    assert [gcra.admit() for _ in range(2)] == [0, 0]
    admitted = refused = 0
    while admitted < 2:  # ~50 polls: admitted 0.5 s and 1 s after the burst
        if gcra.admit() == 0:
            admitted += 1
        else:
            refused += 1
            assert refused < 500, "no admission in 10 s"
        time.sleep(0.02)


def test_refused_requests_do_not_extend_the_wait(registry: Registry):
    gcra = Gcra(registry, "acme", 1, period_ms=60_000)
    assert gcra.admit() == 0
    tat = registry.client.get(registry.keys.rate("acme"))
    waits = [gcra.admit() for _ in range(50)]
    assert all(w > 0 for w in waits) and waits == sorted(waits, reverse=True)
    assert registry.client.get(registry.keys.rate("acme")) == tat  # refusals write nothing


def test_the_wait_of_a_refusal_suffices(registry: Registry):
    gcra = Gcra(registry, "acme", 1, period_ms=600)
    assert gcra.admit() == 0
    for _ in range(10):  # admitted again only past a stall of the period
        if (wait := gcra.admit()) > 0:
            break
    assert wait > 0
    time.sleep(wait / 1e6 + 0.02)
    assert gcra.admit() == 0


def test_the_key_expires_once_idle(registry: Registry):
    before = redis_now_us(registry)
    assert registry.admit_request("acme", 2, period_ms=200) == 0  # TAT 0.1 s ahead
    ttl_ms = registry.client.pttl(registry.keys.rate("acme"))
    elapsed_ms = (redis_now_us(registry) - before) / 1000
    if ttl_ms == -2:  # gone already: only once its TAT passed
        assert elapsed_ms >= 100
    else:
        assert 100 - elapsed_ms - 1 <= ttl_ms <= 100
    time.sleep(0.15)
    assert not registry.client.exists(registry.keys.rate("acme"))
    assert [registry.admit_request("acme", 2, period_ms=200) for _ in range(2)] == [0, 0]


@pytest.mark.parametrize("limit, period_ms", [(0, 60_000), (-1, 60_000), (5, 0)])
def test_a_bad_limit_or_period_is_refused(registry: Registry, limit, period_ms):
    with pytest.raises(ValueError) as e:
        registry.admit_request("acme", limit, period_ms)
    assert str(e.value) == f"limit={limit}, period_ms={period_ms}; allowed: both >= 1"
    assert not registry.client.exists(registry.keys.rate("acme"))

"""`Registry.admit_request` (GCRA on Redis's clock) against a real redis-server: a burst of
exactly the limit, the wait of a refusal, the sustained rate in real time (short periods:
the period is the script's, so a limit per second runs the same code as one per minute),
refusals that do not move the state, and the key's expiry once idle."""

from __future__ import annotations

import time

import pytest

from cluster.registry import Registry

MINUTE_US = 60_000_000


def redis_now_us(registry: Registry) -> int:
    s, us = registry.client.time()
    return s * 1_000_000 + us


def test_a_burst_of_the_limit_then_a_refusal_until_one_interval_passes(registry: Registry):
    before = redis_now_us(registry)
    replies = [registry.admit_request("acme", 3) for _ in range(5)]
    assert replies[:3] == [0, 0, 0]
    # refused: TAT is 60 s ahead, and one is admitted once it is (3 - 1) x 20 s ahead
    assert 19_900_000 < replies[3] <= 20_000_000
    assert replies[4] <= replies[3]
    tat = int(registry.client.get("t:rate:acme"))  # the layout cluster.keys documents
    assert before + MINUTE_US <= tat <= redis_now_us(registry) + MINUTE_US
    assert 59_000 < registry.client.pttl(registry.keys.rate("acme")) <= 60_000
    assert registry.admit_request("zeta", 3) == 0  # each tenant its own budget


def test_an_uneven_interval_still_bursts_exactly_the_limit(registry: Registry):
    # 60 s / 7 is 8571428.57 us: rounded up, 7 fit at once and the 8th does not
    assert [registry.admit_request("acme", 7) > 0 for _ in range(8)] == [False] * 7 + [True]


def test_the_sustained_rate_after_a_burst(registry: Registry):
    """Two per second: a burst of 2, then one each 0.5 s, whatever the client sends."""
    assert [registry.admit_request("acme", 2, period_ms=1000) for _ in range(2)] == [0, 0]
    start = time.monotonic()
    admitted = []
    while time.monotonic() - start < 1.25:  # ~60 tries; two of them fall past 0.5 s, 1 s
        if registry.admit_request("acme", 2, period_ms=1000) == 0:
            admitted.append(time.monotonic() - start)
        time.sleep(0.02)
    assert len(admitted) == 2
    assert 0.45 <= admitted[0] and 0.45 <= admitted[1] - admitted[0]


def test_refused_requests_do_not_extend_the_wait(registry: Registry):
    assert registry.admit_request("acme", 1, period_ms=600) == 0
    tat = registry.client.get(registry.keys.rate("acme"))
    start = time.monotonic()
    first = registry.admit_request("acme", 1, period_ms=600)
    assert 400_000 < first <= 600_000
    waits = [registry.admit_request("acme", 1, period_ms=600) for _ in range(50)]
    assert all(w > 0 for w in waits) and waits == sorted(waits, reverse=True)
    assert registry.client.get(registry.keys.rate("acme")) == tat  # refusals write nothing
    time.sleep(max(0.0, start + first / 1e6 + 0.02 - time.monotonic()))
    assert registry.admit_request("acme", 1, period_ms=600) == 0  # the first wait sufficed


def test_the_key_expires_once_idle(registry: Registry):
    assert registry.admit_request("acme", 2, period_ms=200) == 0  # TAT 0.1 s ahead
    assert 0 < registry.client.pttl(registry.keys.rate("acme")) <= 100
    time.sleep(0.15)
    assert not registry.client.exists(registry.keys.rate("acme"))
    assert [registry.admit_request("acme", 2, period_ms=200) for _ in range(2)] == [0, 0]


@pytest.mark.parametrize("limit, period_ms", [(0, 60_000), (-1, 60_000), (5, 0)])
def test_a_bad_limit_or_period_is_refused(registry: Registry, limit, period_ms):
    with pytest.raises(ValueError) as e:
        registry.admit_request("acme", limit, period_ms)
    assert str(e.value) == f"limit={limit}, period_ms={period_ms}; allowed: both >= 1"
    assert not registry.client.exists(registry.keys.rate("acme"))

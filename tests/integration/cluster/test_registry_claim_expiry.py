"""Claims on a real redis-server that expired while their claims key lives on (another
replica's later claim holds the key): each claim's own expiry, not only the key's, ends
it, both as a copy against a warm target (claim_warm) and in the hot ranking
(hot_adapters). `test_registry_demand` covers claims whose key expires with them."""

from __future__ import annotations

import time

import pytest

from cluster.registry import Registry


@pytest.fixture
def reg(registry: Registry, adapters) -> Registry:
    registry.register_adapter("a", str(adapters["a"]))
    return registry


def claim(reg: Registry, kind: str, replica: str, epoch: int, claim_s: float) -> None:
    """Give replica a claim of kind ("warm" | "prefetch") on adapter a lasting claim_s."""
    if kind == "warm":
        assert reg.claim_warm(replica, epoch, ["a"], claim_s) == ["a"]
    else:
        assert [h.ref.name for h in reg.hot_adapters(replica, epoch, 1, claim_s)] == ["a"]


@pytest.mark.parametrize("kind", ["warm", "prefetch"])
def test_an_expired_claim_in_a_live_claims_key_is_no_copy(reg: Registry, kind: str):
    e = {r: reg.register_replica(r, "mixed", "d", 2, 30.0) for r in ("src", "r0", "r1", "r2")}
    reg.report_active("src", e["src"], {"a": 4})  # demand, no GPU copy
    reg.warm("a", 2)
    claim(reg, kind, "r1", e["r1"], 30.0)  # first, so the key lives 30 s
    claim(reg, kind, "r0", e["r0"], 0.05)
    time.sleep(0.1)  # r0's claim expired; its entry is still in the key
    assert reg.client.hexists(f"t:{kind}_claims:a", "r0") == 1
    # the target 2 counts r1's claim only: r2 gets the second copy
    assert reg.claim_warm("r2", e["r2"], ["a"], 30.0) == ["a"]
    # copies of a for a new starter: src (active), r1's and r2's claims, not r0's
    new = reg.register_replica("new", "mixed", "d", 2, 30.0)
    rows = reg.hot_adapters("new", new, 1, 30.0)
    assert [(h.ref.name, h.copies) for h in rows] == [("a", 3)]

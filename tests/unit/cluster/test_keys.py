"""Key layout and name validation (pure)."""

from __future__ import annotations

import pytest

from cluster.keys import Keys, check_name


def test_every_key_is_under_the_namespace():
    k = Keys("prod")
    built = [
        k.adapters, k.adapter("a"), k.version("a"), k.grants("a"), k.tenants, k.tenant("t"),
        k.tenant_keys("t"), k.tenant_key_created("t"), k.apikey("h"), k.replicas, k.replica("r"), k.epoch("r"),
        k.lease("r"), k.resident("a"), k.replica_adapters("r"), k.pins, k.warm, k.draining,
        k.desired, k.hints, k.active("a"), k.replica_active("r"), k.active_names,
        k.warm_claims("a"), k.prefetch_claims("a"),
    ]  # fmt: skip
    assert all(key.startswith("prod:") for key in built)
    assert len(set(built)) == len(built)
    assert k.adapter("a") == "prod:adapter:a"
    assert k.lease("r1") == "prod:lease:r1"
    assert k.resident("x/y") == "prod:resident:x/y"
    assert k.pattern == "prod:*"


@pytest.mark.parametrize("ns", ["", "a:b", "a b", "x" * 65])
def test_bad_namespace_refused(ns: str):
    with pytest.raises(ValueError, match="namespace"):
        Keys(ns)


@pytest.mark.parametrize("name", ["llama-7b/sql", "a.b_c-1", "x" * 128])
def test_good_names(name: str):
    assert check_name("adapter", name) == name


@pytest.mark.parametrize("name", ["", "a:b", "a|b", "a b", "x" * 129, "é"])
def test_bad_names_refused(name: str):
    with pytest.raises(ValueError, match="adapter name .* is invalid; allowed"):
        check_name("adapter", name)

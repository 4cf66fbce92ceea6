"""Plan reply parsing: statuses become values or typed errors (pure, no Redis)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cluster import ops
from cluster.records import AdapterRecord, Location, WarmTarget
from lora_core.errors import (
    AdapterAlreadyExists,
    AdapterDraining,
    AdapterNotFound,
    InvalidRequest,
    PinRefused,
    StaleEpoch,
    Unauthorized,
)

REC = {"name": "a", "version": "3", "content_hash": "ab" * 32, "path": "/p", "rank": "8",
       "base_model": "m", "target_modules": '["q_proj"]', "owner": "", "public": "0",
       "created": "1.5", "state": "active"}  # fmt: skip


def reply(*items: object) -> str:
    return json.dumps(list(items))


@pytest.mark.parametrize(
    "status,error",
    [("not_found", AdapterNotFound), ("draining", AdapterDraining),
     ("unauthorized", Unauthorized)],
)  # fmt: skip
def test_resolve_request_errors(status: str, error: type):
    with pytest.raises(error):
        ops.resolve_request("a", "", True).parse(reply(status))


def test_resolve_request_value():
    got = ops.resolve_request("a", "h", True).parse(
        reply("ok", REC, "t1", [["r2", "cpu", "decode"], ["r1", "gpu", "prefill"]])
    )
    assert got.tenant == "t1"
    assert (got.ref.name, got.ref.version, got.ref.rank) == ("a", 3, 8)
    assert got.locations == (Location("r1", "gpu", "prefill"), Location("r2", "cpu", "decode"))
    # cjson encodes an empty Lua table as an object
    assert ops.resolve_request("a", "", False).parse(reply("ok", REC, "", {})).locations == ()
    assert ops.resolve_request("a", "", False).parse(reply("ok", REC, "", {})).tenant is None


def test_plan_args():
    plan = ops.resolve_request("a", "h", False)
    assert (plan.script, plan.args) == ("resolve_request", ("a", "h", 0))
    assert ops.heartbeat("r1", 4, 1500).args == ("r1", 4, 1500)


def test_heartbeat_statuses():
    hb = ops.heartbeat("r1", 2, 1000)
    assert hb.parse(reply("ok")) is True
    assert hb.parse(reply("lapsed", "2")) is False
    with pytest.raises(StaleEpoch, match=r"epoch 2 is stale \(current epoch 5\)"):
        hb.parse(reply("stale", "5"))


def test_fenced_write_statuses():
    plan = ops.fenced_write("report_resident", (), "r1", 2, "a")
    assert plan.parse(reply("ok")) == []
    with pytest.raises(StaleEpoch, match="lapsed; re-register"):
        plan.parse(reply("lapsed", "2"))
    with pytest.raises(StaleEpoch, match="stale"):
        plan.parse(reply("stale", "3"))
    with pytest.raises(AdapterNotFound, match="'a'"):
        plan.parse(reply("not_found"))


def test_register_and_tenant_statuses():
    rec = AdapterRecord.from_hash(REC)
    plan = ops.register_adapter(rec, False)
    assert plan.args[:4] == ("a", 0, "", 0) and plan.args[-1] == 1
    assert plan.parse(reply("ok", 4, "", "0")) == dataclasses.replace(rec, version=4)
    # a replace that keeps the stored owner / public flag: the reply says what was kept
    keep = ops.register_adapter(rec, True, owner_given=False, public_given=False)
    assert (keep.args[1], keep.args[3], keep.args[-1]) == (1, "", 0)
    stored = keep.parse(reply("ok", 5, "acme", "1"))
    assert stored == dataclasses.replace(rec, version=5, owner="acme", public=True)
    with pytest.raises(AdapterAlreadyExists, match=r"version 2\); allowed: pass replace"):
        plan.parse(reply("exists", "2"))
    with pytest.raises(InvalidRequest, match="tenant 'x' does not exist"):
        plan.parse(reply("no_tenant", "x"))
    with pytest.raises(InvalidRequest, match="tenant 't' already exists"):
        ops.create_tenant("t", 0.0).parse(reply("exists"))


def test_listing_and_desired_decode():
    (item,) = ops.listing([[[REC, "decode", "2|prefill", [["r1", "gpu", "mixed"]]]]])
    assert (item.pin, item.warm) == ("decode", WarmTarget(2, "prefill"))
    assert item.to_json()["locations"] == [{"replica": "r1", "tier": "gpu", "pool": "mixed"}]
    assert ops.listing([{}]) == []
    state = ops.desired([7, {"a": "all"}, {"a": "3|decode"}, ["b"], {"a": REC}])
    assert (state.version, state.pins, state.draining) == (7, {"a": "all"}, frozenset({"b"}))
    assert state.warm == {"a": WarmTarget(3, "decode")}
    assert state.refs["a"].version == 3
    empty = ops.desired([0, {}, {}, {}, {}])
    assert (empty.pins, empty.warm, empty.draining, empty.refs) == ({}, {}, frozenset(), {})


def test_list_api_keys_decode():
    plan = ops.list_api_keys("t")
    assert (plan.script, plan.args) == ("list_api_keys", ("t",))
    got = plan.parse(reply("ok", [["b" * 64, "20.5"], ["c" * 64, ""], ["a" * 64, "10"]]))
    assert [(k.key_id, k.created) for k in got] == [
        ("c" * 12, None), ("a" * 12, 10.0), ("b" * 12, 20.5)
    ]  # fmt: skip
    assert plan.parse(reply("ok", {})) == []
    with pytest.raises(InvalidRequest, match="tenant 'x' does not exist"):
        plan.parse(reply("no_tenant", "x"))


def test_revoke_api_keys_statuses():
    plan = ops.revoke_api_keys("t", "abcdef")
    assert (plan.script, plan.args) == ("revoke_api_keys", ("t", "abcdef"))
    assert plan.parse(reply("ok", ["f" * 64, "a" * 64])) == ["a" * 12, "f" * 12]
    assert plan.parse(reply("ok", {})) == []
    with pytest.raises(InvalidRequest, match=r"no key with id 'abcdef'; allowed: .*tenants keys t"):
        plan.parse(reply("no_key"))
    with pytest.raises(
        InvalidRequest, match=r"matches 2 keys .* \(abcdef000000, abcdef111111\); allowed: a longer"
    ):
        plan.parse(reply("ambiguous", ["abcdef1111119", "abcdef0000009"]))
    with pytest.raises(InvalidRequest, match="tenant 'x' does not exist"):
        plan.parse(reply("no_tenant", "x"))


def test_pin_statuses():
    plan = ops.pin("c", "decode")
    assert (plan.script, plan.args) == ("pin", ("c", "decode"))
    assert plan.parse(reply("ok")) is None
    with pytest.raises(PinRefused) as err:
        plan.parse(reply("refused", 3, ["a", "b"]))
    assert str(err.value) == (
        "pinning 'c' would leave replicas no evictable GPU adapter slot: each has 3 slots "
        "(max_loras) and 2 pinned already (a, b); allowed: at most 2 pinned at a time "
        "(max_loras - 1, over all pools: mixed replicas take every pin); unpin one of them first"
    )
    # one slot: nothing to unpin, no pin is possible at all (cjson sends [] as {})
    none = r"1 slots \(max_loras\) and none pinned yet; allowed: at most 0 pinned .*every pin\)$"
    with pytest.raises(PinRefused, match=none):
        plan.parse(reply("refused", 1, {}))
    with pytest.raises(AdapterNotFound, match="'c'"):
        plan.parse(reply("not_found"))
    with pytest.raises(AdapterDraining, match="'c'"):
        plan.parse(reply("draining"))


def test_deregister_replica_statuses():
    plan = ops.deregister_replica("r1", 4)
    assert (plan.script, plan.args) == ("deregister_replica", ("r1", 4))
    assert plan.parse(reply("ok")) is True
    assert plan.parse(reply("stale", "5")) is False


@pytest.mark.parametrize(
    "limit, period_us, interval_us",
    [(600, 60_000_000, 100_000), (7, 60_000_000, 8_571_429), (1, 60_000_000, 60_000_000),
     (120_000_000, 60_000_000, 1)],
)  # fmt: skip
def test_admit_request_interval_rounds_up_to_a_microsecond(limit, period_us, interval_us):
    assert ops.admit_request("acme", limit, period_us).args == ("acme", interval_us, limit)


def test_admit_request_replies():
    plan = ops.admit_request("acme", 3, 60_000_000)
    assert plan.script == "admit_request"
    assert plan.parse(reply("ok")) == 0
    assert plan.parse(reply("limited", 19_999_123)) == 19_999_123

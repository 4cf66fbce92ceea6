"""Records, choices and pool rules (pure)."""

from __future__ import annotations

import json

import pytest

from cluster.records import (
    AdapterRecord,
    ApiKeyInfo,
    ServedBase,
    check_choice,
    check_key_id,
    key_id,
    pin_applies,
)
from lora_core.base_shape import BaseShape

SHAPE = BaseShape("LlamaForCausalLM", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate=128)  # fmt: skip


@pytest.mark.parametrize(
    "pin,replica,expected",
    [("all", "prefill", True), ("all", "mixed", True), ("prefill", "prefill", True),
     ("prefill", "mixed", True), ("prefill", "decode", False), ("decode", "decode", True),
     ("decode", "prefill", False), ("decode", "mixed", True)],
)  # fmt: skip
def test_pin_applies(pin: str, replica: str, expected: bool):
    assert pin_applies(pin, replica) is expected


def test_check_choice_message():
    assert check_choice("tier", "gpu", ("gpu", "cpu")) == "gpu"
    with pytest.raises(ValueError, match="tier='x'; allowed: gpu, cpu"):
        check_choice("tier", "x", ("gpu", "cpu"))


def test_record_from_hash_and_ref():
    rec = AdapterRecord.from_hash(
        {"name": "a", "version": "2", "content_hash": "f" * 64, "path": "/p", "rank": "16",
         "base_model": "m", "target_modules": '["q_proj", "v_proj"]', "owner": "t",
         "public": "1", "created": "3.0", "state": "draining"}
    )  # fmt: skip
    assert (rec.version, rec.rank, rec.public, rec.state) == (2, 16, True, "draining")
    assert rec.target_modules == ("q_proj", "v_proj")
    assert rec.ref.key == "a@2:" + "f" * 16
    assert (rec.ref.path, rec.ref.base_model) == ("/p", "m")


def test_key_id_and_info():
    assert key_id("0123456789abcdef" * 4) == "0123456789ab"
    assert ApiKeyInfo("0123456789ab", None).to_json() == {"key_id": "0123456789ab", "created": None}


@pytest.mark.parametrize(
    "text,expected",
    [("abcdef", "abcdef"), ("ABCDEF012345", "abcdef012345"), (" 0123456789ab\n", "0123456789ab"),
     ("f" * 64, "f" * 64)],
)  # fmt: skip
def test_check_key_id_accepts_hex_prefixes(text: str, expected: str):
    assert check_key_id(text) == expected


@pytest.mark.parametrize("text", ["", "abcde", "f" * 65, "lf-abcdef", "abcdeg", "abc def"])
def test_check_key_id_refuses(text: str):
    with pytest.raises(ValueError, match="key id .* is invalid; allowed: 6-64 hex characters"):
        check_key_id(text)


@pytest.mark.parametrize("max_loras", [None, 1, 8])
def test_served_base_json_round_trip(max_loras: int | None):
    served = ServedBase("m", SHAPE, max_lora_rank=16, max_loras=max_loras)
    assert ServedBase.from_json(served.to_json()) == served


def test_served_base_from_a_record_without_max_loras():
    old = json.loads(ServedBase("m", SHAPE, 16, 4).to_json())
    del old["max_loras"]  # published before the slot count was
    assert ServedBase.from_json(json.dumps(old)) == ServedBase("m", SHAPE, 16, None)


def test_served_base_of_a_moe_model_round_trips_its_sparse_layers():
    """moe_layers comes back from JSON as the tuple it was; a record stored before it
    existed reads as () (unknown)."""
    moe = BaseShape("Qwen3MoeForCausalLM", 3, 64, 4, 2, 16, 128, 4, (True, False, True))
    served = ServedBase("m", moe, 16, 4)
    back = ServedBase.from_json(served.to_json())
    assert back == served and back.shape.moe_layers == (True, False, True)
    old = json.loads(served.to_json())
    del old["shape"]["moe_layers"]
    assert ServedBase.from_json(json.dumps(old)).shape.moe_layers == ()


def test_served_base_refuses_no_slots():
    with pytest.raises(ValueError, match="max_loras=0; allowed: >= 1, or None"):
        ServedBase("m", SHAPE, 16, 0)


def test_served_base_from_a_newer_record_drops_unknown_shape_fields():
    """A record written by a newer version (a shape field this one lacks) still reads,
    through both the served-base record and the registry's stored base shape."""
    newer = json.loads(ServedBase("m", SHAPE, 16, 4).to_json())
    newer["shape"]["a_field_from_the_future"] = [1, 2]
    assert ServedBase.from_json(json.dumps(newer)) == ServedBase("m", SHAPE, 16, 4)
    assert BaseShape.from_record(newer["shape"]) == SHAPE

"""Records, choices and pool rules (pure)."""

from __future__ import annotations

import pytest

from cluster.records import (
    AdapterRecord,
    ApiKeyInfo,
    check_choice,
    check_key_id,
    key_id,
    pin_applies,
)


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

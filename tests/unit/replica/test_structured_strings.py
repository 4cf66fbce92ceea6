"""JSON strings under a schema's minLength / maxLength are JSON: xgrammar 0.2.9's rule for
their characters let raw control characters through (a tab, U+0001; json.loads refuses
them) and no escapes. `replica.structured_spec.json_strings_escaped` replaces it: any
character but the control characters, the quote and the backslash, or an escape, each
counted as one character."""

from __future__ import annotations

import json
import random

import pytest
import xgrammar as xgr

from replica.structured_spec import StructuredOutput
from tests.unit.replica.test_structured_spec import accepts

ALPHABET = 'ab é\t\n\x01\x1f"\\/€𝄞'


def bmp(value: str) -> bool:
    """No character past U+FFFF: escaped, one of those is a surrogate pair, two escapes,
    which the grammar counts as two characters (JSON Schema counts one)."""
    return all(ord(c) <= 0xFFFF for c in value)


def _spec(bounds: dict, whitespace: int) -> StructuredOutput:
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", **bounds}, "t": {"type": "array", "items": {
            "type": "string", **bounds}}},
        "required": ["s", "t"],
    }  # fmt: skip
    return StructuredOutput("json", json.dumps(schema), whitespace)


@pytest.mark.parametrize("whitespace", [0, 20])
@pytest.mark.parametrize(
    "bounds", [{"maxLength": 6}, {"minLength": 2}, {"minLength": 1, "maxLength": 3}]
)
def test_bounded_strings_take_json_escapes_and_refuse_raw_control_characters(
    grammars, bounds, whitespace
):
    spec = _spec(bounds, whitespace)
    lo, hi = bounds.get("minLength", 0), bounds.get("maxLength")
    rng = random.Random()
    for _ in range(40):  # fresh random strings each run, lengths lo to hi + 1
        value = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(lo, (hi or 8) + 1)))
        text = json.dumps(
            {"s": value, "t": [value]}, ensure_ascii=bmp(value) and rng.random() < 0.5
        )
        fits = lo <= len(value) and (hi is None or len(value) <= hi)
        assert accepts(grammars, spec, text) == fits, (value, text)
        raw = [c for c in value if c < " "]  # the same value with its control characters raw
        if fits and raw:
            unescaped = text.replace(json.dumps(raw[0])[1:-1], raw[0])
            assert not accepts(grammars, spec, unescaped), unescaped
            with pytest.raises(json.JSONDecodeError):
                json.loads(unescaped)


def test_schemas_without_bounded_strings_keep_xgrammars_grammar():
    plain = StructuredOutput("json", json.dumps({"type": "string", "pattern": "^a+$"}))
    assert str(plain.grammar()) == str(
        xgr.Grammar.from_json_schema(plain.value, any_whitespace=False)
    )

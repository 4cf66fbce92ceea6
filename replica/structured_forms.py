"""A structured output's JSON forms read into a `StructuredOutput`: vLLM's
`structured_outputs` object (REST, the offline runner) and one spec's JSON value (REST's
`response_format` and `guided_*` fields, gRPC's `structured_*` fields). Every problem is a
ValueError naming the field at fault ("structured_outputs.regex: ...").
"""

from __future__ import annotations

import json

from replica.structural_tag import structural_tag_text
from replica.structured_spec import (
    FREE_WHITESPACE,
    WHITESPACE_KINDS,
    StructuredOutput,
    parse_json_schema,
)

SPEC_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
BACKENDS = ("auto", "xgrammar")


def structured_outputs_of(value: object, field: str = "structured_outputs") -> StructuredOutput:
    """vLLM's structured_outputs object -> StructuredOutput; ValueError naming the field
    at fault (\"structured_outputs.regex: ...\")."""
    if not isinstance(value, dict):
        raise ValueError(f"{field}: got {type(value).__name__}; allowed: an object")
    given = [k for k in SPEC_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise ValueError(
            f"{field}: {len(given)} of {', '.join(SPEC_KEYS)} given; allowed: exactly one"
        )
    check_backend(value.get("backend"), f"{field}.backend")
    free = value.get("disable_any_whitespace")
    if free is not None and not isinstance(free, bool):
        raise ValueError(f"{field}.disable_any_whitespace: allowed: true, false or null")
    if free is False and given[0] not in WHITESPACE_KINDS:
        raise ValueError(
            f"{field}.disable_any_whitespace: false applies to json and json_object only; "
            f"allowed with {given[0]}: true or null"
        )
    whitespace = FREE_WHITESPACE if free is False else 0
    known = {*SPEC_KEYS, "backend", "disable_any_whitespace"}
    extra = sorted(k for k in value if k not in known and value[k] not in (None, False))
    if extra:
        raise ValueError(f"{field}.{extra[0]}: not supported; allowed: null")
    key = given[0]
    if key == "json_object":
        if value[key] is not True:
            raise ValueError(f"{field}.json_object: allowed: true or null")
        return StructuredOutput("json_object", whitespace=whitespace)
    return spec_from_json(key, value[key], f"{field}.{key}", whitespace)


def spec_from_json(kind: str, value: object, field: str, whitespace: int = 0) -> StructuredOutput:
    """StructuredOutput(kind, value) from JSON (whitespace: json's; a structural tag's
    value: its object or that object's JSON text); ValueError naming field."""
    try:
        if kind == "json":
            return StructuredOutput("json", parse_json_schema(value), whitespace)
        if kind == "choice":
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise ValueError("allowed: a list of strings")
            return StructuredOutput("choice", tuple(value))
        if kind == "structural_tag":
            return StructuredOutput("structural_tag", structural_tag_text(value, field))
        if not isinstance(value, str):
            raise ValueError(f"got {type(value).__name__}; allowed: a string")
        return StructuredOutput(kind, value)
    except ValueError as e:
        text = str(e)
        raise ValueError(text if text.startswith(field) else f"{field}: {text}") from None


def check_backend(backend: object, field: str) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"{field}: got {json.dumps(backend)[:60]}; allowed: null, " + ", ".join(BACKENDS)
        )


def whitespace_pattern_refused(field: str) -> str:
    return (
        f"{field}: not supported (xgrammar takes no whitespace pattern, and a pattern "
        "such as [\\n ]* would let a model loop on newlines); allowed: null, or "
        "structured_outputs with disable_any_whitespace false for JSON with at most "
        f"{FREE_WHITESPACE} whitespace characters between tokens"
    )

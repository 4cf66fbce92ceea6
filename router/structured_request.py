"""The request fields that ask for structured outputs (`replica.structured`), read into one
`StructuredOutput`: OpenAI's `response_format`, vLLM's `structured_outputs` and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` / `structural_tag`; gRPC's
`structured_*` fields (structured_any_whitespace: free whitespace in a JSON one;
structured_structural_tag: a structural tag's JSON text).

    response_format     {"type": "text"} (none), {"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"name", "schema", "strict"?,
                        "description"?}}, or vLLM's {"type": "structural_tag", ...}
                        (`replica.structural_tag`: "structures" and "triggers", or "format")
    structured_outputs  {"json": schema} | {"regex": str} | {"choice": [str]} |
                        {"grammar": EBNF} | {"json_object": true} |
                        {"structural_tag": a structural tag's JSON text (vLLM's) or
                        object}, with vLLM's
                        "disable_any_whitespace" (true / null: compact JSON; false, with
                        json or json_object only: free whitespace, at most
                        FREE_WHITESPACE characters per gap) and "backend" "auto" /
                        "xgrammar" / null
    guided_json ...     the same, one field each (guided_decoding_backend as "backend";
                        guided_whitespace_pattern refused); structural_tag likewise

At most one of them per request (two are refused, naming the second). Every spec is
parsed here, on the ingress, so a schema xgrammar does not support, or a regular
expression or grammar that does not parse, is a 400 naming its field before any replica
sees it; the replica compiles it against its tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, PrivateAttr, model_validator

from replica.structured_forms import (
    check_backend,
    spec_from_json,
    structured_outputs_of,
    whitespace_pattern_refused,
)
from replica.structured_spec import FREE_WHITESPACE, WHITESPACE_KINDS, StructuredOutput, checked

LEGACY = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
}
FIELDS = ("response_format", "structured_outputs", *LEGACY)
"""The body fields that ask for a structured output."""
STRUCTURED_FIELDS = "response_format, structured_outputs, guided_* or structural_tag"
"""FIELDS, in words (a forced tool call given with one: `router.tools.forcing_grammar`)."""
GRPC_FIELDS = {
    "structured_json_schema": "json",
    "structured_json_object": "json_object",
    "structured_regex": "regex",
    "structured_choice": "choice",
    "structured_grammar": "grammar",
    "structured_structural_tag": "structural_tag",
}
"""GenerateRequest's structured-output fields -> the kind each asks for."""
GRPC_STRUCTURED_FIELDS = "structured_*"
"""GRPC_FIELDS, in words."""
GRPC_WHITESPACE = "structured_any_whitespace"
"""GenerateRequest's flag for free whitespace in a JSON schema's or object's output."""


def structured_of(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The structured output a raw request body asks for (None: none); ValueError naming
    the field at fault ("guided_regex: ..."). Example: {"guided_choice": ["a", "b"]} ->
    StructuredOutput("choice", ("a", "b"))."""
    found: list[tuple[str, StructuredOutput]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            schema = body["response_format"]["type"] == "json_schema"
            found.append(("response_format.json_schema" if schema else "response_format", spec))
    if body.get("structured_outputs") is not None:
        spec = structured_outputs_of(body["structured_outputs"])
        found.append((f"structured_outputs.{spec.kind}", spec))
    for name, kind in LEGACY.items():
        if body.get(name) is not None:
            found.append((name, spec_from_json(kind, body[name], name)))
    check_backend(body.get("guided_decoding_backend"), "guided_decoding_backend")
    if body.get("guided_whitespace_pattern") is not None:
        raise ValueError(whitespace_pattern_refused("guided_whitespace_pattern"))
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(
            f"{found[1][0]}: given with {found[0][0]}; allowed: one structured output "
            f"({STRUCTURED_FIELDS}) per request"
        )
    return checked(*found[0])


def _response_format(fmt: object) -> StructuredOutput | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    allowed = (
        'allowed: {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", '
        '"json_schema": {...}} or {"type": "structural_tag", ...}'
    )
    if fmt == {} or (kind == "text" and set(fmt) == {"type"}):
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return StructuredOutput("json_object")
    if kind == "structural_tag":
        return spec_from_json("structural_tag", fmt, "response_format")
    if kind != "json_schema":
        raise ValueError(f"response_format: got {json.dumps(fmt)[:200]}; {allowed}")
    inner = fmt.get("json_schema")
    if not isinstance(inner, dict) or "schema" not in inner:
        raise ValueError(
            'response_format.json_schema: allowed: an object with "schema" (a JSON schema), '
            'and "name", "strict", "description"'
        )
    extra = set(inner) - {"name", "schema", "strict", "description"}
    if extra:
        raise ValueError(f"response_format.json_schema: unknown field {sorted(extra)[0]!r}")
    return spec_from_json("json", inner["schema"], "response_format.json_schema.schema")


class StructuredBody(BaseModel):
    """Mixin of the OpenAI request bodies: `structured` is what the body asks for."""

    _structured: StructuredOutput | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _read_structured(cls, data: Any, handler: Any) -> Any:
        model = handler(data)
        if isinstance(data, dict):
            model._structured = structured_of(data)
        return model

    @property
    def structured(self) -> StructuredOutput | None:
        return self._structured


def grpc_asks_grammar(req: Any) -> bool:
    """Whether a GenerateRequest sets any structured_* field."""
    return any(_grpc_given(req, name) for name in GRPC_FIELDS)


def _grpc_given(req: Any, name: str) -> bool:
    """Whether req sets field name: a field with presence (`optional`) when it is set,
    even to "" (then refused as what it is), any other when it is not empty / false."""
    if req.DESCRIPTOR.fields_by_name[name].has_presence:
        return req.HasField(name)
    return bool(getattr(req, name))


def grpc_structured(req: Any) -> StructuredOutput | None:
    """The structured output of a GenerateRequest's structured_* fields (None: none);
    ValueError naming the field at fault."""
    found = [(name, kind) for name, kind in GRPC_FIELDS.items() if _grpc_given(req, name)]
    json_fields = " or ".join(n for n, k in GRPC_FIELDS.items() if k in WHITESPACE_KINDS)
    free = getattr(req, GRPC_WHITESPACE)
    if free and (not found or found[0][1] not in WHITESPACE_KINDS):
        given = f"given with {found[0][0]}" if found else "given alone"
        raise ValueError(f"{GRPC_WHITESPACE}: {given}; allowed: true only with {json_fields}")
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(
            f"{found[1][0]}: given with {found[0][0]}; allowed: one structured_* field"
        )
    field, kind = found[0]
    whitespace = FREE_WHITESPACE if free else 0
    if kind == "json_object":
        return StructuredOutput("json_object", whitespace=whitespace)
    value = getattr(req, field)
    value = list(value) if kind == "choice" else value
    return checked(field, spec_from_json(kind, value, field, whitespace))
